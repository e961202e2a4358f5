"""Are the rollout engine's sampled-token log-probs the quantity the trainer scores?

The trainer scores log_softmax(logits / T) over the full vocabulary (T = actor_infer's
temperature, 1 when greedy). What the engine reports depends on it:

* hf_infer re-scores the sampled responses with that same formula: always the trainer's quantity.
* vLLM (0.32) offers four `logprobs_mode`s, none of which is "after temperature, before
  top-k/top-p": `raw_logprobs` is log_softmax(logits) (no temperature, no truncation);
  `processed_logprobs` is taken after temperature AND after top-k/top-p, i.e. renormalised over
  the kept tokens (up to ~0.7 nats per token higher under top_p 0.5); the `*_logits` modes are not
  log-probs at all. So roll_gspo picks `processed_logprobs` when nothing truncates (exact at any
  temperature) and `raw_logprobs` under top-k/top-p at temperature 1 or 0 (exact: no temperature
  to apply). Top-k/top-p at any other temperature has no exact mode.

`old_logprob_source: rollout` is refused where the quantity differs (``rollout_logprobs_bias``);
``rollout_logprobs_are_exact`` also looks at precision. Which source a run takes is
``rollout_logprobs.choose_old_logprob_source``'s.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from roll_gspo.schema.config import GeneratingArgs, PipelineConfig

# vLLM `dtype` spellings, by the model_args.dtype they mean.
VLLM_DTYPE_SPELLINGS = {"fp32": ("float32", "float", "fp32"), "bf16": ("bfloat16", "bf16"),
                        "fp16": ("float16", "half", "fp16")}


def truncates(gen: GeneratingArgs) -> bool:
    """True when sampling keeps only part of the vocabulary (top_p < 1 or top_k > 0)."""
    return gen.top_p < 1.0 or gen.top_k > 0


def vllm_logprobs_mode(gen: GeneratingArgs) -> Optional[str]:
    """The vLLM `logprobs_mode` whose sampled-token log-probs equal log_softmax(logits / T) over
    the full vocabulary for these sampling keys; None when no mode gives that."""
    if not truncates(gen):
        return "processed_logprobs"  # temperature applied, nothing cut off
    if gen.temperature in (0.0, 1.0):
        return "raw_logprobs"  # the truncation is not in it, and there is no temperature to apply
    return None


def vllm_dtype_name(value: str) -> Optional[str]:
    """model_args.dtype meant by a vLLM `dtype` value (None for `auto` or unknown)."""
    for name, spellings in VLLM_DTYPE_SPELLINGS.items():
        if str(value).lower() in spellings:
            return name
    return None


def rollout_logprobs_bias(cfg: PipelineConfig) -> Optional[str]:
    """Why actor_infer's rollout log-probs are a different quantity from what the trainer scores
    (so `old_logprob_source: rollout` would bias every ratio), or None when they are the same."""
    role = cfg.actor_infer
    if not role.strategy_args.engine.logprobs_modes:
        return None  # the engine re-scores the responses the trainer's way (hf_infer)
    gen = role.generating_args
    override = role.strategy_args.strategy_config.get("logprobs_mode")
    if override is not None:
        return (f"actor_infer.strategy_args.strategy_config.logprobs_mode = {override!r} overrides the "
                f"mode roll_gspo picks so that vLLM reports the trainer's log-probs "
                f"({vllm_logprobs_mode(gen) or 'none exists for these sampling keys'}); remove it")
    if vllm_logprobs_mode(gen) is None:
        return (f"actor_infer.generating_args top_p = {gen.top_p} / top_k = {gen.top_k} at temperature "
                f"{gen.temperature}: vLLM reports log-probs either after the top-p/top-k cut "
                f"(renormalised over the kept tokens) or before the temperature, never the full "
                f"distribution at temperature {gen.temperature} that the trainer scores. Sample without "
                f"truncation (top_p: 1.0, top_k: -1) or at temperature 1.0 (then they are exact)")
    return None


# vLLM engine keys (actor_infer.strategy_args.strategy_config) that change what the engine computes,
# so its log-probs are not the trainer's even in fp32: a value other than the harmless one listed.
NUMERICS_KEYS: Dict[str, Tuple[Any, ...]] = {
    "kv_cache_dtype": ("auto", None),  # fp8 KV: attention reads rounded keys and values
    "quantization": (None,),  # quantized weights
    "logits_processors": (None, [], ()),  # a processor reshapes the distribution sampled from
    "speculative_config": (None, {}),  # draft-model proposals; vLLM's log-probs under it are not the target's alone
    "hf_overrides": (None, {}),  # the model's own config changed (rope, head sizes, ...)
    "calculate_kv_scales": (None, False),  # fp8 KV scales
}


def engine_numerics_changes(cfg: PipelineConfig) -> List[str]:
    """`strategy_config` keys of a vLLM actor_infer that make its numerics differ from the trainer's,
    as `key = value` strings (empty when none)."""
    if not cfg.actor_infer.strategy_args.engine.vllm_engine_args:
        return []
    config = cfg.actor_infer.strategy_args.strategy_config
    return [f"{key} = {config[key]!r}" for key, harmless in NUMERICS_KEYS.items()
            if key in config and config[key] not in harmless]


def rollout_logprobs_are_exact(cfg: PipelineConfig) -> Tuple[bool, str]:
    """(True, "") when actor_infer's log-probs are the trainer's old log-probs up to float32
    kernel differences (~1e-5 per token); else (False, the reason)."""
    bias = rollout_logprobs_bias(cfg)
    if bias:
        return False, bias
    changes = engine_numerics_changes(cfg)
    if changes:
        return False, (f"actor_infer.strategy_args.strategy_config {', '.join(changes)} changes the engine's "
                       f"numerics: its log-probs are not the trainer's")
    infer_dtype = cfg.actor_infer.model_args.dtype
    engine_dtype = cfg.actor_infer.strategy_args.strategy_config.get("dtype")
    if cfg.actor_infer.strategy_args.engine.vllm_engine_args and engine_dtype is not None:
        infer_dtype = vllm_dtype_name(engine_dtype) or str(engine_dtype)
    if infer_dtype != "fp32" or cfg.actor_train.model_args.dtype != "fp32":
        return False, (f"actor_infer runs in {infer_dtype} and actor_train in {cfg.actor_train.model_args.dtype}: "
                       f"outside fp32 the engines' log-probs differ by up to 0.5 nats per token")
    return True, ""
