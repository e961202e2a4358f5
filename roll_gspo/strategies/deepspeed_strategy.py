"""DeepSpeed ZeRO (stage 0-3) engine for a role: building it from the YAML, forward passes,
optimizer steps, bucketed weight gathering, checkpoints. CUDA/NCCL on GPUs, gloo on CPUs."""
from __future__ import annotations

import copy
import os
from contextlib import contextmanager, nullcontext
from typing import Any, Dict, Iterator, List, Optional

import torch

from roll_gspo.schema.config import RoleConfig
from roll_gspo.strategies.train_engine import TrainEngineStrategy, build_optimizer, load_policy_model, use_cpu_threads

# Batch keys DeepSpeed must take from training_args, never from strategy_config.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _deep_merge(base: Dict[str, Any], override: Dict[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        elif value != "auto":
            out[key] = value
    return out


# ZeRO bucket sizes that ROLL's presets leave "auto": filled from the hidden size h as the
# transformers DeepSpeed integration does (h*h, 0.9*h*h, 10*h).
HIDDEN_SIZE_AUTO = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def build_deepspeed_config(role: RoleConfig, world_size: int, hidden_size: int = 0) -> Dict[str, Any]:
    """The role's DeepSpeed config: strategy_config merged over values derived from
    training_args/model_args (ROLL's "auto" entries are filled the same way; bucket sizes from
    `hidden_size`)."""
    args = role.training_args
    dtype = role.model_args.dtype
    derived = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size,
        "gradient_clipping": args.max_grad_norm,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    user = role.strategy_args.strategy_config or {}
    zero = user.get("zero_optimization") or {}
    if hidden_size:
        derived["zero_optimization"].update(
            {k: fill(hidden_size) for k, fill in HIDDEN_SIZE_AUTO.items() if zero.get(k) == "auto"})
    if (zero.get("offload_optimizer") or {}).get("device") == "cpu":
        # The torch AdamW client optimizer steps the offloaded states; DeepSpeedCPUAdam would
        # need a compiled extension, and DeepSpeed refuses a client optimizer unless told.
        derived["zero_force_ds_cpu_optimizer"] = False
    conflicting = [k for k in BATCH_KEYS if k in user and user[k] != "auto" and user[k] != derived[k]]
    if conflicting:
        raise ValueError(f"strategy_config sets {conflicting}: batch sizes come from training_args "
                         f"(per_device_train_batch_size, gradient_accumulation_steps); use 'auto' or drop them")
    return _deep_merge(derived, user)


def frozen_engine_config(ds_config: Dict[str, Any]) -> Dict[str, Any]:
    """A frozen engine's config (reference, `deepspeed_infer`): ZeRO-1/2 only partition optimizer
    and gradient states, which it has none of, so they run as stage 0 (DeepSpeed refuses them
    without an optimizer); stage 3 still shards the weights. Optimizer offload does not apply."""
    config = copy.deepcopy(ds_config)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if zero.get("stage", 0) in (1, 2):
        zero["stage"] = 0
        zero.pop("offload_param", None)
    return config


def _skip_shm_comm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce for CPUs on first init (40-66 s of g++
    per fresh machine); gloo works without it. ROLL_GSPO_DS_SHM_COMM=1 keeps the build."""
    if os.environ.get("ROLL_GSPO_DS_SHM_COMM") == "1":
        return
    import importlib

    # importlib, not `import deepspeed.comm.torch as m`: `deepspeed.comm.torch` the attribute is torch.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class DeepSpeedStrategy(TrainEngineStrategy):
    """One rank's DeepSpeed engine for `role`. `train=False` builds a frozen (reference) engine.
    `offload`: its states may move to CPU between phases (`offloader`; roll_gspo.placement.colocation)."""

    def __init__(self, role: RoleConfig, *, train: bool, total_optimizer_steps: int = 1, seed: int = 0,
                 offload: bool = False, value_model: bool = False):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        from roll_gspo.distributed.fault_tolerance import collective_timeout

        self.role = role
        self.train = train
        on_cpu = get_accelerator().device_name() == "cpu"
        if on_cpu:
            _skip_shm_comm_build()
            use_cpu_threads()
        deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl", timeout=collective_timeout())
        self.world_size = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        self.device = torch.device(get_accelerator().device_name(0) if not on_cpu else "cpu")
        torch.manual_seed(seed)

        from transformers import AutoConfig

        hidden_size = getattr(AutoConfig.from_pretrained(role.model_args.model_name_or_path), "hidden_size", 0)
        self.ds_config = build_deepspeed_config(role, self.world_size, hidden_size or 0)
        if not train:
            self.ds_config = frozen_engine_config(self.ds_config)
        self.zero_stage = self.ds_config["zero_optimization"].get("stage", 0)
        self._hf_ds_config = None
        if self.zero_stage == 3:
            # Keeps transformers' from_pretrained partitioning weights at load time (ZeRO-3).
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        model, self.model_config = load_policy_model(role, train, role.model_args.dtype, value_model)
        if train:
            optimizer, scheduler = build_optimizer(model.parameters(), role, total_optimizer_steps)
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config)
            if self.world_size == 1 and self.zero_stage == 0:
                # DeepSpeed's stage-0 reduction flattens every gradient into a bucket of up to 5e8
                # values and copies it back at each optimizer step, even with no peer to reduce
                # with: 2 GB and ~1 s per step at 0.5B parameters in fp32, for nothing.
                self.engine.enable_backward_allreduce = False
            self.engine.train()
        else:
            model.requires_grad_(False)
            self.engine, *_ = deepspeed.initialize(model=model, config=self.ds_config)
            self.engine.eval()
        from roll_gspo.placement.colocation import force_on_cpu
        from roll_gspo.strategies.deepspeed_offload import StateOffloader

        # On CPU the states already live in host memory: moving them would free nothing.
        self.offloader = StateOffloader(self.engine, self.zero_stage,
                                        active=offload and train and (not on_cpu or force_on_cpu()))

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    def forward_is_collective(self) -> bool:
        return self.zero_stage == 3  # ZeRO-3 gathers parameters in every forward pass

    def _lora(self) -> bool:
        return self.train and self.role.model_args.uses_lora()

    # -- steps -----------------------------------------------------------------------------
    def backward_and_step(self, loss: torch.Tensor, boundary: Optional[bool] = None) -> None:
        """Backward one micro-batch loss that already carries its share of the mini-batch
        normaliser; with `boundary` (the mini-batch's last pass) the optimizer steps. The trainer
        says where the boundary is because token-budget micro-batches make their count vary; None
        leaves it to DeepSpeed's count of gradient_accumulation_steps.

        DeepSpeed averages gradients over data-parallel ranks, and its default also divides by
        the accumulation steps; both would double-normalise, so scale back and opt out.
        """
        if boundary is not None:
            self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        if self.zero_stage == 0 and self.train and self.engine.is_gradient_accumulation_boundary():
            # Stage 0 with a client optimizer records no global norm: measured here, on the
            # (reduced) gradients the step is about to apply.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            self._stage0_grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        self.engine.step()

    def grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = getattr(self, "_stage0_grad_norm", None)
        return float(norm) if norm is not None else float("nan")

    # -- weights -----------------------------------------------------------------------------
    def full_numel(self, param: torch.nn.Parameter) -> int:
        return getattr(param, "ds_numel", param.numel())  # ZeRO-3 keeps a partition in the parameter

    @contextmanager
    def full_weights(self, params: List[torch.nn.Parameter]) -> Iterator[Dict[int, Optional[torch.Tensor]]]:
        """Under ZeRO-3 the parameters are gathered for the block (collective); else they are whole."""
        import deepspeed

        gather = (deepspeed.zero.GatheredParameters(params, modifier_rank=None) if self.zero_stage == 3
                  else nullcontext())
        with gather:
            yield {id(p): p.detach().to("cpu", copy=True) if self.rank == 0 else None for p in params}

    def save_checkpoint(self, folder: str) -> None:
        """The engine's state; a LoRA model's frozen base weights are left out (they are the
        pretrained ones): the checkpoint holds the adapter and its optimizer state."""
        with self.offloader.on_device():
            self.engine.save_checkpoint(folder, tag="engine", exclude_frozen_parameters=self._lora())

    def load_checkpoint(self, folder: str, mode: str = "native") -> None:
        """The state `save_checkpoint` wrote; `mode` "universal": DeepSpeed's universal checkpoint
        the driver converted it to (`<folder>/universal`, roll_gspo.lifecycle.reshape), which
        re-splits the fp32 weights and Adam's moments over this run's ranks and ZeRO stage."""
        from roll_gspo.lifecycle.reshape import LOAD_UNIVERSAL, UNIVERSAL_DIR

        universal = mode == LOAD_UNIVERSAL
        source = os.path.join(folder, UNIVERSAL_DIR) if universal else folder
        config = self.engine._config
        config.load_universal_checkpoint = universal  # read by DeepSpeed's load path only
        try:
            with self.offloader.on_device():
                path, _ = self.engine.load_checkpoint(source, tag="engine", load_module_strict=not self._lora())
        finally:
            config.load_universal_checkpoint = False
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {source}")
