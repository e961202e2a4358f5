"""The policy loss's keys: `policy_loss` and the keys of each loss (roll_gspo.algorithms.policy_losses),
ROLL's `actor_train.pg_variant` / `worker_cls` / topr weights, the other frameworks' names, the
combinations a loss is not defined on, and the keywords the trainer passes (`policy_loss_options`)."""
from __future__ import annotations

from typing import AbstractSet, Any, Dict, List, Optional

from roll_gspo.catalog.policy_losses import LOSS_SPECS, ROLL_PG_VARIANTS, SYNONYMS, canonical_loss
from roll_gspo.config.findings import Finding, error, notice, warning
from roll_gspo.config.checks.registry import check
from roll_gspo.config.roll.roll_compat import ROLL_DEFAULT_ACTOR_WORKERS, ROLL_PG_WORKERS
from roll_gspo.schema.config import PipelineConfig

ROLL_ROLE_KEYS = ("pg_variant", "worker_cls", "topr_positive_weight", "topr_negative_weight")
OTHER_ROLES = ("actor_infer", "reference", "critic")
# GMPO's clip range in log space when the YAML writes none (the GMPO paper's e^-0.4 .. e^0.4).
GMPO_LOG_CLIP = 0.4
# Every loss's own keys; the trainer passes those of the loss that runs.
LOSS_KEYS = tuple(key for spec in LOSS_SPECS.values() for key in spec.keys)


def _unwritten(key: str, yaml_keys: Optional[AbstractSet[str]]) -> bool:
    """True when the YAML (or an override) is known not to write `key`; a config built in code
    (no yaml_keys) counts as writing every key, so nothing is filled in for it."""
    return yaml_keys is not None and key not in yaml_keys


def _clip_unwritten(yaml_keys: Optional[AbstractSet[str]]) -> bool:
    return all(_unwritten(k, yaml_keys) for k in ("pg_clip_low", "pg_clip_high", "pg_clip"))


@check("normalise", keys=("actor_train.pg_variant", "pg_variant", "actor_train.worker_cls",
                          "actor_train.topr_positive_weight", "actor_train.topr_negative_weight", "policy_loss"),
       doc="ROLL's actor_train.pg_variant (and its top-level anchor) acts as policy_loss, its topr weights as the "
           "top-level ones; its policy-gradient worker_cls is accepted with one notice; these keys on another role, "
           "another worker class or a contradiction with policy_loss are refused", name="policy_loss.roll_names")
def _roll_names(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    found: List[Finding] = []
    for role in OTHER_ROLES:
        block = getattr(cfg, role, None)
        for key in ROLL_ROLE_KEYS if block is not None else ():
            if getattr(block, key) is not None:
                found.append(error(f"{role}.{key}", f"{role}.{key} = {getattr(block, key)!r} is never read: ROLL reads "
                                                    f"it on actor_train only", "set it on actor_train or remove it"))
    train = cfg.actor_train
    worker = train.worker_cls
    pg_worker = worker in ROLL_PG_WORKERS
    if worker is not None and not pg_worker and worker not in ROLL_DEFAULT_ACTOR_WORKERS:
        found.append(error("actor_train.worker_cls", f"actor_train.worker_cls = {worker!r}: the trainer here is "
                                                     f"roll_gspo.workers.actor_train.ActorTrainWorker; accepted ROLL "
                                                     f"classes: {', '.join(ROLL_PG_WORKERS + ROLL_DEFAULT_ACTOR_WORKERS)}",
                           "choose the loss with policy_loss (or actor_train.pg_variant) and remove worker_cls"))
    variant = train.pg_variant
    if cfg.pg_variant is not None and variant is not None and cfg.pg_variant != variant:
        found.append(error("pg_variant", f"pg_variant = {cfg.pg_variant!r} contradicts actor_train.pg_variant = "
                                         f"{variant!r}", "keep one value"))
        return found
    variant = variant or cfg.pg_variant
    written_loss = not _unwritten("policy_loss", yaml_keys) and (yaml_keys is not None or cfg.policy_loss != "clip")
    if variant is None and pg_worker and not written_loss:
        variant = "vanilla"  # what ROLL's ActorPGWorker runs without pg_variant
    if variant is not None:
        target = ROLL_PG_VARIANTS[variant]
        if written_loss and canonical_loss(cfg.policy_loss) != canonical_loss(target):
            found.append(error("policy_loss", f"policy_loss = {cfg.policy_loss!r} contradicts ROLL's pg_variant = "
                                              f"{variant!r} (policy_loss {target!r} here)", "keep one of them"))
        elif not written_loss:
            cfg.policy_loss = target
    if pg_worker:
        found.append(notice("actor_train.worker_cls", f"actor_train.worker_cls = {worker!r}: ROLL's policy-gradient "
                                                      f"worker; here actor_train runs policy_loss {cfg.policy_loss!r}"
                                                      + ("" if train.pg_variant or cfg.pg_variant or written_loss
                                                         else " (ROLL's default pg_variant vanilla)")))
    for key in ("topr_positive_weight", "topr_negative_weight"):
        value = getattr(train, key)
        if value is None:
            continue
        if not _unwritten(key, yaml_keys) and yaml_keys is not None and getattr(cfg, key) != value:
            found.append(error(f"actor_train.{key}", f"actor_train.{key} = {value} (ROLL's name) contradicts {key} = "
                                                     f"{getattr(cfg, key)}", "keep one of them"))
        else:
            setattr(cfg, key, float(value))
    return found


@check("normalise", keys=("policy_loss", "importance_sampling", "loss_agg_mode", "pg_clip_low", "pg_clip_high"),
       doc="another framework's loss name (ppo, gspo, geo_mean, gpg, grpo, bnpo, dapo, dr_grpo) becomes the loss it "
           "stands for, and the keys it and the loss imply are filled where the YAML writes none (one notice); an "
           "implied loss_agg_mode written otherwise is refused", name="policy_loss.names",
       after=("policy_loss.roll_names",))
def _names(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    found: List[Finding] = []
    filled: Dict[str, Any] = {}
    name = cfg.policy_loss
    if name in SYNONYMS:
        synonym = SYNONYMS[name]
        for key, value in synonym.implied.items():
            unwritten = _clip_unwritten(yaml_keys) if key.startswith("pg_clip") else _unwritten(key, yaml_keys)
            if unwritten:
                filled[key] = value
            elif key in synonym.fixed and getattr(cfg, key) != value:
                found.append(error(key, f"{key} = {getattr(cfg, key)!r} contradicts policy_loss = {name!r} "
                                        f"({synonym.source}, which is {key} {value!r})",
                                   f"write policy_loss: {synonym.loss} to choose {key} yourself"))
        cfg.policy_loss = synonym.loss
    spec = LOSS_SPECS[cfg.policy_loss]
    if spec.implied_ratio and _unwritten("importance_sampling", yaml_keys):
        filled.setdefault("importance_sampling", spec.implied_ratio)
    if spec.implied_agg and _unwritten("loss_agg_mode", yaml_keys):
        filled.setdefault("loss_agg_mode", spec.implied_agg)
    if cfg.policy_loss == "gmpo" and _clip_unwritten(yaml_keys):
        filled.update(pg_clip_low=GMPO_LOG_CLIP, pg_clip_high=GMPO_LOG_CLIP)
    changed = {k: v for k, v in filled.items() if getattr(cfg, k) != v}
    for key, value in changed.items():
        setattr(cfg, key, value)
    if changed:
        said = ", ".join(f"{k}: {v}" for k, v in changed.items())
        found.append(notice("policy_loss", f"policy_loss {name!r}" + (f" ({cfg.policy_loss})" if name != cfg.policy_loss
                                                                       else "") + f" with {said} (not written)",
                            "write them to choose otherwise"))
    return found


@check("check", keys=("policy_loss", "importance_sampling", "loss_agg_mode") + LOSS_KEYS,
       doc="a policy_loss with an importance_sampling or loss_agg_mode it is not defined on (luspo / gmpo / vespo "
           "without sequence ratios, clip_cov / kl_cov / tis / topr / kimi15 without token ratios, gmpo or luspo "
           "with another aggregation), and the loss keys out of range", name="policy_loss.combinations",
       rollout_only=True)
def _combinations(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    found: List[Finding] = []
    spec = LOSS_SPECS[canonical_loss(cfg.policy_loss)]
    if cfg.importance_sampling not in spec.ratio_levels:
        found.append(error("importance_sampling", f"policy_loss {spec.name} with importance_sampling "
                                                  f"{cfg.importance_sampling!r} is refused: {spec.why_ratio}",
                           f"use importance_sampling {' or '.join(spec.ratio_levels)}"))
    if cfg.loss_agg_mode not in spec.agg_modes:
        found.append(error("loss_agg_mode", f"policy_loss {spec.name} with loss_agg_mode {cfg.loss_agg_mode!r} is "
                                            f"refused: {spec.why_agg}", f"use loss_agg_mode {spec.agg_modes[0]}"))
    ranges = (("cispo_epsilon_low", 0.0, None), ("cispo_epsilon_high", 0.0, None), ("vespo_k_pos", 0.0, None),
              ("vespo_k_neg", 0.0, None), ("kl_cov_coef", 0.0, None), ("tis_lower_bound", 0.0, None),
              ("topr_positive_weight", 0.0, None), ("topr_negative_weight", 0.0, None), ("kimi15_tau", 0.0, None))
    for key, low, _ in ranges:
        if getattr(cfg, key) < low:
            found.append(error(key, f"{key} must be >= {low:g}, got {getattr(cfg, key)}"))
    for key in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
        if not getattr(cfg, key) > 0:
            found.append(error(key, f"{key} must be > 0, got {getattr(cfg, key)}"))
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        if not 0 < getattr(cfg, key) <= 1:
            found.append(error(key, f"{key} is a share of the tokens, in (0, 1]; got {getattr(cfg, key)}"))
    if not cfg.clip_cov_lb < cfg.clip_cov_ub:
        found.append(error("clip_cov_lb", f"clip_cov_lb ({cfg.clip_cov_lb}) must be below clip_cov_ub "
                                          f"({cfg.clip_cov_ub}): no token could be selected"))
    if cfg.tis_upper_bound < cfg.tis_lower_bound:
        found.append(error("tis_upper_bound", f"tis_upper_bound ({cfg.tis_upper_bound}) is below tis_lower_bound "
                                              f"({cfg.tis_lower_bound})"))
    return found


@check("warn", keys=LOSS_KEYS + ("dual_clip_loss",),
       doc="a loss's own key written while another policy_loss runs, or dual_clip_loss with a loss that has no "
           "clip to cap (it has no effect)", name="policy_loss.unread", rollout_only=True)
def _unread(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if yaml_keys is None:
        return []
    spec = LOSS_SPECS[canonical_loss(cfg.policy_loss)]
    found: List[Finding] = []
    unread = [key for key in LOSS_KEYS if key in yaml_keys and key not in spec.keys]
    roll_topr = [f"actor_train.{k}" for k in ("topr_positive_weight", "topr_negative_weight")
                 if f"actor_train.{k}" in yaml_keys and spec.name != "topr"]
    if unread or roll_topr:
        owners = {key: name for name, s in LOSS_SPECS.items() for key in s.keys}
        found.append(warning((unread + roll_topr)[0], f"{', '.join(unread + roll_topr)} "
                                                      f"{'has' if len(unread + roll_topr) == 1 else 'have'} no effect: "
                                                      f"read by policy_loss "
                                                      f"{', '.join(sorted({owners.get(k.rpartition('.')[2], 'topr') for k in unread + roll_topr}))}"
                                                      f", while policy_loss {spec.name} runs", "remove them"))
    if cfg.dual_clip_loss and not spec.reads_dual_clip:
        found.append(notice("dual_clip_loss", f"dual_clip_loss has no effect with policy_loss {spec.name} (it caps the "
                                              f"clipped surrogate's loss for negative advantages; ROLL reads it in "
                                              f"pg_variant ppo only)"))
    return found


