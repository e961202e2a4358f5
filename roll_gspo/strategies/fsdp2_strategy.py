"""torch FSDP2 (`fully_shard`) engine for a role (`strategy_name: fsdp2_train` / `fsdp2_infer`):
the model's units (its decoder layers, by default) and the root sharded over the role's ranks
(or HSDP: replicas of `fsdp_size` shards), forward passes, optimizer steps with gradient
accumulation, bucketed gathers of whole weights, and sharded checkpoints (torch.distributed.checkpoint).
NCCL on GPUs, gloo on CPUs.

Precision: fsdp2_train keeps the sharded master weights and Adam's states in fp32 and computes in
`model_args.dtype` (MixedPrecisionPolicy.param_dtype); gradients are reduced in `reduce_dtype`
(fp32 by default). fsdp2_infer loads and computes in `model_args.dtype`.

ROLL's keys (`strategy_config`) are declared and documented in `schema.FSDP2StrategyConfig`.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch
from torch.distributed.tensor import DTensor

from roll_gspo.config.plan.fsdp2 import parse_fsdp2_config
from roll_gspo.schema.config import FSDP2_DTYPES, RoleConfig
from roll_gspo.models.causal_lm import TORCH_DTYPES
from roll_gspo.strategies.deepspeed_offload import StateOffloader
from roll_gspo.strategies.train_engine import TrainEngineStrategy, build_optimizer, load_policy_model, use_cpu_threads

logger = logging.getLogger("roll_gspo.fsdp2")
CHECKPOINT_DIR = "fsdp2"  # torch.distributed.checkpoint's shards of model and optimizer
TRAINER_STATE = "fsdp2_trainer_state.pt"  # LR schedule and step counters (rank 0 writes)
RNG_STATE = "fsdp2_rng_rank{rank}.pt"  # each rank's RNG


class FSDP2Strategy(TrainEngineStrategy):
    """One rank's FSDP2 engine for `role`. `train=False` builds a frozen (reference) engine.
    `offload`: its states may move to CPU between phases (`offloader`; roll_gspo.placement.colocation)."""

    def __init__(self, role: RoleConfig, *, train: bool, total_optimizer_steps: int = 1, seed: int = 0,
                 offload: bool = False, value_model: bool = False):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        from roll_gspo.distributed.fault_tolerance import collective_timeout

        self.role, self.train = role, train
        self.options = parse_fsdp2_config(role.strategy_args.strategy_config)
        on_gpu = torch.cuda.is_available()
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if on_gpu else "gloo", timeout=collective_timeout())
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        else:
            use_cpu_threads()
        self.world_size = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        torch.manual_seed(seed)

        self.compute_dtype = TORCH_DTYPES[role.model_args.dtype]
        # Training loads fp32 master weights; the saved config names the dtype the weights are saved in.
        model, self.model_config = load_policy_model(role, train, "fp32" if train else role.model_args.dtype,
                                                     value_model)
        self.model_config.dtype = self.compute_dtype
        if train:
            reduce = self.options.reduce_dtype or ("fp32" if self.options.enable_mix_precision else role.model_args.dtype)
            precision = MixedPrecisionPolicy(param_dtype=self.compute_dtype,
                                             reduce_dtype=TORCH_DTYPES[FSDP2_DTYPES[reduce]])
        else:
            model.requires_grad_(False)
            precision = MixedPrecisionPolicy()  # loaded in the compute dtype: nothing to cast or reduce
        # Pinned host memory only where there is a device to copy to.
        offload_policy = CPUOffloadPolicy(pin_memory=on_gpu) if self.options.offload_policy else OffloadPolicy()
        self._shard(model, self._mesh(), precision, offload_policy)
        self.model = model
        if train:
            self.optimizer, self.scheduler = build_optimizer(model.parameters(), role, total_optimizer_steps)
            self.model.train()
        else:
            self.model.eval()
        self.global_steps = 0  # optimizer steps taken (checkpointed)
        self._micro_steps = 0  # backward passes, for boundary=None
        self._grad_norm = float("nan")
        from roll_gspo.placement.colocation import force_on_cpu

        # Moving states to CPU frees nothing on a CPU machine, nor under offload_policy (they live there).
        self.offloader = FSDP2Offloader(self, active=offload and train and not self.options.offload_policy
                                        and (on_gpu or force_on_cpu()))

    @property
    def engine(self) -> torch.nn.Module:
        """What forward passes call: the sharded model (FSDP2 shards the module in place)."""
        return self.model

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def forward_is_collective(self) -> bool:
        return self.world_size > 1  # every sharded unit is gathered for its forward

    # -- building ----------------------------------------------------------------------------
    def _mesh(self):
        """1-D over all ranks (FSDP), or (replicas, fsdp_size) for HSDP: fully_shard shards over
        the last dimension and replicates over the first."""
        from torch.distributed.device_mesh import init_device_mesh

        size = self.options.fsdp_size
        if 1 < size < self.world_size:
            return init_device_mesh(self.device.type, (self.world_size // size, size),
                                    mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("shard",))

    def _units(self, model: torch.nn.Module) -> List[torch.nn.Module]:
        """The modules sharded as units of their own (wrap_policy), children before parents."""
        policy = self.options.wrap_policy
        names = set(policy.transformer_layer_cls_to_wrap or getattr(model, "_no_split_modules", None) or ())
        # fully_shard goes bottom-up: deeper modules first (stable: layers keep their order).
        found = sorted(((n.count("."), m) for n, m in model.named_modules() if type(m).__name__ in names),
                       key=lambda pair: -pair[0])
        units = [m for _, m in found]
        missing = names - {type(m).__name__ for m in units}
        if policy.transformer_layer_cls_to_wrap and missing:
            raise ValueError(f"strategy_config.wrap_policy.transformer_layer_cls_to_wrap: {sorted(missing)} name no "
                             f"module of {type(model).__name__} (its layers: {sorted(model._no_split_modules or [])})")
        tied = model.get_output_embeddings() is not None and \
            model.get_output_embeddings().weight is model.get_input_embeddings().weight
        for key, module in (("wrap_embeddings", model.get_input_embeddings()),
                            ("wrap_lm_output", model.get_output_embeddings())):
            if getattr(policy, key) and tied:
                raise ValueError(f"strategy_config.wrap_policy.{key}: the model ties its LM head to its input "
                                 f"embedding (tie_word_embeddings), one weight that one unit must hold; drop {key}")
            if getattr(policy, key) and module is not None:
                units.append(module)
        return units

    def _shard(self, model, mesh, precision, offload_policy) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        shard = dict(mesh=mesh, reshard_after_forward=self.options.reshard_after_forward, mp_policy=precision,
                     offload_policy=offload_policy)
        for unit in self._units(model):
            fully_shard(unit, **shard)
        fully_shard(model, **shard)
        if self.train:
            # The loss already carries the whole mini-batch's normaliser over all ranks: gradients
            # are summed over ranks, not averaged.
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_gradient_divide_factor(1.0)
                    unit.set_force_sum_reduction_for_comms(True)

    # -- steps -------------------------------------------------------------------------------
    def backward_and_step(self, loss: torch.Tensor, boundary: Optional[bool] = None) -> None:
        """Backward one micro-batch loss that already carries its share of the mini-batch
        normaliser; with `boundary` (the mini-batch's last pass) the optimizer steps. None counts
        gradient_accumulation_steps passes. Every rank must take as many passes (the reduce-scatter
        of each pass is collective)."""
        self._micro_steps += 1
        if boundary is None:
            boundary = self._micro_steps % self.role.training_args.gradient_accumulation_steps == 0
        if not self.options.reduce_scatter_during_grad_accumulation:
            self.model.set_requires_gradient_sync(boundary)  # accumulate unsharded, reduce once
        self.backward(loss)
        if boundary:
            self.step()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        """Clip by the global norm (max_grad_norm; 0: only measured), step AdamW and the schedule."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False)
        if isinstance(norm, DTensor) and norm.device != self.device:  # offload_policy: CPU shards, NCCL mesh
            norm = norm.to(self.device)
        max_norm = self.role.training_args.max_grad_norm
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        self._grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1

    def grad_norm(self) -> float:
        """Global gradient norm before clipping, of the last optimizer step."""
        return self._grad_norm

    # -- weights -----------------------------------------------------------------------------
    def full_numel(self, param: torch.nn.Parameter) -> int:
        return param.numel()  # a DTensor's numel is the whole parameter's

    @contextmanager
    def full_weights(self, params: List[torch.nn.Parameter]) -> Iterator[Dict[int, Optional[torch.Tensor]]]:
        """Each parameter gathered whole (collective), as the forward pass sees it (compute dtype)."""
        full = {}
        for param in params:
            tensor = param.detach()
            if isinstance(tensor, DTensor):
                tensor = tensor.to(self.device).full_tensor()  # offload_policy keeps shards on the host
            full[id(param)] = tensor.to("cpu", dtype=self.compute_dtype, copy=True) if self.rank == 0 else None
            del tensor
        yield full

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, folder: str) -> None:
        """Model and optimizer shards (torch.distributed.checkpoint; every rank writes its own),
        the LR schedule and step counters (rank 0), each rank's RNG. Collective."""
        import torch.distributed.checkpoint as dcp

        with self.offloader.on_device():
            dcp.save(self._sharded_state(), checkpoint_id=os.path.join(folder, CHECKPOINT_DIR),
                     process_group=self._checkpoint_group())
        if self.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "global_steps": self.global_steps,
                        "micro_steps": self._micro_steps}, os.path.join(folder, TRAINER_STATE))
        torch.save(_rng_state(), os.path.join(folder, RNG_STATE.format(rank=self.rank)))
        torch.distributed.barrier()

    def load_checkpoint(self, folder: str, mode: str = "native") -> None:
        """The state `save_checkpoint` wrote. The shards are re-split when the number of ranks
        changed (each rank's RNG then restarts from the seed). `mode` "universal": a DeepSpeed
        checkpoint, converted by the driver to DeepSpeed's universal checkpoint (`_load_universal`)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from roll_gspo.lifecycle.reshape import LOAD_UNIVERSAL

        if mode == LOAD_UNIVERSAL:
            self._load_universal(folder)
            return
        path = os.path.join(folder, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no FSDP2 checkpoint in {folder} (no {CHECKPOINT_DIR}/ folder; a DeepSpeed "
                                    f"checkpoint is resumed with strategy_name: deepspeed_train)")
        with self.offloader.on_device():
            state = self._sharded_state()
            dcp.load(state, checkpoint_id=path, process_group=self._checkpoint_group())
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=self._state_options())
        trainer = torch.load(os.path.join(folder, TRAINER_STATE))
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.global_steps, self._micro_steps = trainer["global_steps"], trainer["micro_steps"]
        rng = os.path.join(folder, RNG_STATE.format(rank=self.rank))
        if os.path.exists(rng):
            _set_rng_state(torch.load(rng))
        else:
            logger.info("rank %d: %s has no RNG state of this rank (written by fewer ranks)", self.rank, folder)

    def _load_universal(self, folder: str) -> None:
        """A DeepSpeed checkpoint's state from its universal form (`<folder>/universal`): each
        parameter's whole fp32 weight, Adam's moments and step, sharded over this run's ranks (every
        rank reads the whole tensors and keeps its shard); the LR schedule and optimizer step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        from roll_gspo.lifecycle.reshape import UNIVERSAL_DIR, universal_tensor, universal_trainer_state

        universal = os.path.join(folder, UNIVERSAL_DIR)
        full = StateDictOptions(full_state_dict=True)  # every rank: whole tensors (cpu_offload keeps rank 0's only)
        with self.offloader.on_device():
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=full)
            # A tied weight is one parameter under two names; the universal checkpoint holds it once.
            aliases = {}
            for name, param in self.model.named_parameters(remove_duplicate=False):
                aliases.setdefault(id(param), name)
            canonical = {name: aliases[id(param)] for name, param in self.model.named_parameters(remove_duplicate=False)}
            for name in model_state:
                source = canonical.get(name, name)
                model_state[name] = universal_tensor(universal, source, "fp32").to(model_state[name].dtype)
            for name, state in optimizer_state["state"].items():
                source = canonical.get(name, name)
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = universal_tensor(universal, source, key).to(state[key].dtype).view_as(state[key])
                state["step"] = torch.as_tensor(float(universal_tensor(universal, source, "step")),
                                                dtype=state["step"].dtype)
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                           options=StateDictOptions(full_state_dict=True))
        trainer = universal_trainer_state(universal)
        if trainer["scheduler"] is not None:
            self.scheduler.load_state_dict(trainer["scheduler"])
            # The optimizer's param groups came fresh (the warm-up's first LR): the schedule's current one.
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
        self.global_steps = trainer["global_steps"]
        self._micro_steps = self.global_steps * self.role.training_args.gradient_accumulation_steps

    def _checkpoint_group(self):
        """gloo for the checkpoint's own collectives (offload_policy keeps shards on the host, which
        NCCL cannot reduce); on CPU the default group is gloo already."""
        if self.device.type == "cpu":
            return None
        if getattr(self, "_gloo", None) is None:
            self._gloo = torch.distributed.new_group(backend="gloo")  # collective: every rank saves/loads
        return self._gloo

    def _sharded_state(self) -> Dict[str, Dict]:
        """This rank's shards of the model and optimizer state, keyed by parameter name (a fresh
        optimizer's states are created first, so that a load has tensors to fill)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        return {"model": model_state, "optimizer": optimizer_state}

    def _state_options(self):
        """A LoRA model's checkpoint leaves its frozen base weights out (they are the pretrained ones)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = self.role.model_args.uses_lora()
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _rng_state() -> Dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class FSDP2Offloader(StateOffloader):
    """StateOffloader's bookkeeping (what is on CPU, partial reloads, `on_device`) over FSDP2's
    states: `optim_states` (Adam's sharded moments) and, with `params`, `lp_params` (the sharded
    weights, moved by `module.to`, which FSDP2 supports on a sharded module). Gradients are freed
    at every optimizer step, so the other names of the optimizer side hold nothing here."""

    def __init__(self, strategy: FSDP2Strategy, active: bool):
        super().__init__(engine=None, zero_stage=0, active=active)  # stage 0: the plain-torch moves below
        self.strategy = strategy

    def _offload_plain(self, wanted: List[str]) -> None:
        self._move(wanted, torch.device("cpu"))

    def _reload_plain(self, back: List[str]) -> None:
        self._move(back, self.strategy.device)

    def _move(self, states: List[str], device: torch.device) -> None:
        if "optim_states" in states:
            for state in self.strategy.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        state[key] = value.to(device)  # a DTensor moves its local shard
        if "lp_params" in states:
            self.strategy.model.to(device)
