"""Memory per device, estimated before launch (pure arithmetic; no torch, no Ray).

Training ranks (DeepSpeed ZeRO, Adam), following the ZeRO paper's accounting for P parameters
over N data-parallel ranks, with b bytes per weight (2 in bf16/fp16, 4 in fp32):

    weights      b*P, or b*P/N under ZeRO-3
    gradients    b*P, or b*P/N under ZeRO-2 and 3
    optimizer    (4 + 4) * P for Adam's moments, plus a 4*P fp32 master copy when b < 4;
                 divided by N under ZeRO-1, 2 and 3
    activations  saved for backward per micro-batch: per token and layer about
                 8*hidden + 2*kv_dim + 4*ffn values (attention computed blockwise, so no
                 seq^2 term; the MoE FFN counts its active experts), plus the fp32 logits and
                 their log-softmax (2 * 4 bytes * vocab per token).

Rollout ranks (vLLM): weights b*P/TP per device, KV cache 2 * layers * kv_dim * b per token and
TP rank, for `max_num_seqs` sequences of `max_model_len` tokens (what must fit for the
configured concurrency). On a GPU vLLM then claims `gpu_memory_utilization` of the device
whatever it needs; the plan checks the estimate against that share.

These are estimates (allocator slack, CUDA context ~0.5-1 GB, temporary buffers are not counted):
`fits` keeps a 10 % margin.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

GIB = float(1 << 30)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MARGIN = 0.9  # plan against 90 % of the device


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model's `config.json` (Qwen2/Qwen3/Llama/Qwen3-MoE style)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0  # 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        model_type = str(config.get("model_type", ""))
        return cls(
            vocab_size=int(config["vocab_size"]), hidden_size=hidden, num_layers=int(config["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size") or 0),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            num_experts=int(config.get("num_experts") or config.get("num_local_experts") or 0),
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0))

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, q_dim = self.hidden_size, self.num_heads * self.head_dim
        attention = h * q_dim * 2 + h * self.kv_dim * 2
        if self.attention_bias:
            attention += q_dim + 2 * self.kv_dim
        if self.num_experts:
            ffn = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts  # experts + router
        else:
            ffn = 3 * h * self.intermediate_size
        per_layer = attention + ffn + 2 * h  # two RMSNorms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h  # final norm

    def active_ffn_size(self) -> int:
        if self.num_experts:
            return self.num_experts_per_tok * self.moe_intermediate_size
        return self.intermediate_size


def training_memory(shape: ModelShape, *, dtype: str, zero_stage: int, world_size: int, micro_batch: int,
                    seq_len: int, gradient_checkpointing: bool = False) -> Dict[str, float]:
    """Bytes per training device: weights, gradients, optimizer, activations (with gradient
    checkpointing: each layer's input, plus one layer's full activations while it is recomputed)."""
    params, b, n = shape.num_parameters(), DTYPE_BYTES[dtype], max(world_size, 1)
    optimizer = 8.0 * params + (4.0 * params if b < 4 else 0.0)
    tokens = micro_batch * seq_len
    per_token_layer = 8 * shape.hidden_size + 2 * shape.kv_dim + 4 * shape.active_ffn_size()
    saved = (shape.num_layers * shape.hidden_size + per_token_layer if gradient_checkpointing
             else shape.num_layers * per_token_layer)
    return {
        "weights": b * params / (n if zero_stage >= 3 else 1),
        "gradients": b * params / (n if zero_stage >= 2 else 1),
        "optimizer": optimizer / (n if zero_stage >= 1 else 1),
        "activations": float(tokens * saved * b + tokens * shape.vocab_size * 8),
    }


def rollout_memory(shape: ModelShape, *, dtype: str, tensor_parallel_size: int, max_num_seqs: int,
                   max_model_len: int) -> Dict[str, float]:
    """Bytes per rollout device: weights (its TP shard) and the KV cache for the concurrency."""
    b, tp = DTYPE_BYTES[dtype], max(tensor_parallel_size, 1)
    kv_per_token = 2 * shape.num_layers * shape.kv_dim * b / tp
    return {"weights": b * shape.num_parameters() / tp,
            "kv_cache": float(kv_per_token * max_num_seqs * max_model_len)}


@dataclass
class DeviceUse:
    """One device's estimated use: role -> component -> bytes."""
    name: str
    capacity: float
    roles: Dict[str, Dict[str, float]] = field(default_factory=dict)
    limits: Dict[str, float] = field(default_factory=dict)  # role -> share of capacity it may use

    def total(self) -> float:
        return sum(sum(parts.values()) for parts in self.roles.values())

    def problems(self) -> List[str]:
        out = []
        for role, parts in self.roles.items():
            limit = self.limits.get(role)
            if limit is not None and sum(parts.values()) > limit * self.capacity:
                out.append(f"{self.name}: {role} needs {_gib(sum(parts.values()))} ({_parts(parts)}) but may use "
                           f"{limit:g} x {_gib(self.capacity)} = {_gib(limit * self.capacity)}")
        if not out and self.total() > MARGIN * self.capacity:
            out.append(f"{self.name}: the roles on it need {_gib(self.total())} in all "
                       f"({'; '.join(f'{r}: {_parts(p)}' for r, p in self.roles.items())}), more than "
                       f"{MARGIN:.0%} of its {_gib(self.capacity)}")
        return out

    def describe(self) -> str:
        lines = [f"{self.name} ({_gib(self.capacity)}): {_gib(self.total())} estimated"]
        lines += [f"  {role}: {_gib(sum(parts.values()))} = {_parts(parts)}" for role, parts in self.roles.items()]
        return "\n".join(lines)


def plan_problems(devices: List[DeviceUse]) -> List[str]:
    return [problem for device in devices for problem in device.problems()]


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def _parts(parts: Mapping[str, float]) -> str:
    return " + ".join(f"{name} {_gib(value)}" for name, value in parts.items())


def shape_of_model_folder(folder: str) -> Optional[ModelShape]:
    """The shape from `folder/config.json`, or None when there is no such file."""
    import json
    import os

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        config = json.load(handle)
    return ModelShape.from_hf_config(config.get("text_config", config))


def config_memory_plan(cfg, device_memory_gib: float, shape: Optional[ModelShape] = None) -> Tuple[str, List[str]]:
    """Per-device estimate of a loaded RLVR/SFT config's roles on devices of `device_memory_gib`
    each: (a printable plan, the problems). A role gets `num_gpus_per_worker` of a device (all of
    it at >= 1; a fraction when roles share one); vLLM at most its `gpu_memory_utilization`
    (default 0.9). `shape` defaults to the actor's model folder's config.json."""
    train = cfg.actor_train
    shape = shape or shape_of_model_folder(train.model_args.model_name_or_path or "")
    if shape is None:
        return (f"memory plan: no config.json in {train.model_args.model_name_or_path!r} to estimate from", [])
    capacity = device_memory_gib * GIB
    seq_len = cfg.prompt_length + cfg.response_length
    zero_stage = int(train.strategy_args.strategy_config.get("zero_optimization", {}).get("stage", 0))
    devices = [DeviceUse(f"actor_train device (x{train.world_size})", capacity,
                         roles={"actor_train": training_memory(
                             shape, dtype=train.model_args.dtype, zero_stage=zero_stage, world_size=train.world_size,
                             micro_batch=train.training_args.per_device_train_batch_size, seq_len=seq_len,
                             gradient_checkpointing=train.model_args.gradient_checkpointing)},
                         limits={"actor_train": _share(train.num_gpus_per_worker, 1)})]
    if getattr(cfg, "pipeline", "rlvr") == "rlvr" and cfg.actor_infer.strategy_args.strategy_name == "vllm":
        infer = cfg.actor_infer
        engine = infer.strategy_args.strategy_config
        tp = int(engine.get("tensor_parallel_size", 1) or 1)
        concurrency = int(engine.get("max_num_seqs") or cfg.rollout_batch_size * cfg.num_return_sequences_in_group)
        share = min(_share(infer.num_gpus_per_worker, tp), float(engine.get("gpu_memory_utilization", 0.9)))
        devices.append(DeviceUse(f"actor_infer device (x{infer.world_size * tp}, TP {tp})", capacity,
                                 roles={"actor_infer": rollout_memory(
                                     shape, dtype=infer.model_args.dtype, tensor_parallel_size=tp,
                                     max_num_seqs=concurrency, max_model_len=seq_len)},
                                 limits={"actor_infer": share}))
    text = "memory plan (estimate per device; see roll_gspo/memory_plan.py):\n" + "\n".join(
        d.describe() for d in devices)
    return text, plan_problems(devices)


def _share(gpus_per_worker: float, devices_per_worker: int) -> float:
    """The part of each of its devices a rank may use."""
    if not gpus_per_worker:
        return 1.0
    return min(1.0, gpus_per_worker / devices_per_worker)
