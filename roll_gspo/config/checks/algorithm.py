"""The RL algorithm's keys together: batch arithmetic, estimators that need groups or turns, reward
normalisation, the roles' strategy names, and the GSPO traps (clip sizes against the ratio's level,
optimizer steps per rollout, KL applied twice, stale rollouts uncorrected)."""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.catalog import engines
from roll_gspo.catalog.estimators import ESTIMATORS
from roll_gspo.catalog.policy_losses import LOSS_SPECS, canonical_loss
from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, error, warning
from roll_gspo.config.plan.correction import correction_enabled
from roll_gspo.config.plan.engine_logprobs import rollout_logprobs_are_exact
from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source
from roll_gspo.schema.config import PipelineConfig


# A sequence ratio is a geometric mean of token ratios and stays within ~1e-3 of 1; a clip range
# wider than this essentially never fires under importance_sampling: seq.
SEQ_CLIP_WARN_ABOVE = 5e-3

# More optimizer steps than this per rollout: the later mini-batches train on responses of a
# policy many steps old, where a GSPO-sized clip zeroes most of their gradient.
MANY_OPTIMIZER_STEPS_PER_ROLLOUT = 16


def _quoted(names: List[str]) -> str:
    """'a', 'b' or 'c'."""
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


@check("check", keys=("rollout_batch_size", "adv_estimator", "reward_norm", "pg_clip_low", "pg_clip_high",
                      "<role>.strategy_args.strategy_name", "<role>.generating_args.max_new_tokens",
                      "actor_train.data_args.file_name"),
       doc="batch arithmetic (responses per step not divisible by the mini-batch), estimators that need groups or "
           "turns, a `reward_norm` over sets of one response (every reward 0), contradictory reward and clip keys, "
           "`max_new_tokens` above `response_length`, strategy names a role cannot run, no training prompts",
       name="algorithm.problems", rollout_only=True)
def _algorithm_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    problems: List[Finding] = []
    group = cfg.num_return_sequences_in_group
    batch = cfg.rollout_batch_size * group
    mini = cfg.mini_batch_size()
    args = cfg.actor_train.training_args
    rlvr = cfg.pipeline == "rlvr"  # the agentic pipeline checks its own batch, groups and data (checks/agentic)
    if rlvr and batch % mini:
        problems.append(error("rollout_batch_size", 
            f"batch arithmetic: rollout_batch_size * num_return_sequences_in_group = "
            f"{cfg.rollout_batch_size} * {group} = {batch} responses per step is not divisible by the "
            f"mini-batch actor_train.training_args.per_device_train_batch_size * "
            f"gradient_accumulation_steps * actor_train.world_size = {args.per_device_train_batch_size} "
            f"* {args.gradient_accumulation_steps} * {cfg.actor_train.world_size} = {mini}"))
    if cfg.moe_aux_loss_coef < 0:
        problems.append(error("moe_aux_loss_coef",
                              f"moe_aux_loss_coef must be >= 0 (0: off), got {cfg.moe_aux_loss_coef}"))
    if cfg.old_logprob_auto_max_gap is not None and cfg.old_logprob_auto_max_gap < 0:
        problems.append(error("old_logprob_auto_max_gap", f"old_logprob_auto_max_gap must be >= 0 (0: never switch; "
                                                          f"null: pg_clip_low / 10), got "
                                                          f"{cfg.old_logprob_auto_max_gap}"))
    if cfg.router_replay and cfg.old_logprob_source == "rollout":
        problems.append(error("router_replay", "router_replay: true replays the experts recorded while the trainer "
                                               "computes the old log-probs; it needs old_logprob_source: trainer (or "
                                               "auto, the default)"))
    estimator = ESTIMATORS.get(cfg.adv_estimator)
    if rlvr and estimator is not None and "rlvr" not in estimator.pipelines:  # step_reinforce: turn credit
        problems.append(error("adv_estimator", f"adv_estimator {cfg.adv_estimator!r} credits the turns of multi-turn "
                                               f"episodes (pipeline: agentic); a single-turn response has one turn, "
                                               f"where it is `reinforce`: use that"))
    if rlvr and estimator is not None and group < estimator.min_group:
        problems.append(error("adv_estimator", f"adv_estimator {cfg.adv_estimator!r} needs "
                                               f"num_return_sequences_in_group >= 2 (a group baseline of one response "
                                               f"is the response itself), got {group}"))
    if cfg.reward_shift and cfg.reward_scale:
        problems.append(error("reward_shift", "reward_shift and reward_scale are both true: contradictory (shift only "
                                              "subtracts the mean, scale only divides by the std; set both false for a "
                                              "full z-score)"))
    if not 0 <= cfg.pg_clip_low < 1:
        problems.append(error("pg_clip_low", f"pg_clip_low: must be in [0, 1), got {cfg.pg_clip_low}"))
    if cfg.pg_clip_high < 0:
        problems.append(error("pg_clip_high", f"pg_clip_high: must be >= 0, got {cfg.pg_clip_high}"))
    if cfg.dual_clip_loss and cfg.dual_clip_c <= 1:
        problems.append(error("dual_clip_c",
                              f"dual_clip_c: must be > 1 when dual_clip_loss is true, got {cfg.dual_clip_c}"))
    for key in ("reward_clip", "advantage_clip"):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            problems.append(error(key, f"{key}: must be > 0 or null, got {value}"))
    gen = cfg.actor_infer.generating_args
    if gen.num_return_sequences != group:
        problems.append(error("actor_infer.generating_args.num_return_sequences",
                              f"actor_infer.generating_args.num_return_sequences = {gen.num_return_sequences} "
                              f"contradicts num_return_sequences_in_group = {group}; leave it null"))
    for key, generating in (("actor_infer", gen), ("validation", cfg.validation.generating_args)) if rlvr else ():
        if (generating.max_new_tokens or 0) > cfg.response_length:  # null was filled by the derive phase
            problems.append(error(f"{key}.generating_args.max_new_tokens",
                                  f"{key}.generating_args.max_new_tokens = {generating.max_new_tokens} exceeds "
                                  f"response_length = {cfg.response_length}"))
    if rlvr and cfg.reward_norm in ("group", "batch"):
        size = group if cfg.reward_norm == "group" else batch
        if size < 2:
            problems.append(error("reward_norm", f"reward_norm: {cfg.reward_norm} over sets of {size} response "
                                                 f"(num_return_sequences_in_group = {group}, rollout_batch_size = "
                                                 f"{cfg.rollout_batch_size}) turns every reward into 0; use "
                                                 f"reward_norm: null, or more responses per {cfg.reward_norm}"))
    if "actor_train" not in cfg.actor_train.strategy_args.engine.roles:
        problems.append(error("actor_train.strategy_args.strategy_name",
                              f"actor_train.strategy_args.strategy_name: must be {_quoted(engines.names('actor_train'))}, "
                              f"got {cfg.actor_train.strategy_args.strategy_name!r}"))
    if "actor_infer" not in cfg.actor_infer.strategy_args.engine.roles:
        problems.append(error("actor_infer.strategy_args.strategy_name",
                              f"actor_infer.strategy_args.strategy_name: must be {_quoted(engines.names('actor_infer'))}, "
                              f"got {cfg.actor_infer.strategy_args.strategy_name!r}"))
    if cfg.needs_reference() and "reference" not in cfg.reference.strategy_args.engine.roles:
        problems.append(error("reference.strategy_args.strategy_name",
                              f"reference.strategy_args.strategy_name: must be {_quoted(engines.names('reference'))} "
                              f"(the training engines build frozen), got {cfg.reference.strategy_args.strategy_name!r}"))
    if rlvr and not cfg.actor_train.data_args.file_name and not cfg.tasks:
        problems.append(error("actor_train.data_args.file_name",
                              "actor_train.data_args.file_name: no training prompts given (nor `tasks`)"))
    stage = cfg.actor_train.strategy_args.strategy_config.get("zero_optimization", {}).get("stage", 0)
    if cfg.actor_train.strategy_args.strategy_name == "deepspeed_train" and stage not in (0, 1, 2, 3):
        problems.append(error("actor_train.strategy_args.strategy_config.zero_optimization.stage",
                              f"actor_train.strategy_args.strategy_config.zero_optimization.stage: must be 0, 1, 2 or "
                              f"3, got {stage!r}"))
    return problems


@check("warn", keys=("ppo_epochs", "pg_clip_low", "pg_clip_high", "importance_sampling", "reward_shift",
                     "use_kl_loss", "old_logprob_source", "model_update_frequency"),
       doc="the GSPO traps: more than 16 or exactly one optimizer step per rollout, a token-sized clip with "
           "sequence ratios (or the reverse), KL applied twice, stale rollouts (`model_update_frequency` > 1) "
           "uncorrected, rollout log-probs with token ratios or outside fp32", name="algorithm.gspo_traps", rollout_only=True)
def _warn_traps(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    warns: List[Finding] = []
    batch = cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    mini = cfg.mini_batch_size()
    clip = max(cfg.pg_clip_low, cfg.pg_clip_high)
    if cfg.ppo_epochs * (batch // max(mini, 1)) == 1:
        warns.append(warning("ppo_epochs", 
            f"one optimizer step per rollout (ppo_epochs = 1 and the whole batch of {batch} is one "
            f"mini-batch): the importance ratio is exactly 1 at that step, clipping never fires and "
            f"GSPO degenerates to plain policy gradient. Lower gradient_accumulation_steps or "
            f"per_device_train_batch_size to get several mini-batches (the GSPO paper uses 4)."))
    loss = LOSS_SPECS[canonical_loss(cfg.policy_loss)]
    # The clip's size against the ratio's level matters only to a loss that clips the ratio itself.
    ratio_clipped = loss.reads_clip and not loss.clip_in_log_space
    if ratio_clipped and cfg.importance_sampling in ("seq", "gspo-token") and clip > SEQ_CLIP_WARN_ABOVE:
        warns.append(warning("importance_sampling", 
            f"importance_sampling: {cfg.importance_sampling} with a token-sized clip range "
            f"(pg_clip_low={cfg.pg_clip_low}, pg_clip_high={cfg.pg_clip_high}): sequence ratios stay "
            f"within ~1e-3 of 1, so this almost never clips. The GSPO paper uses 3e-4 / 4e-4."))
    if ratio_clipped and cfg.importance_sampling == "token" and clip < 1e-2:
        warns.append(warning("importance_sampling", f"importance_sampling: token with a sequence-sized clip range "
                                                    f"({clip}): most tokens will be clipped; PPO/GRPO use about 0.2."))
    if cfg.reward_norm is None and (cfg.reward_shift or cfg.reward_scale):
        warns.append(warning("reward_norm", "reward_shift / reward_scale have no effect while reward_norm is null"))
    if cfg.use_kl_loss and cfg.add_token_level_kl:
        warns.append(warning("use_kl_loss", "use_kl_loss and add_token_level_kl are both on: KL is penalised twice"))
    if (cfg.old_logprob_source == "rollout" and cfg.importance_sampling == "token"
            and not rollout_logprobs_are_exact(cfg)[0]):  # fp32 on both sides: ~1e-6 a token, nothing to warn of
        warns.append(warning("old_logprob_source", "old_logprob_source: rollout with token-level ratios outside "
                                                   "fp32: the engines' per-token precision mismatch enters every "
                                                   "ratio; GSPO's sequence ratio averages it out"))
    steps = cfg.ppo_epochs * (batch // max(mini, 1))
    if steps > MANY_OPTIMIZER_STEPS_PER_ROLLOUT:
        args = cfg.actor_train.training_args
        wanted = batch // 4
        warns.append(warning("ppo_epochs", 
            f"{steps} optimizer steps per rollout: ppo_epochs * rollout_batch_size * num_return_sequences_in_group "
            f"/ (actor_train.training_args.per_device_train_batch_size * gradient_accumulation_steps * "
            f"actor_train.world_size) = {cfg.ppo_epochs} * {cfg.rollout_batch_size} * {cfg.num_return_sequences_in_group}"
            f" / ({args.per_device_train_batch_size} * {args.gradient_accumulation_steps} * "
            f"{cfg.actor_train.world_size}) = {steps}. By the later mini-batches the policy has taken up to "
            f"{steps - 1} steps since it sampled their responses, so their ratios leave the clip range "
            f"(pg_clip_low / pg_clip_high = {cfg.pg_clip_low} / {cfg.pg_clip_high}) and give no gradient: most "
            f"of the rollout is wasted. The GSPO paper takes 4 steps per rollout, i.e. a mini-batch of {wanted} "
            f"responses (raise gradient_accumulation_steps or per_device_train_batch_size)."))
    if cfg.model_update_frequency > 1 and not correction_enabled(cfg):  # its weights pi_old / pi_rollout correct it
        k = cfg.model_update_frequency
        source = choose_old_logprob_source(cfg).source  # auto takes the trainer's here
        measured = ("the current trainer weights at the start of each step, not the older weights that sampled: "
                    "the staleness is neither corrected nor clipped" if source == "trainer" else
                    "the stale rollout weights, so it starts far from 1 and a GSPO-sized clip zeroes most gradients")
        warns.append(warning("model_update_frequency", 
            f"model_update_frequency = {k}: the rollout engine gets new weights every {k} steps, so up to {k - 1} "
            f"of every {k} rollouts are sampled by weights up to {k - 1} updates old (off-policy), and nothing "
            f"corrects for it. With old_logprob_source: {source} the importance ratio measures the "
            f"policy's change from {measured}. Use 1 unless you accept that, or turn on train_infer_correction "
            f"(its weights pi_old / pi_rollout then correct for the stale sampler)."))
    engine = cfg.actor_infer.strategy_args.strategy_config
    if (cfg.actor_infer.strategy_args.engine.logprobs_modes and "logprobs_mode" in engine
            and cfg.old_logprob_source != "rollout"):
        warns.append(warning("actor_infer.strategy_args.strategy_config.logprobs_mode",
                             f"actor_infer.strategy_args.strategy_config.logprobs_mode = {engine['logprobs_mode']!r} "
                             f"only changes the logged rollout/logprob_gap (old log-probs come from the trainer); "
                             f"without it roll_gspo picks the mode that matches the trainer's log-probs"))
    if cfg.actor_infer.model_args.dtype != "fp32" and cfg.old_logprob_source == "rollout":
        warns.append(warning("old_logprob_source", f"old_logprob_source: rollout with actor_infer dtype "
                                                   f"{cfg.actor_infer.model_args.dtype}: rollout log-probs may be far "
                                                   f"from the trainer's"))
    return warns
