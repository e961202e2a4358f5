"""Asynchronous rollout (`async_generation_ratio`): every rule of the key, in one place.

With `async_generation_ratio: 1` the rollout engine generates step N+1's responses while the trainer
trains on step N's, so each step trains on responses the weights of the step before sampled. Only
the rollout engine still holds those weights, so the old log-probs must be its own; everything that
needs the trainer's old log-probs, a sleeping engine or the scores of the rollout generated ahead is
refused with it.

With `async_generation_ratio: k`, k >= 2, generation still runs one rollout ahead, and each rollout
rank keeps a pool of prompt groups in flight (roll_gspo.strategies.request_pool): responses span up
to k weight versions (partial rollouts by re-prefill), a step takes the first complete groups, and
no sample is trained more than k versions after its oldest token was sampled. Its rules are
`_bounded_problems`'s; `async_pool_batches` sizes the pools (docs/async.md).

Agentic runs (custom_envs' episodes) take both: with 1 the next step's episodes play while the
trainer trains; with k >= 2 episodes stay in flight across steps in an episode pool, cut between
turns (roll_gspo.agentic.episode_pool). An agent's episodes (`agent.agent_func`,
`agent.verifiers_env`) are the user's code behind the rollout endpoint and are refused with either.
"""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.config.plan.engine_logprobs import rollout_logprobs_bias
from roll_gspo.config.findings import Finding, error, warning
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.plan.async_mode import KEY, generates_ahead, staleness_bound
from roll_gspo.config.plan.correction import correction_enabled
from roll_gspo.config.plan.endpoint import uses_agent

POOL_KEY = "async_pool_batches"


@check("check", keys=(KEY, POOL_KEY),
       doc="`async_generation_ratio` below 0 or not an integer; with 1: `old_logprob_source: trainer`, Routing "
           "Replay, rollout log-probs that would bias the ratio, the rollout engine asleep between phases, dynamic "
           "sampling, the rollout correction, an agent's episodes (agent.agent_func, agent.verifiers_env); with "
           "k >= 2: `old_logprob_source: trainer` without a rollout correction, Routing Replay, biased rollout "
           "log-probs, the engine asleep between phases, model_update_frequency > 1, an agent's episodes, the "
           "rollout endpoint; `async_pool_batches` below 1, or above k with k >= 2", name="async.problems", rollout_only=True)
def _async_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    ratio = cfg.async_generation_ratio
    pool = cfg.async_pool_batches
    if not (isinstance(pool, (int, float)) and pool >= 1):
        return [error(POOL_KEY, f"{POOL_KEY} = {pool!r} is refused: at least 1 (the rollout batches of prompt groups "
                                f"each rollout rank keeps in flight; 1 = no over-sampling)")]
    if not isinstance(ratio, (int, float)) or ratio < 0 or not float(ratio).is_integer():
        return [error(KEY, f"{KEY} = {ratio!r} is refused: 0 (synchronous), 1 (generation one step ahead of "
                           f"training) or an integer k >= 2 (a staleness bound of k policy versions with partial "
                           f"rollouts)")]
    if not ratio:
        return []
    if ratio >= 2:
        return _pool_bound(cfg, int(ratio)) + _bounded_problems(cfg, int(ratio))
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
    problems += _agent_problems(cfg, f"{KEY}: 1")
    return problems


def _agent_problems(cfg: PipelineConfig, setting: str) -> List[Finding]:
    """An agent's episodes (the user's code through the rollout endpoint) with either async mode."""
    if not uses_agent(cfg):
        return []
    agent = "agent.agent_func" if cfg.agent.agent_func else "agent.verifiers_env"
    return [error(KEY, f"{setting} with an agent's episodes ({agent}) is not built: they are the user's own code "
                       f"calling the rollout endpoint, which the pipeline cannot pause between turns at a weight "
                       f"sync, nor replay from a checkpoint (custom_envs' episodes it can); use {KEY}: 0")]


def _pool_bound(cfg: PipelineConfig, k: int) -> List[Finding]:
    """More than k batches in a pool: the groups that start in one advance outnumber what the k
    steps before their bound can take, so some would be dropped whatever the cut waits for."""
    if cfg.async_pool_batches <= k:
        return []
    return [error(POOL_KEY, f"{POOL_KEY} = {cfg.async_pool_batches:g} with {KEY} = {k} is refused: at most {k}. A "
                            f"step takes one rollout batch of groups and a group may live {k} steps before the "
                            f"staleness bound drops it, so more than {k} batches in flight are more groups than the "
                            f"steps can train in time: the surplus would be generated and dropped "
                            f"(rollout/dropped_past_bound). Lower {POOL_KEY}, or raise {KEY}")]


def _bounded_problems(cfg: PipelineConfig, k: int) -> List[Finding]:
    """`async_generation_ratio: k`, k >= 2: what the request pools cannot honour."""
    problems = _agent_problems(cfg, f"{KEY} = {k}")  # an agent turns the endpoint on: its refusal says it all
    if problems:
        return problems
    if cfg.rollout_endpoint.enabled and cfg.pipeline == "agentic":
        problems.append(error(KEY, f"{KEY} = {k} with rollout_endpoint is not built for agentic runs: the episode "
                                   f"pool leaves the engine empty at each weight sync, and outside clients' requests "
                                   f"would run across it, their tokens of two versions unbounded (use {KEY}: 0 or 1)"))
    elif cfg.rollout_endpoint.enabled:
        problems.append(error(KEY, f"{KEY} = {k} with rollout_endpoint is not built: the request pools step the "
                                   f"rollout engine themselves, between steps it holds nothing, and the endpoint needs "
                                   f"it driven by its engine loop the whole run (use {KEY}: 0 or 1)"))
    if cfg.router_replay:
        problems.append(error(KEY, f"{KEY} = {k} with router_replay is refused: Routing Replay replays the experts "
                                   f"the trainer records while it recomputes the old log-probs, and responses here "
                                   f"span up to {k} older policies whose routing no pass records"))
    if cfg.old_logprob_source == "trainer" and not correction_enabled(cfg):
        problems.append(error(KEY, f"{KEY} = {k} with old_logprob_source: trainer and no rollout correction "
                                   f"(train_infer_correction) is refused: the trainer's recompute scores the current "
                                   f"policy, so the ratio would hide up to {k} versions of staleness. Use "
                                   f"old_logprob_source: rollout (or auto), each token's own behaviour log-prob, or "
                                   f"keep trainer and enable train_infer_correction.is_weight (decoupled PPO: the "
                                   f"weight exp(old - rollout) per token carries the staleness)"))
    elif cfg.old_logprob_source == "auto" and not correction_enabled(cfg):
        bias = rollout_logprobs_bias(cfg)
        if bias:
            problems.append(error(KEY, f"{KEY} = {k} needs the rollout engine's old log-probs, and they would bias "
                                       f"every ratio here: {bias}"))
    from roll_gspo.placement.colocation import offload_between_phases

    if offload_between_phases(cfg):
        problems.append(error(KEY, f"{KEY} = {k} with the rollout engine put to sleep between phases "
                                   f"(is_offload_states, or roles sharing GPUs) is refused: generating ahead needs "
                                   f"the rollout engine awake while the trainer trains, on devices of its own"))
    if cfg.model_update_frequency > 1:
        problems.append(error(KEY, f"{KEY} = {k} with model_update_frequency = {cfg.model_update_frequency} is "
                                   f"refused: the bound counts policy versions as steps, and weights synced every "
                                   f"{cfg.model_update_frequency} steps would leave fresh samples past it"))
    return problems


@check("warn", keys=(POOL_KEY,), doc="`async_pool_batches` set while async_generation_ratio is below 2 (no effect)",
       name="async.pool_unused", rollout_only=True)
def _pool_unused(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    set_here = POOL_KEY in yaml_keys if yaml_keys is not None else cfg.async_pool_batches != 2.0
    if not set_here or staleness_bound(cfg) is not None:
        return []
    return [warning(POOL_KEY, f"{POOL_KEY} acts only with {KEY} >= 2 (request pools); with "
                              f"{KEY} = {cfg.async_generation_ratio:g} it has no effect")]


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
    return [warning(KEY, f"{KEY}: {cfg.async_generation_ratio:g} with OMP_NUM_THREADS = {rollout_threads} in actor_infer's system_envs, more "
                         f"threads than the {cfg.actor_infer.num_cpus_per_worker:g} CPU it reserves: generation now "
                         f"runs while the trainer trains, so those threads take the trainer's cores. Drop the setting "
                         f"(the synchronous examples set it because the trainer waits while vLLM generates).")]
