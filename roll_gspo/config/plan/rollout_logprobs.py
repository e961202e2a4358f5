"""Where a run's old log-probs come from: `choose_old_logprob_source` resolves `old_logprob_source`
(auto: the rollout engine's log-probs where they are the trainer's old log-probs, so the trainer's
whole forward pass is saved; the trainer's where anything needs them, e.g. the rollout correction,
whose weights compare the two).

What the engine's log-probs are (vLLM's modes, dtype, bias) is `engine_logprobs`'; whether the rollout
correction acts is `correction`'s; whether generation runs ahead is `async_mode`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from roll_gspo.config.plan.async_mode import ASYNC_OLD_LOGPROBS, generates_ahead
from roll_gspo.config.plan.engine_logprobs import rollout_logprobs_are_exact, rollout_logprobs_bias
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.plan.correction import correction_enabled


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
    engine = cfg.actor_infer.strategy_args.strategy_name
    skipped = (f"auto: {engine}'s sampled-token log-probs are the trainer's (fp32 on both sides, temperature "
               f"applied, full distribution); the trainer's old-log-prob forward pass is skipped")
    exact, why_not = rollout_logprobs_are_exact(cfg)  # precision and quantity; staleness is below
    synchronous = not generates_ahead(cfg) and cfg.model_update_frequency == 1
    if correction_enabled(cfg):  # never follows the gap: the weights need both log-probs every step
        if exact and synchronous and not cfg.router_replay and not model_is_moe:
            # Its weights exp(old - rollout) would be 1 up to fp32 kernel differences (~1e-6): a
            # whole forward pass for nothing, e.g. a bf16 recipe whose `dtype: auto` chose fp32.
            return OldLogprobChoice("rollout", f"{skipped}; train_infer_correction has nothing to correct (its "
                                               f"weights exp(old_logp - rollout_logp) are 1)")
        return trainer("train_infer_correction weighs each sample by exp(old_logp - rollout_logp), which needs "
                       "the trainer's old log-probs beside the rollout engine's")
    if generates_ahead(cfg):  # what validation refuses with it (bias, router_replay) never gets here
        return OldLogprobChoice("rollout", f"auto: {ASYNC_OLD_LOGPROBS}")
    if cfg.router_replay:
        return trainer("router_replay replays the experts the trainer records while it scores the old log-probs")
    if model_is_moe:
        return trainer("a Mixture-of-Experts policy: the trainer's old-log-prob pass records each token's experts "
                       "(moe/expert_volatility, moe/load_balance_max_over_mean); old_logprob_source: rollout skips "
                       "it and those metrics")
    if cfg.model_update_frequency > 1:
        return trainer(f"model_update_frequency = {cfg.model_update_frequency}: the rollout log-probs come from "
                       f"stale weights, and a ratio measured from them starts outside a GSPO-sized clip")
    bias = rollout_logprobs_bias(cfg)
    if bias:
        return trainer(bias)
    if not exact and cfg.importance_sampling == "token":  # in fp32 each token's mismatch is ~1e-6: nothing
        return trainer(f"{why_not}; importance_sampling: token takes each token's engine mismatch into its own "
                       f"ratio unaveraged (GSPO's sequence ratio averages it over the response)")
    if not exact:  # precision only: measure the gap
        threshold = auto_max_gap(cfg)
        if threshold > 0:
            return OldLogprobChoice("trainer", f"auto: {why_not}; the trainer's until a step measures a mean "
                                               f"gap below old_logprob_auto_max_gap = {threshold:g}", threshold)
        return trainer(why_not)
    return OldLogprobChoice("rollout", skipped)
