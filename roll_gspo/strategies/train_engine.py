"""What the training engines of a role's rank share (DeepSpeed ZeRO in deepspeed_strategy.py,
torch FSDP2 in fsdp2_strategy.py): the policy model as loaded for RL, AdamW with its LR schedule,
the collectives the trainer runs between passes, and the Hugging Face folder written from gathered
weights.

A subclass sets `role`, `rank`, `world_size`, `device`, `model_config` (and `optimizer`,
`scheduler` when it trains, `offloader` always) and provides the engine's own parts:
`engine` (what forward passes call), `module` (the transformers model inside it),
`global_steps` (optimizer steps taken), `forward_is_collective()`, `backward_and_step`,
`grad_norm`, `full_weights` (whole parameters for the weight sync and the HF save),
`save_checkpoint` / `load_checkpoint`.
"""
from __future__ import annotations

import copy
import logging
import math
import os
from typing import ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from roll_gspo.schema.config import RoleConfig
from roll_gspo.models.causal_lm import disable_dropout, load_causal_lm, sparse_tied_embedding_grad
from roll_gspo.strategies.lora import WeightEntry

logger = logging.getLogger("roll_gspo.train_engine")


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


def use_cpu_threads() -> None:
    """A CPU rank computes with OMP_NUM_THREADS threads (the worker's environment sets it)."""
    torch.set_num_threads(max(1, int(float(os.environ.get("OMP_NUM_THREADS", "1")))))


def load_policy_model(role: RoleConfig, train: bool, dtype: str, value_model: bool = False):
    """The role's causal LM in `dtype`, as RL scores it: gradient checkpointing when the role
    trains with it, dropout off, wrapped by PEFT when it trains a LoRA adapter (model_args.lora_target;
    roll_gspo.strategies.lora), a trained embedding tied to the LM head sending a sparse gradient
    (`sparse_tied_embedding_grad`: the same gradient, without a vocabulary-wide copy per pass).
    `value_model`: the critic's instead, the same body with a scalar head (roll_gspo.models.value_model). Returns (model, the config as loaded, for saving)."""
    if value_model:
        from roll_gspo.models.value_model import load_value_model

        model = load_value_model(role.model_args.model_name_or_path, dtype, role.model_args.attn_implementation)
    else:
        model = load_causal_lm(role.model_args.model_name_or_path, dtype, role.model_args.attn_implementation)
    if train and role.model_args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model_config = copy.deepcopy(model.config)  # saved as loaded, dropout included
    if train and role.model_args.uses_lora():
        from roll_gspo.strategies.lora import apply_lora

        if role.model_args.gradient_checkpointing:
            model.enable_input_require_grads()  # recomputed layers need an input that requires grad
        model = apply_lora(model, role.model_args)
    if train and not value_model:
        sparse_tied_embedding_grad(model)
    # Old log-probs (eval mode), new ones (train mode) and the reference must score one policy.
    if disable_dropout(model):
        logger.info("dropout disabled in %s: RL forward passes run without it", role.model_args.model_name_or_path)
    return model, model_config


def build_optimizer(parameters, role: RoleConfig, total_optimizer_steps: int):
    """(torch AdamW over those of `parameters` that train (a LoRA model's adapter), its LambdaLR
    schedule) from the role's training_args."""
    args = role.training_args
    parameters = [p for p in parameters if p.requires_grad]
    # On CPU the fused kernel steps all of Adam in one pass over each tensor: 4x faster than the
    # per-tensor loop torch picks there (0.5B parameters: seconds per optimizer step), and the
    # default of transformers' Trainer. Plain CPU tensors only (not FSDP2's DTensors).
    fused = bool(parameters) and all(p.device.type == "cpu" and type(p.data) is torch.Tensor for p in parameters)
    optimizer = torch.optim.AdamW(parameters, lr=args.learning_rate, weight_decay=args.weight_decay,
                                  betas=(args.adam_beta1, args.adam_beta2), **({"fused": True} if fused else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.warmup_steps, total_optimizer_steps, args.lr_scheduler_type))
    return optimizer, scheduler


def _one_copy_per_name(group: List[WeightEntry], full: Dict[int, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    """(name, whole tensor) for each entry of `group` (its `combine` applied: LoRA's merge); a tied
    weight's second name gets a copy of its own, as a checkpoint holds it (safetensors refuses two
    names on one storage)."""
    named, seen = [], set()
    for entry in group:
        if entry.combine is not None:
            named.append((entry.name, entry.combine([full[id(p)] for p in entry.params])))
            continue
        param = entry.params[0]
        tensor = full[id(param)]
        named.append((entry.name, tensor.clone() if id(param) in seen else tensor))
        seen.add(id(param))
    return named


class TrainEngineStrategy:
    """One rank of a training engine (see the module docstring for what a subclass provides)."""

    rank: int
    world_size: int
    device: torch.device

    def forward_is_collective(self) -> bool:
        """Whether a forward pass runs collectives (parameter gathers), so every rank must run as
        many as its peers."""
        raise NotImplementedError

    # -- collectives between passes -------------------------------------------------------------
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
        """Forward passes each rank must run to score its shard: where a forward pass is
        collective, the most any rank needs; otherwise None (each rank runs its own)."""
        if not self.forward_is_collective():
            return None
        return self.max_over_ranks([local_passes])[0]

    # -- weights --------------------------------------------------------------------------------
    def weight_entries(self, adapter: bool = False) -> List[WeightEntry]:
        """What the weight sync and the HF save hand out, in order: every weight under its checkpoint
        name (a LoRA model's with the adapter merged in); `adapter`: the LoRA adapter's tensors only."""
        from roll_gspo.strategies.lora import adapter_weight_entries, is_peft_model, merged_weight_entries

        if is_peft_model(self.module):
            return adapter_weight_entries(self.module) if adapter else merged_weight_entries(self.module)
        if adapter:
            raise RuntimeError("no LoRA adapter to hand out: the model trains every weight")
        # Tied weights under every name (e.g. lm_head.weight = embed_tokens.weight), as in a
        # checkpoint: vLLM's in-place reload does not re-tie them by itself.
        return [WeightEntry(name, (param,)) for name, param in self.module.named_parameters(remove_duplicate=False)]

    def iter_weight_buckets(self, bucket_bytes: int, adapter: bool = False) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """Full weights (`weight_entries`) in buckets of at most `bucket_bytes` (one tensor may exceed
        it), at most one bucket of full tensors alive at a time. Collective where the weights are
        sharded (every rank must iterate); tensors are CPU copies, meaningful on rank 0 only."""
        entries = self.weight_entries(adapter)
        group: List[WeightEntry] = []
        size = 0
        for index, entry in enumerate(entries):
            group.append(entry)
            size += self.full_numel(entry.params[0]) * entry.params[0].element_size()
            if size >= bucket_bytes or index == len(entries) - 1:
                with self.full_weights(list({id(p): p for e in group for p in e.params}.values())) as full:
                    yield _one_copy_per_name(group, full) if self.rank == 0 else []
                group, size = [], 0

    def full_numel(self, param: torch.nn.Parameter) -> int:
        """Elements of the whole parameter (not of this rank's shard)."""
        return param.numel()

    def full_weights(self, params: List[torch.nn.Parameter]) -> ContextManager[Dict[int, Optional[torch.Tensor]]]:
        """A context holding {id(param): the whole parameter as a CPU copy (rank 0; None elsewhere)}
        for `params`; collective where they are sharded."""
        raise NotImplementedError

    def save_hf_model(self, folder: str, tokenizer_source: str) -> None:
        """Consolidated weights in Hugging Face format (rank 0 writes), loadable by transformers
        and vLLM; a LoRA model's merged, and its adapter in `<folder>/adapter` (PEFT's format).
        Collective: every rank gathers."""
        from roll_gspo.strategies.lora import adapter_config, is_peft_model, save_adapter

        state, adapter = {}, {}
        with self.offloader.on_device():
            for bucket in self.iter_weight_buckets(256 << 20):
                state.update(bucket)
            if is_peft_model(self.module):
                for bucket in self.iter_weight_buckets(256 << 20, adapter=True):
                    adapter.update(bucket)
        if self.rank == 0 and is_peft_model(self.module):
            save_adapter(os.path.join(folder, "adapter"), adapter, adapter_config(self.module, tokenizer_source))
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
