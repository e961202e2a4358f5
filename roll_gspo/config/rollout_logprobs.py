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
``rollout_logprobs_are_exact`` also looks at precision, and ``choose_old_logprob_source`` resolves
the default `auto` with both: the rollout engine's log-probs where they are exact (the trainer's
whole forward pass is saved), the trainer's where anything needs them (the rollout correction, ``train_infer_correction``, always
does: its weights compare the two; ``rollout_correction_problems`` checks its keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from roll_gspo.config.schema import GeneratingArgs, PipelineConfig

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
    if role.strategy_args.strategy_name != "vllm":
        return None  # hf_infer re-scores the responses the trainer's way
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


def rollout_logprobs_are_exact(cfg: PipelineConfig) -> Tuple[bool, str]:
    """(True, "") when actor_infer's log-probs are the trainer's old log-probs up to float32
    kernel differences (~1e-5 per token); else (False, the reason)."""
    bias = rollout_logprobs_bias(cfg)
    if bias:
        return False, bias
    infer_dtype = cfg.actor_infer.model_args.dtype
    engine_dtype = cfg.actor_infer.strategy_args.strategy_config.get("dtype")
    if cfg.actor_infer.strategy_args.strategy_name == "vllm" and engine_dtype is not None:
        infer_dtype = vllm_dtype_name(engine_dtype) or str(engine_dtype)
    if infer_dtype != "fp32" or cfg.actor_train.model_args.dtype != "fp32":
        return False, (f"actor_infer runs in {infer_dtype} and actor_train in {cfg.actor_train.model_args.dtype}: "
                       f"outside fp32 the engines' log-probs differ by up to 0.5 nats per token")
    return True, ""


@dataclass(frozen=True)
class OldLogprobChoice:
    """Where a run's old log-probs come from, and why (logged once at start)."""
    source: str  # "trainer" | "rollout"
    reason: str
    # auto outside fp32: follow the measured gap, taking the rollout's below it (see the pipeline)
    max_gap: Optional[float] = None


def auto_max_gap(cfg: PipelineConfig) -> float:
    """old_logprob_auto_max_gap, or a tenth of pg_clip_low when it is null."""
    return cfg.pg_clip_low / 10 if cfg.old_logprob_auto_max_gap is None else cfg.old_logprob_auto_max_gap


def choose_old_logprob_source(cfg: PipelineConfig, model_is_moe: bool = False) -> OldLogprobChoice:
    """Resolve `old_logprob_source` (auto: the rollout engine's log-probs where they are the
    trainer's old log-probs and nothing needs the trainer's pass; else the trainer's).

    model_is_moe: the policy routes tokens to experts (its config has num_experts /
    num_local_experts > 0); only the pipeline knows it, after the model folder exists.
    """
    if cfg.old_logprob_source != "auto":
        return OldLogprobChoice(cfg.old_logprob_source, f"old_logprob_source: {cfg.old_logprob_source} in the config")
    trainer = lambda why: OldLogprobChoice("trainer", f"auto: {why}")  # noqa: E731
    if correction_enabled(cfg):  # never follows the gap: the weights need both log-probs every step
        return trainer("train_infer_correction weighs each sample by exp(old_logp - rollout_logp), which needs "
                       "the trainer's old log-probs beside the rollout engine's")
    if cfg.async_generation_ratio:  # what validation refuses with it (bias, router_replay) never gets here
        return OldLogprobChoice("rollout", "auto: async_generation_ratio 1 samples each step with the weights of "
                                           "the step before, which only the rollout engine still holds")
    if cfg.router_replay:
        return trainer("router_replay replays the experts the trainer records while it scores the old log-probs")
    if model_is_moe:
        return trainer("a Mixture-of-Experts policy: the trainer's old-log-prob pass records each token's experts "
                       "(moe/expert_volatility, moe/load_balance_max_over_mean); old_logprob_source: rollout skips "
                       "it and those metrics")
    if cfg.importance_sampling == "token":
        return trainer("importance_sampling: token takes each token's engine mismatch into its own ratio "
                       "unaveraged (GSPO's sequence ratio averages it over the response)")
    if cfg.model_update_frequency > 1:
        return trainer(f"model_update_frequency = {cfg.model_update_frequency}: the rollout log-probs come from "
                       f"stale weights, and a ratio measured from them starts outside a GSPO-sized clip")
    bias = rollout_logprobs_bias(cfg)
    if bias:
        return trainer(bias)
    exact, why_not = rollout_logprobs_are_exact(cfg)
    if not exact:  # precision only: measure the gap
        threshold = auto_max_gap(cfg)
        if threshold > 0:
            return OldLogprobChoice("trainer", f"auto: {why_not}; the trainer's until a step measures a mean "
                                               f"gap below old_logprob_auto_max_gap = {threshold:g}", threshold)
        return trainer(why_not)
    engine = cfg.actor_infer.strategy_args.strategy_name
    return OldLogprobChoice("rollout", f"auto: {engine}'s sampled-token log-probs are the trainer's (fp32 on both "
                                       f"sides, temperature applied, full distribution); the trainer's "
                                       f"old-log-prob forward pass is skipped")


# --------------------------------------------------------------------------------------------
# Rollout correction (train_infer_correction / verl's rollout_correction)
# --------------------------------------------------------------------------------------------
def correction_enabled(cfg: PipelineConfig) -> bool:
    """The rollout correction acts: importance weights or at least one rejection rule."""
    correction = cfg.train_infer_correction
    return correction.is_weight.enabled or any(rule.enabled for rule in correction.filters)


def correction_arguments(cfg: PipelineConfig) -> dict:
    """Keywords of `roll_gspo.algorithms.rollout_correction` for this config (is_level,
    is_threshold, rejections)."""
    from roll_gspo.algorithms.rollout_correction import RejectionRule

    weight = cfg.train_infer_correction.is_weight
    rules = [RejectionRule(rule.agg_type, *((rule.ratio_low, rule.ratio_high) if rule.ratio_enabled else (None, None)),
                           *((rule.diff_low, rule.diff_high) if rule.diff_enabled else (None, None)))
             for rule in cfg.train_infer_correction.filters if rule.enabled]
    return {"is_level": weight.weight_type if weight.enabled else None,
            "is_threshold": weight.upper_bound if weight.enabled else None, "rejections": rules}


def rollout_correction_problems(cfg: PipelineConfig) -> list:
    """Bad train_infer_correction values, and what the correction cannot run with."""
    problems = []
    weight = cfg.train_infer_correction.is_weight
    key = "train_infer_correction.is_weight"
    if weight.enabled and weight.weight_type == "segment":
        problems.append(f"{key}.weight_type = 'segment' is refused: per-turn weights are not built; use token, "
                        f"geometric (GSPO's length-normalised sequence weight) or sequence")
    if weight.enabled and weight.upper_bound is not None and not weight.upper_bound > 1.0:
        problems.append(f"{key}.upper_bound (verl: rollout_correction.rollout_is_threshold) must be > 1 or null, "
                        f"got {weight.upper_bound}: a bound at or below 1 truncates every weight the trainer "
                        f"favours, which biases the loss towards what the rollout engine over-samples")
    for index, rule in enumerate(cfg.train_infer_correction.filters):
        key = f"train_infer_correction.filters[{index}]"
        if not rule.enabled:
            continue
        if rule.agg_type == "segment":
            problems.append(f"{key}.agg_type = 'segment' is refused: per-turn rejection is not built; use token, "
                            f"geometric or sequence")
        if not (rule.ratio_enabled or rule.diff_enabled):
            problems.append(f"{key}: enabled with ratio_enabled and diff_enabled both false rejects nothing; "
                            f"enable one test or remove the rule")
        if rule.ratio_enabled and not 0.0 <= rule.ratio_low < 1.0:
            problems.append(f"{key}.ratio_low must be in [0, 1), got {rule.ratio_low}: the band must hold "
                            f"weight 1 (engines that agree)")
        if rule.ratio_enabled and not rule.ratio_high > 1.0:
            problems.append(f"{key}.ratio_high (verl: rollout_correction.rollout_rs_threshold) must be > 1, got "
                            f"{rule.ratio_high}: a bound at or below 1 rejects every sample the trainer favours")
        if rule.diff_enabled and not rule.diff_low < 0.0 < rule.diff_high:
            problems.append(f"{key}: diff_low < 0 < diff_high is required (engines that agree differ by 0), got "
                            f"[{rule.diff_low}, {rule.diff_high}]")
    if not correction_enabled(cfg):
        return problems
    if cfg.old_logprob_source == "rollout":
        problems.append("train_infer_correction (or rollout_correction) needs the trainer's old log-probs: with "
                        "old_logprob_source: rollout the old policy IS the rollout engine's, every weight "
                        "exp(old_logp - rollout_logp) would be 1 and the correction would do nothing; use "
                        "old_logprob_source: trainer or auto (which takes the trainer's with the correction on)")
    if cfg.async_generation_ratio:
        problems.append("train_infer_correction (or rollout_correction) with async_generation_ratio: 1 is refused: "
                        "the asynchronous pipeline takes its old log-probs from the rollout engine (the only holder "
                        "of the stale weights), so the weights would all be 1")
    return problems
