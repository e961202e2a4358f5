"""The algorithm library: GSPO/GRPO policy losses (and CISPO, SAPO, GMPO, LUSPO, VESPO, Clip-/KL-Cov,
ROLL's pg_variants), loss aggregation, KL, rewards and advantages,
and the rollout correction (train-inference mismatch).

Pure torch (no Ray, vLLM, DeepSpeed or transformers), pure functions over ``(batch,
response_len)`` tensors; see ``losses`` and ``advantages`` for the formulas.
"""
from .advantages import (
    ADV_ESTIMATORS,
    REWARD_NORMS,
    RunningMeanStd,
    clip_advantages,
    clip_rewards,
    compute_advantages,
    get_adv_estimator,
    grpo_advantages,
    normalize_rewards,
    register_adv_estimator,
    reinforce_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
)
from .losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    SurrogateTerms,
    aggregate_loss,
    clipped_surrogate,
    compute_importance_ratio,
    compute_log_ratio,
    entropy_from_logits,
    get_policy_loss,
    gspo_token_log_ratio,
    kl_loss,
    kl_penalty,
    loss_normalisers,
    masked_mean,
    masked_sum,
    policy_loss,
    register_policy_loss,
    response_ratios,
    seq_log_ratio,
    token_log_ratio,
)
from .policy_losses import (
    LOSS_SPECS,
    ROLL_PG_VARIANTS,
    SURROGATES,
    SYNONYMS,
    LossTerms,
    canonical_loss,
    get_surrogate,
    register_surrogate,
)
from .rollout_correction import (
    CORRECTION_LEVELS,
    SEQUENCE_MEAN_METRICS,
    RejectionRule,
    RolloutCorrection,
    kept_mask,
    rollout_correction,
)

__all__ = [
    # losses
    "KL_ESTIMATORS", "LOSS_AGG_MODES", "POLICY_LOSSES", "SurrogateTerms", "aggregate_loss",
    "clipped_surrogate", "compute_importance_ratio", "compute_log_ratio", "entropy_from_logits",
    "get_policy_loss", "gspo_token_log_ratio", "kl_loss", "kl_penalty", "masked_mean", "masked_sum",
    "loss_normalisers", "policy_loss", "register_policy_loss", "response_ratios", "seq_log_ratio", "token_log_ratio",
    # policy losses beside the clipped surrogate (policy_loss's `surrogate`)
    "LOSS_SPECS", "ROLL_PG_VARIANTS", "SURROGATES", "SYNONYMS", "LossTerms", "canonical_loss", "get_surrogate",
    "register_surrogate",
    # advantages
    "ADV_ESTIMATORS", "REWARD_NORMS", "RunningMeanStd", "clip_advantages", "clip_rewards",
    "compute_advantages", "get_adv_estimator", "grpo_advantages", "normalize_rewards",
    "register_adv_estimator", "reinforce_advantages", "rloo_advantages", "token_level_rewards",
    "whiten",
    # rollout correction (train-inference mismatch)
    "CORRECTION_LEVELS", "SEQUENCE_MEAN_METRICS", "RejectionRule", "RolloutCorrection", "kept_mask",
    "rollout_correction",
]
