"""Checks of on-policy distillation (`use_opd`, `opd_kl_coef`, the `teacher` block), before any worker
starts: a teacher to score with, a coefficient that is a weight, the pipeline that applies it, and a
teacher whose tokenizer is the student's (the teacher scores the student's token ids: under another
tokenizer they are other words, and its log-probs mean nothing)."""
from __future__ import annotations

import functools
import json
import os
from typing import AbstractSet, Any, Dict, List, Optional

from roll_gspo.config.findings import Finding, error, notice, warning
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import PipelineConfig

# Encoded by both tokenizers: plain words, digits, punctuation and spaces (a mismatch shows in one of them).
PROBE = "The answer is 42. Let's check: 3 + 4 = 7!"


@check("derive", keys=("teacher.model_args.model_name_or_path",),
       doc="opsd: a teacher naming no model follows the student's (actor_train's) model, as self-distillation "
           "asks", name="opd.opsd_teacher", after=("defaults.derived",), rollout_only=True)
def opsd_teacher_model(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    for role in cfg.teacher_roles().values() if cfg.opsd else ():
        if not role.model_args.model_name_or_path:
            role.model_args.model_name_or_path = cfg.actor_train.model_args.model_name_or_path
    return []


@check("derive", keys=("student_train", "student_infer", "is_pure_opd"),
       doc="ROLL's pure-OPD role names (`student_train` / `student_infer`, read as actor_train / actor_infer) "
           "written without use_opd or is_pure_opd: is_pure_opd, as ROLL's OPD launcher sets it (said in a notice)",
       name="opd.student_roles", rollout_only=True)
def student_roles_imply_pure_opd(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    written = sorted(name for name in ("student_train", "student_infer")  # written with a value (a printed config has nulls)
                     if yaml_keys is not None and getattr(cfg, name) is not None
                     and any(k == name or k.startswith(f"{name}.") for k in yaml_keys))
    if not written or cfg.use_opd or cfg.is_pure_opd:
        return []
    cfg.is_pure_opd = True
    return [notice("is_pure_opd", f"is_pure_opd: true, as ROLL's start_onpolicy_distill_pipeline.py sets it for a "
                                  f"YAML with {' / '.join(written)} (its pure-OPD names of actor_train / actor_infer): "
                                  f"the advantages are the teacher term alone")]


@check("check", keys=("use_opd", "is_pure_opd", "opd_kl_coef", "teacher", "teacher.model_args.model_name_or_path",
                      "teachers", "<role>.opd_kl_coef", "<role>.tag_included", "opsd", "opsd_template"),
       doc="`use_opd` / `is_pure_opd` without a `teacher` block or its model, both at once (ROLL refuses it too), "
           "`opd_kl_coef` < 0, outside `pipeline: rlvr`; `opsd` without either or with a template lacking "
           "`{demonstration}`; a `teacher` block without either (warned: it does not start); ROLL's named "
           "teachers beside a single block, a teacher's opd_kl_coef < 0, a tag_included naming no reward domain "
           "or tag, either key on a role that is no teacher; a reward domain no named teacher scores (warned)",
       name="opd.problems", rollout_only=True)
def opd_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    problems: List[Finding] = []
    if cfg.opsd:
        problems.extend(opsd_problems(cfg))
    problems.extend(teacher_key_problems(cfg))
    if not (cfg.use_opd or cfg.is_pure_opd):
        if cfg.teacher_roles():
            problems.append(warning("teacher", "teacher: the block is given but use_opd and is_pure_opd are false, "
                                               "so no teacher starts and nothing is distilled",
                                    "set use_opd: true (beside the task reward) or is_pure_opd: true, or remove "
                                    "the block"))
        return problems
    key = "use_opd" if cfg.use_opd else "is_pure_opd"
    if cfg.use_opd and cfg.is_pure_opd:
        problems.append(error("is_pure_opd", "is_pure_opd and use_opd are both true: they are exclusive (as in ROLL): "
                                             "is_pure_opd trains on the teacher term alone, use_opd adds it to the "
                                             "task reward's advantages", "keep one of them"))
    if cfg.pipeline != "rlvr":
        problems.append(error(key, f"{key}: on-policy distillation runs in `pipeline: rlvr` only (this is "
                                   f"`pipeline: {cfg.pipeline}`: its per-token term is added to the prompt "
                                   f"groups' advantages; the agentic sources' trajectory and turn "
                                   f"advantages do not take it yet)",
                              f"use pipeline: rlvr, or set {key}: false"))
    if not cfg.teacher_roles():
        problems.append(error(key, f"{key}: true needs a `teacher` block (the frozen model that scores the "
                                   f"student's tokens; the keys of `reference`)",
                              "add teacher: {model_args: {model_name_or_path: ...}, strategy_args: "
                              "{strategy_name: hf_infer}}"))
    for name, role in cfg.teacher_roles().items():
        if not role.model_args.model_name_or_path:
            problems.append(error(f"{name}.model_args.model_name_or_path",
                                  f"{name}.model_args.model_name_or_path: the teacher names no model (it does not "
                                  f"follow `pretrain`: a teacher equal to the student teaches nothing, unless opsd "
                                  f"gives it privileged context)",
                                  "name the teacher's model folder or built-in name, or set opsd: true"))
    problems.extend(uncovered_domain_warnings(cfg))
    if cfg.opd_kl_coef < 0:
        problems.append(error("opd_kl_coef", f"opd_kl_coef = {cfg.opd_kl_coef}: must be >= 0 (a negative weight "
                                             f"rewards moving away from the teacher)"))
    return problems


def teacher_key_problems(cfg: PipelineConfig) -> List[Finding]:
    """ROLL's per-teacher keys: named teachers beside a single block (ROLL refuses both too), a
    weight below 0, a tag that routes nothing, and either key on a role that is no teacher."""
    problems: List[Finding] = []
    if cfg.teacher is not None and cfg.teachers:
        problems.append(error("teachers", f"teacher: one block and named teachers ({', '.join(cfg.teachers)}) are "
                                          f"both given (as ROLL refuses)", "keep one form"))
    known = set(cfg.rewards) | {tag for reward in cfg.rewards.values() for tag in reward.tag_included}
    for name, role in cfg.teacher_roles().items():
        if role.opd_kl_coef is not None and role.opd_kl_coef < 0:
            problems.append(error(f"{name}.opd_kl_coef", f"{name}.opd_kl_coef = {role.opd_kl_coef}: must be >= 0 "
                                                         f"(a negative weight rewards moving away from the teacher)"))
        unknown = [tag for tag in role.tag_included if tag not in known]
        if unknown:
            problems.append(error(f"{name}.tag_included", f"{name}.tag_included: {unknown} name no reward domain or "
                                                          f"tag, so the teacher would score none of those rows "
                                                          f"(domains and tags: {sorted(known)})"))
    for name in ("actor_train", "actor_infer", "reference", "critic"):
        role = getattr(cfg, name)
        for key, value, default in (("opd_kl_coef", getattr(role, "opd_kl_coef", None), None),
                                    ("tag_included", getattr(role, "tag_included", []), [])):
            if role is not None and value != default:
                problems.append(error(f"{name}.{key}", f"{name}.{key}: read on teacher blocks only (a teacher's "
                                                       f"weight and rows); nothing reads it on {name}"))
    return problems


def uncovered_domain_warnings(cfg: PipelineConfig) -> List[Finding]:
    """Named teachers that all route by tag and leave a reward domain unscored: its rows get no
    teacher term (under is_pure_opd no advantage at all), as in ROLL, which says nothing."""
    roles = cfg.teacher_roles()
    if not roles or any(not role.tag_included for role in roles.values()):
        return []
    from roll_gspo.algorithms.distillation import routed_rows

    domains = sorted(cfg.rewards)
    tags = {domain: set(reward.tag_included) for domain, reward in cfg.rewards.items()}
    covered = [False] * len(domains)
    for role in roles.values():
        covered = [a or bool(b) for a, b in zip(covered, routed_rows(role.tag_included, domains, tags).tolist())]
    missing = [d for d, c in zip(domains, covered) if not c]
    if not missing:
        return []
    what = "no advantage (is_pure_opd)" if cfg.is_pure_opd else "the task advantage alone"
    return [warning("teachers", f"reward domain(s) {missing}: no teacher's tag_included routes their rows, so they get "
                                f"{what}", "add their domain or tags to a teacher's tag_included, or a teacher with "
                                           "none (it scores every row)")]


def opsd_problems(cfg: PipelineConfig) -> List[Finding]:
    """Self-distillation's own keys: it needs a distillation mode to act in, and a template that
    places the demonstration and formats (the teacher's prompt is built from it every step)."""
    problems: List[Finding] = []
    if not (cfg.use_opd or cfg.is_pure_opd):
        problems.append(error("opsd", "opsd: self-distillation is a way to form the teacher's prompt; it needs "
                                      "use_opd: true (beside the task reward) or is_pure_opd: true, and a `teacher` "
                                      "block (its model follows the student's)",
                              "set use_opd: true or is_pure_opd: true, with teacher: {strategy_args: "
                              "{strategy_name: hf_infer}}"))
    from roll_gspo.algorithms.distillation import opsd_hint

    try:
        opsd_hint(cfg.opsd_template, "42")
    except ValueError as exc:
        problems.append(error("opsd_template", f"opsd_template = {cfg.opsd_template!r}: {exc}",
                              "e.g. opsd_template: 'Reference answer: {demonstration}\\n'"))
    return problems


@check("check", keys=("teacher.model_args.model_name_or_path", "teachers", "actor_train.model_args.model_name_or_path"),
       doc="a teacher whose tokenizer is not the student's (vocabulary size, special token ids, the ids of a "
           "probe text; only the tokenizers are loaded)", name="opd.tokenizer", requires=("opd.problems",),
       rollout_only=True)
def opd_tokenizer(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if not cfg.uses_teacher():
        return []
    student = cfg.actor_train.model_args.model_name_or_path
    problems = []
    for name, role in cfg.teacher_roles().items():
        teacher = role.model_args.model_name_or_path
        if not student or not teacher or student == teacher:
            continue
        mismatch = tokenizer_mismatch(student, teacher)
        if mismatch is not None:
            problems.append(error(f"{name}.model_args.model_name_or_path",
                                  f"{name}.model_args.model_name_or_path: the teacher {teacher!r} and the student "
                                  f"{student!r} (actor_train.model_args.model_name_or_path) do not share a tokenizer "
                                  f"({mismatch}); the teacher scores the student's token ids, which under its own "
                                  f"tokenizer are other text",
                                  "pick a teacher of the student's model family (the same tokenizer files)"))
    return problems


def tokenizer_mismatch(student: str, teacher: str) -> Optional[str]:
    """How the two models' tokenizers differ, or None where they agree (or either cannot be read: the
    preflight reports a missing model). Compares what both sides tell: the vocabulary size, the eos /
    pad / bos ids and the ids of `PROBE`."""
    a, b = tokenizer_signature(student), tokenizer_signature(teacher)
    if a is None or b is None:
        return None
    for key in ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id", "probe_ids"):
        if key in a and key in b and a[key] != b[key]:
            shown = (lambda v: v) if key != "probe_ids" else (lambda v: list(v)[:8])
            return f"{key}: student {shown(a[key])} vs teacher {shown(b[key])}"
    return None


def tokenizer_signature(name_or_path: str) -> Optional[Dict[str, Any]]:
    """What identifies a model's tokenizer, loading only the tokenizer: from its folder (a path, a
    cached built-in), the char tokenizer for a built-in registered with its vocabulary, else the
    built-in's registered config (vocabulary size, special ids). None when nothing can be read."""
    from roll_gspo.builtin.cache import BUILTIN_PREFIX
    from roll_gspo.builtin.models import BUILTIN_MODELS, builtin_model_folder

    name = name_or_path.strip()
    if name.startswith(BUILTIN_PREFIX):
        folder = builtin_model_folder(name)
        if os.path.isfile(os.path.join(folder, "config.json")):
            return _folder_signature(folder)
        entry = BUILTIN_MODELS.get(name)
        config = dict(entry.config) if entry is not None and entry.config else None
        if config is None:
            return None
        char = _char_signature(json.dumps(config, sort_keys=True))
        if config.get("vocab_size") == char["vocab_size"] and config.get("eos_token_id") == char["eos_token_id"]:
            return char  # a built-in on the char tokenizer, not built yet
        return {key: config.get(key) for key in ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")
                if key in config}
    path = os.path.abspath(os.path.expanduser(name))
    return _folder_signature(path) if os.path.isdir(path) else None


@functools.lru_cache(maxsize=1)
def _char_signature(config_json: str) -> Dict[str, Any]:
    """The char tokenizer's signature as the workers see it: saved to a folder beside the built-in's
    registered config.json and loaded back, as a built model's folder is read (the config's model type
    picks the tokenizer class AutoTokenizer loads)."""
    import tempfile

    from roll_gspo.builtin.tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        build_tokenizer().save_pretrained(folder)
        with open(os.path.join(folder, "config.json"), "w") as handle:
            handle.write(config_json)
        signature = _folder_signature(folder)
    if signature is None:
        raise RuntimeError("the built-in char tokenizer cannot be loaded back from a folder")
    return signature


def _folder_signature(folder: str) -> Optional[Dict[str, Any]]:
    try:
        from transformers import AutoTokenizer

        return _tokenizer_signature(AutoTokenizer.from_pretrained(folder))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer: preflight reports the model folder
        return None


def _tokenizer_signature(tokenizer) -> Dict[str, Any]:
    return {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "probe_ids": tuple(tokenizer.encode(PROBE, add_special_tokens=False))}


@check("warn", keys=("use_opd", "is_pure_opd", "importance_sampling"),
       doc="`use_opd` / `is_pure_opd` under GSPO's sequence ratio (`importance_sampling: seq`), whose gradient gives every token "
           "its response's mean advantage, so the per-token teacher signal is averaged away", name="opd.seq_ratio",
       rollout_only=True)
def opd_seq_ratio(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if not cfg.uses_teacher() or cfg.importance_sampling != "seq":
        return []
    mode = "use_opd" if cfg.use_opd else "is_pure_opd"
    return [warning("importance_sampling", f"{mode} with importance_sampling: seq: the sequence ratio's gradient "
                                           "gives every token its response's mean advantage, so OPD's per-token "
                                           "reverse KL acts per response (the teacher's token-level credit is "
                                           "averaged away)", "importance_sampling: gspo-token (GSPO's ratio, "
                                                             "per-token gradient) or token keeps it")]
