"""DeepSpeed ZeRO (stage 0-3) engine for a role: building it from the YAML, forward passes,
optimizer steps, bucketed weight gathering, checkpoints. CUDA/NCCL on GPUs, gloo on CPUs."""
from __future__ import annotations

import copy
import logging
import math
import os
from contextlib import nullcontext
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from roll_gspo.config.schema import RoleConfig
from roll_gspo.models.causal_lm import disable_dropout, load_causal_lm

logger = logging.getLogger("roll_gspo.deepspeed")

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


def lr_lambda(warmup_steps: int, total_steps: int, kind: str):
    """LR multiplier per optimizer step: linear warm-up, then constant / linear / cosine decay."""
    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def _skip_shm_comm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce for CPUs on first init (40-66 s of g++
    per fresh machine); gloo works without it. ROLL_GSPO_DS_SHM_COMM=1 keeps the build."""
    if os.environ.get("ROLL_GSPO_DS_SHM_COMM") == "1":
        return
    import importlib

    # importlib, not `import deepspeed.comm.torch as m`: `deepspeed.comm.torch` the attribute is torch.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class DeepSpeedStrategy:
    """One rank's DeepSpeed engine for `role`. `train=False` builds a frozen (reference) engine.
    `offload`: its states may move to CPU between phases (`offloader`; roll_gspo.placement.colocation)."""

    def __init__(self, role: RoleConfig, *, train: bool, total_optimizer_steps: int = 1, seed: int = 0,
                 offload: bool = False):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self.role = role
        self.train = train
        on_cpu = get_accelerator().device_name() == "cpu"
        if on_cpu:
            _skip_shm_comm_build()
            torch.set_num_threads(max(1, int(float(os.environ.get("OMP_NUM_THREADS", "1")))))
        deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl")
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
        model = load_causal_lm(role.model_args.model_name_or_path, role.model_args.dtype,
                               role.model_args.attn_implementation)
        if train and role.model_args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.model_config = copy.deepcopy(model.config)  # saved as loaded, dropout included
        # Old log-probs (eval mode), new ones (train mode) and the reference must score one policy.
        if disable_dropout(model):
            logger.info("dropout disabled in %s: RL forward passes run without it",
                        role.model_args.model_name_or_path)
        if train:
            args = role.training_args
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                          betas=(args.adam_beta1, args.adam_beta2))
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lr_lambda(args.warmup_steps, total_optimizer_steps, args.lr_scheduler_type))
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config)
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
        self.engine.step()

    def grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def all_reduce_sum(self, values: List[float]) -> List[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor)
        return tensor.tolist()

    def max_over_ranks(self, values: List[int]) -> List[int]:
        """Element-wise maximum of an int list over all ranks (one all-reduce)."""
        if self.world_size == 1 or not values:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tensor.tolist()

    def scoring_passes(self, local_passes: int) -> Optional[int]:
        """Forward passes each rank must run to score its shard: under ZeRO-3 (a forward pass is
        collective) the most any rank needs; otherwise None (each rank runs its own)."""
        if self.zero_stage != 3:
            return None
        tensor = torch.tensor([local_passes], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    # -- weights -----------------------------------------------------------------------------
    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """Full weights in buckets of at most `bucket_bytes` (one parameter may exceed it).

        Collective under ZeRO-3 (every rank must iterate); tensors are CPU copies, meaningful on
        rank 0 only.
        """
        import deepspeed

        # Tied weights under every name (e.g. lm_head.weight = embed_tokens.weight), as in a
        # checkpoint: vLLM's in-place reload does not re-tie them by itself.
        named = list(self.engine.module.named_parameters(remove_duplicate=False))
        group: List[Tuple[str, torch.nn.Parameter]] = []
        size = 0
        for index, (name, param) in enumerate(named):
            numel = getattr(param, "ds_numel", param.numel())
            group.append((name, param))
            size += numel * param.element_size()
            if size >= bucket_bytes or index == len(named) - 1:
                params = list({id(p): p for _, p in group}.values())
                gather = (deepspeed.zero.GatheredParameters(params, modifier_rank=None)
                          if self.zero_stage == 3 else nullcontext())
                with gather:
                    yield [(n, p.detach().to("cpu", copy=True)) for n, p in group] if self.rank == 0 else []
                group, size = [], 0

    def save_hf_model(self, folder: str, tokenizer_source: str) -> None:
        """Consolidated weights in Hugging Face format (rank 0 writes), loadable by transformers
        and vLLM."""
        state = {}
        with self.offloader.on_device():
            for bucket in self.iter_weight_buckets(256 << 20):
                state.update(bucket)
        if self.rank == 0:
            # Written directly rather than through a model object: instantiating one on rank 0
            # alone while ZeRO-3's HfDeepSpeedConfig is alive would deadlock the other ranks.
            from safetensors.torch import save_file
            from transformers import AutoTokenizer, GenerationConfig

            os.makedirs(folder, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"),
                      metadata={"format": "pt"})
            self.model_config.save_pretrained(folder)
            try:
                GenerationConfig.from_pretrained(tokenizer_source).save_pretrained(folder)
            except OSError:
                pass  # the source had no generation_config.json
            AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)
        torch.distributed.barrier()

    def save_checkpoint(self, folder: str) -> None:
        with self.offloader.on_device():
            self.engine.save_checkpoint(folder, tag="engine")

    def load_checkpoint(self, folder: str) -> None:
        with self.offloader.on_device():
            path, _ = self.engine.load_checkpoint(folder, tag="engine")
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {folder}")
