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
whatever it needs; the placement plan (roll_gspo.placement.cluster_plan) checks the estimate against that
share and adds up the ranks that share a device.

These are estimates (allocator slack, CUDA context ~0.5-1 GB, temporary buffers are not counted):
the plan keeps a 10 % margin (MARGIN).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

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


# A decoder layer's linear modules by their last name: (in, out) features.
def _linear_shapes(shape: ModelShape) -> Dict[str, tuple]:
    h, q_dim, kv, ffn = shape.hidden_size, shape.num_heads * shape.head_dim, shape.kv_dim, shape.intermediate_size
    return {"q_proj": (h, q_dim), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q_dim, h),
            "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}


def lora_parameters(shape: ModelShape, lora_target: str, rank: int) -> int:
    """Parameters of rank-`rank` LoRA adapters (r x (in + out) per adapted linear layer) on the
    decoder layers' linear modules that `lora_target` selects: `all-linear`, a comma list of names,
    or a regex over whole names (tried on `model.layers.0.self_attn.q_proj`-style names)."""
    import re

    linear = _linear_shapes(shape)
    text = str(lora_target)
    if any(mark in text for mark in ("*", "$", "|", "(")):
        chosen = [n for n in linear if any(re.fullmatch(text, f"model.layers.0.{part}.{n}") for part in ("self_attn", "mlp"))]
    else:
        names = {item.strip() for item in text.split(",")}
        chosen = list(linear) if "all-linear" in names else [n for n in linear if n in names]
    return shape.num_layers * sum(rank * (linear[n][0] + linear[n][1]) for n in chosen)


def training_memory(shape: ModelShape, *, dtype: str, zero_stage: int, world_size: int, micro_batch: int,
                    seq_len: int, gradient_checkpointing: bool = False,
                    trainable: Optional[int] = None) -> Dict[str, float]:
    """Bytes per training device: weights, gradients, optimizer, activations (with gradient
    checkpointing: each layer's input, plus one layer's full activations while it is recomputed).
    `trainable` (LoRA: the adapter's parameters, `lora_parameters`): only those have gradients and
    optimizer states; the frozen weights are held (sharded under ZeRO-3) beside the adapter."""
    params, b, n = shape.num_parameters(), DTYPE_BYTES[dtype], max(world_size, 1)
    trained = params if trainable is None else trainable
    weights = params + (trainable or 0)
    optimizer = 8.0 * trained + (4.0 * trained if b < 4 else 0.0)
    tokens = micro_batch * seq_len
    per_token_layer = 8 * shape.hidden_size + 2 * shape.kv_dim + 4 * shape.active_ffn_size()
    saved = (shape.num_layers * shape.hidden_size + per_token_layer if gradient_checkpointing
             else shape.num_layers * per_token_layer)
    return {
        "weights": b * weights / (n if zero_stage >= 3 else 1),
        "gradients": b * trained / (n if zero_stage >= 2 else 1),
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


def frozen_memory(shape: ModelShape, *, dtype: str, zero_stage: int, world_size: int, batch: int,
                  seq_len: int) -> Dict[str, float]:
    """Bytes per device of a frozen model scoring `batch` sequences (reference, hf_infer): its
    weights (sharded under ZeRO-3) and one forward pass without gradients (one layer's
    activations at a time, the fp32 logits and their log-softmax)."""
    params, b = shape.num_parameters(), DTYPE_BYTES[dtype]
    tokens = batch * seq_len
    per_token_layer = 8 * shape.hidden_size + 2 * shape.kv_dim + 4 * shape.active_ffn_size()
    return {"weights": b * params / (max(world_size, 1) if zero_stage >= 3 else 1),
            "activations": float(tokens * per_token_layer * b + tokens * shape.vocab_size * 8)}


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
