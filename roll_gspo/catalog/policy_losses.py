"""The facts of each policy loss (`policy_loss`; the functions are in
roll_gspo.algorithms.policy_losses): the importance ratios and aggregations it is defined on, what
it takes when the YAML writes none, the keys it reads, and the other frameworks' names for it.
The config checks, the schema's choices and the loss library read this one table. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

TOKEN = ("token",)
ANY_RATIO = ("seq", "token", "gspo-token")
ANY_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossSpec:
    """What the config needs to know about one policy loss."""
    name: str
    title: str  # a few words for --dry-run
    ratio_levels: Tuple[str, ...]  # importance_sampling values it accepts
    implied_ratio: Optional[str]  # importance_sampling it takes when the YAML does not write one
    agg_modes: Tuple[str, ...]  # loss_agg_mode values it accepts
    implied_agg: Optional[str] = None  # loss_agg_mode it takes when the YAML does not write one
    reads_clip: bool = False  # reads pg_clip_low / pg_clip_high
    clip_in_log_space: bool = False  # reads them as bounds on a log-ratio (GMPO), not on the ratio
    reads_dual_clip: bool = False
    keys: Tuple[str, ...] = ()  # its own keys (top-level)
    why_ratio: str = ""  # the reason in a refusal of another ratio
    why_agg: str = ""


LOSS_SPECS: Dict[str, LossSpec] = {s.name: s for s in (
    LossSpec("clip", "clipped surrogate", ANY_RATIO, None, ANY_AGG, reads_clip=True, reads_dual_clip=True),
    LossSpec("cispo", "CISPO: clipped IS weight x log-prob", ANY_RATIO, "token", ANY_AGG,
             keys=("cispo_epsilon_low", "cispo_epsilon_high", "cispo_use_unified_mask")),
    LossSpec("sapo", "SAPO: soft gate", ANY_RATIO, "token", ANY_AGG,
             keys=("sapo_temperature_pos", "sapo_temperature_neg")),
    LossSpec("gmpo", "GMPO: geometric mean of log-clipped token ratios", ("seq",), None, ("seq-mean-token-mean",),
             reads_clip=True, clip_in_log_space=True,
             why_ratio="GMPO builds its own sequence ratio (the geometric mean of token ratios, each clipped in log "
                       "space): leave importance_sampling at seq",
             why_agg="GMPO's objective is a mean over responses of one sequence term each"),
    LossSpec("luspo", "LUSPO: GSPO's sequence term x response length", ("seq",), None, ("seq-mean-token-sum",),
             "seq-mean-token-sum", reads_clip=True,
             why_ratio="LUSPO is defined on GSPO's sequence ratio (TRL: importance_sampling_level sequence); with "
                       "token ratios use policy_loss: clip",
             why_agg="LUSPO's length-unbiased objective sums each response's tokens (TRL scales the sequence term "
                     "by |y_i|)"),
    LossSpec("vespo", "VESPO: gamma-weighted sequence IS x log-prob", ("seq",), None, ANY_AGG,
             keys=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
             why_ratio="VESPO computes its own sequence weight from the token log-ratios; a token ratio level "
                       "contradicts it"),
    LossSpec("clip_cov", "Clip-Cov: token clip, high-covariance tokens detached", TOKEN, "token", ANY_AGG,
             reads_clip=True, keys=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
             why_ratio="Clip-Cov selects single tokens by covariance and detaches them; a sequence ratio would "
                       "carry their gradient through the response's mean"),
    LossSpec("kl_cov", "KL-Cov: unclipped ratio, KL on high-covariance tokens", TOKEN, "token", ANY_AGG,
             keys=("kl_cov_ratio", "kl_cov_coef"),
             why_ratio="KL-Cov penalises single tokens' log-ratios; it is defined on token ratios"),
    LossSpec("reinforce", "REINFORCE: -A x log-prob (no ratio)", ANY_RATIO, None, ANY_AGG),
    LossSpec("tis", "TIS: truncated IS weight x log-prob", TOKEN, "token", ANY_AGG,
             keys=("tis_lower_bound", "tis_upper_bound"),
             why_ratio="ROLL's TIS truncates each token's ratio"),
    LossSpec("topr", "TOPR: REINFORCE on positives, truncated IS on negatives", TOKEN, "token", ANY_AGG,
             keys=("topr_positive_weight", "topr_negative_weight"),
             why_ratio="TOPR truncates each token's ratio to [0, 1] on negative responses"),
    LossSpec("kimi15", "Kimi k1.5: -A x log-prob + tau/2 x log-ratio^2", TOKEN, "token", ANY_AGG,
             keys=("kimi15_tau",), why_ratio="Kimi k1.5's penalty is on each token's log-ratio"),
)}


@dataclass(frozen=True)
class Synonym:
    """Another framework's name: the canonical loss and what it implies for unwritten keys."""
    loss: str
    source: str
    implied: Dict[str, Any] = field(default_factory=dict)
    fixed: Tuple[str, ...] = ()  # implied keys whose written value must agree


_PPO_CLIP = {"importance_sampling": "token", "pg_clip_low": 0.2, "pg_clip_high": 0.2}
SYNONYMS: Dict[str, Synonym] = {
    "ppo": Synonym("clip", "ROLL pg_variant ppo (verl loss_mode vanilla): token-level PPO", dict(_PPO_CLIP)),
    "gspo": Synonym("clip", "verl loss_mode gspo", {"importance_sampling": "seq"}),
    "geo_mean": Synonym("gmpo", "verl loss_mode geo_mean"),
    "gpg": Synonym("reinforce", "verl loss_mode gpg"),
    "grpo": Synonym("clip", "TRL loss_type grpo", {**_PPO_CLIP, "loss_agg_mode": "seq-mean-token-mean"},
                    ("loss_agg_mode",)),
    "bnpo": Synonym("clip", "TRL loss_type bnpo", {**_PPO_CLIP, "loss_agg_mode": "token-mean"}, ("loss_agg_mode",)),
    "dapo": Synonym("clip", "TRL loss_type dapo", {**_PPO_CLIP, "loss_agg_mode": "token-mean"}, ("loss_agg_mode",)),
    "dr_grpo": Synonym("clip", "TRL loss_type dr_grpo", {**_PPO_CLIP, "loss_agg_mode": "seq-mean-token-sum-norm"},
                       ("loss_agg_mode",)),
}
# ROLL's actor_train.pg_variant -> policy_loss (a canonical name or a synonym).
ROLL_PG_VARIANTS: Dict[str, str] = {"vanilla": "reinforce", "ppo": "ppo", "tis": "tis", "topr": "topr",
                                    "cispo": "cispo", "kimi15": "kimi15"}


def canonical_loss(name: str) -> str:
    """The registered loss a ``policy_loss`` value names (a synonym's target, else itself)."""
    return SYNONYMS[name].loss if name in SYNONYMS else name




def choices() -> List[str]:
    """Every value `policy_loss` takes: the losses, then the other frameworks' names."""
    return list(LOSS_SPECS) + list(SYNONYMS)
