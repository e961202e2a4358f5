"""Asynchronous rollout (`async_generation_ratio`): every rule of the key, in one place.

With `async_generation_ratio: 1` the rollout engine generates step N+1's responses while the trainer
trains on step N's, so each step trains on responses the weights of the step before sampled. Only
the rollout engine still holds those weights, so the old log-probs must be its own; everything that
needs the trainer's old log-probs, a sleeping engine or the scores of the rollout generated ahead is
refused with it.
"""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.config.engine_logprobs import rollout_logprobs_bias
from roll_gspo.config.findings import Finding, error, warning
from roll_gspo.config.registry import check
from roll_gspo.config.schema import PipelineConfig
from roll_gspo.config.train_infer_correction import correction_enabled

KEY = "async_generation_ratio"
# Why `old_logprob_source: auto` takes the rollout engine's log-probs with it (rollout_logprobs).
ASYNC_OLD_LOGPROBS = (f"{KEY} 1 samples each step with the weights of the step before, which only the rollout "
                      f"engine still holds")


def generates_ahead(cfg: PipelineConfig) -> bool:
    """The rollout engine generates the next step's responses while the trainer trains."""
    return bool(cfg.async_generation_ratio)


@check("check", keys=(KEY,),
       doc="`async_generation_ratio` other than 0 or 1; with 1: `old_logprob_source: trainer`, Routing Replay, "
           "rollout log-probs that would bias the ratio, the rollout engine asleep between phases, dynamic "
           "sampling, the rollout correction, the agentic pipeline", name="async.problems", rollout_only=True)
def _async_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    ratio = cfg.async_generation_ratio
    if ratio not in (0, 1):
        return [error(KEY, f"{KEY} = {ratio!r} is refused: 0 (synchronous) and 1 (generation one step ahead of "
                           f"training) are built; ROLL's larger integers are not")]
    if not ratio:
        return []
    problems = []
    if cfg.old_logprob_source == "trainer" or cfg.router_replay:
        problems.append(error(KEY, f"{KEY}: 1 needs the rollout engine's old log-probs (old_logprob_source: rollout "
                                   f"or auto, got {cfg.old_logprob_source}"
                                   f"{' with router_replay, which needs the trainer' if cfg.router_replay else ''}): "
                                   "the responses are sampled by the weights of the step before, which only the "
                                   "rollout engine still holds; the trainer's recompute would score the newer policy "
                                   "and the ratio would not correct for the staleness"))
    elif cfg.old_logprob_source == "auto":  # an explicit rollout with a bias is refused on its own
        bias = rollout_logprobs_bias(cfg)
        if bias:
            problems.append(error(KEY, f"{KEY}: 1 needs the rollout engine's old log-probs, and they would bias every "
                                       f"ratio here: {bias}"))
    from roll_gspo.placement.colocation import offload_between_phases

    if offload_between_phases(cfg):
        problems.append(error(KEY, f"{KEY}: 1 with the rollout engine put to sleep between phases (is_offload_states, "
                                   f"or roles sharing GPUs) is refused: generating ahead needs the rollout engine "
                                   f"awake while the trainer trains, on devices of its own"))
    filtered = [name for name, reward in cfg.rewards.items() if reward.query_filter_config.type != "no_filter"]
    if filtered:
        problems.append(error(KEY, f"{KEY}: 1 with dynamic sampling (rewards.{filtered[0]}.query_filter_config) is "
                                   f"not built: the extra generation rounds would need the scores of the rollout "
                                   f"generated ahead"))
    if correction_enabled(cfg):
        problems.append(error(KEY, f"train_infer_correction (or rollout_correction) with {KEY}: 1 is refused: the "
                                   f"asynchronous pipeline takes its old log-probs from the rollout engine (the only "
                                   f"holder of the stale weights), so the weights would all be 1"))
    if cfg.pipeline == "agentic":
        problems.append(error(KEY, f"{KEY}: the agentic pipeline plays its episodes synchronously (environments "
                                   f"already step while the engine generates); generating a step ahead is not "
                                   f"built, use 0"))
    return problems


@check("warn", keys=(KEY, "actor_infer.system_envs"),
       doc="`async_generation_ratio: 1` with more OMP threads for the CPU rollout engine than it reserves (they "
           "take the trainer's cores)", name="async.threads")
def _thread_warning(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if cfg.pipeline == "sft":
        return []
    rollout_threads = {**cfg.system_envs, **cfg.actor_infer.system_envs}.get("OMP_NUM_THREADS", "")
    reserved = max(1, int(cfg.actor_infer.num_cpus_per_worker))
    if not (generates_ahead(cfg) and rollout_threads.isdigit() and int(rollout_threads) > reserved
            and not cfg.actor_infer.num_gpus_per_worker):
        return []
    return [warning(KEY, f"{KEY}: 1 with OMP_NUM_THREADS = {rollout_threads} in actor_infer's system_envs, more "
                         f"threads than the {cfg.actor_infer.num_cpus_per_worker:g} CPU it reserves: generation now "
                         f"runs while the trainer trains, so those threads take the trainer's cores. Drop the setting "
                         f"(the synchronous examples set it because the trainer waits while vLLM generates).")]
