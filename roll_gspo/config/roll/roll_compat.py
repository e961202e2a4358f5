"""ROLL's configuration surface on this project's one schema.

A ROLL RLVR YAML runs here with at most its strategy names changed. Every ROLL key is a field of
``roll_gspo/schema/config.py`` (with help text); this module holds what makes those fields act or be refused:

* ``resolve_aliases``: ROLL names declared beside their field (``_alias`` in schema.py), e.g.
  ``max_ckpt_to_keep`` -> ``save_total_limit``; writing both with different values is an error.
* ``apply_roll_semantics``: keys that map onto several of ours (``pg_clip`` /
  ``use_pg_clip_range``, ``norm_mean_type`` / ``norm_std_type``, ``global_template``).
* ``refused_value_problems``: keys accepted only at ROLL's "off" value (``_refused_unless``),
  refused with the reason otherwise.
* ``UNBUILT_STRATEGIES`` and ``choice_refusal``: what to use instead of a backend not built here.
* ``ROLL_REWARD_WORKERS``: ROLL's reward worker class paths -> this project's workers (one table;
  add a line when a worker lands).
* ``hydra_block_problems``: which ``hydra:`` keys a YAML may hold (run_pipeline.py composes with
  Hydra but does not run under ``@hydra.main``).
* the steps `roll_compat.*`, checks on the built config, are `roll_gspo.config.checks.roll`'s.

The table of every ROLL key for the docs is in ``roll_keys.py``.

Where ROLL itself is wrong (silently dropped keys, ``eval`` of device_mapping, timestamped
checkpoint folders) is written up in docs/roll_compat.md.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, List, Optional

from roll_gspo.catalog.reward_workers import REWARD_WORKERS
from roll_gspo.config.findings import Finding, error
from roll_gspo.schema.config import RoleConfig, is_block_type

# Top-level blocks of configs/deepspeed_zero*.yaml (ROLL's DeepSpeed presets), composed in by a
# `defaults:` list: interpolation anchors (`${deepspeed_zero3}`), removed after resolution.
DEEPSPEED_ANCHORS = ("deepspeed_zero", "deepspeed_zero2", "deepspeed_zero2_cpuoffload", "deepspeed_zero3",
                     "deepspeed_zero3_cpuoffload")

# --------------------------------------------------------------------------------------------
# Strategies not built here: name -> (what to use instead, what else to change)
# --------------------------------------------------------------------------------------------
UNBUILT_STRATEGIES: Dict[str, tuple] = {
    "megatron_train": ("deepspeed_train", "Megatron's strategy_config keys then act in DeepSpeed's form where "
                       "they can: parallel sizes of 1, use_distributed_optimizer (ZeRO-1), recompute_granularity: "
                       "full (gradient checkpointing); others are refused naming the DeepSpeed setting to use"),
    "megatron_infer": ("deepspeed_infer", "its Megatron parallel sizes of 1 are accepted; others are refused"),
    "sglang": ("vllm", "keep sampling keys in generating_args; strategy_config takes "
               "vllm.EngineArgs keywords (e.g. gpu_memory_utilization, max_model_len) instead of "
               "SGLang's"),
    "diffusion_deepspeed_train": (None, "diffusion models are not built here"),
}

# --------------------------------------------------------------------------------------------
# ROLL reward worker class paths -> this project's workers (None: not available here yet).
# Extend by adding a line.
# --------------------------------------------------------------------------------------------
_ROLL_REWARDS = "roll.pipeline.rlvr.rewards."
ROLL_REWARD_WORKERS: Dict[str, Optional[str]] = {
    _ROLL_REWARDS + "math_rule_reward_worker.MathRuleRewardWorker":
        "roll_gspo.workers.rewards.MathRuleRewardWorker",
    _ROLL_REWARDS + "code_sandbox_reward_worker.CodeSandboxRewardWorker":
        "roll_gspo.workers.rewards.CodeSandboxRewardWorker",
    _ROLL_REWARDS + "llm_judge_reward_worker.LLMJudgeRewardWorker":
        "roll_gspo.workers.rewards.LLMJudgeRewardWorker",
    _ROLL_REWARDS + "crossthinkqa_rule_reward_worker.CrossThinkQARuleRewardWorker":
        "roll_gspo.workers.rewards.MultipleChoiceRewardWorker",
    _ROLL_REWARDS + "ifeval_rule_reward_worker.GeneralRuleRewardWorker":
        "roll_gspo.workers.rewards.IFEvalRewardWorker",
    _ROLL_REWARDS + "general_val_rule_reward_worker.GeneralValRuleRewardWorker": None,
    _ROLL_REWARDS + "multiple_choice_boxed_rule_reward_worker.MultipleChoiceBoxedRuleRewardWorker":
        "roll_gspo.workers.rewards.MultipleChoiceRewardWorker",
    _ROLL_REWARDS + "detection_reward_worker.DetectionRewardWorker": None,
}
# --------------------------------------------------------------------------------------------
# ROLL's actor_train.worker_cls: its policy-gradient workers (pg_variant acts as policy_loss here,
# accepted with one notice) and its default actor workers (what runs here anyway, accepted).
# --------------------------------------------------------------------------------------------
ROLL_PG_WORKERS = ("roll.pipeline.rlvr.actor_pg_worker.ActorPGWorker",
                   "roll.pipeline.agentic.agentic_actor_pg_worker.ActorWorker")
ROLL_DEFAULT_ACTOR_WORKERS = ("roll.pipeline.rlvr.actor_worker.ActorWorker",
                              "roll.pipeline.agentic.agentic_actor_worker.ActorWorker",
                              "roll.pipeline.base_worker.ActorWorker")

# The built-in workers a refusal offers by name (roll_gspo.catalog.reward_workers declares them).
PROJECT_REWARD_WORKERS = tuple(kind.path for kind in REWARD_WORKERS.values() if kind.listed)


def available_reward_workers() -> List[str]:
    """Every worker class path a `rewards.<domain>.worker_cls` may name here."""
    mapped = [roll for roll, ours in ROLL_REWARD_WORKERS.items() if ours]
    return sorted(set(PROJECT_REWARD_WORKERS) | {o for o in ROLL_REWARD_WORKERS.values() if o}) + mapped


def map_reward_worker(worker_cls: str) -> str:
    """This project's class path for a ROLL path that has one; anything else unchanged."""
    return ROLL_REWARD_WORKERS.get(worker_cls) or worker_cls


def reward_worker_problem(domain: str, worker_cls: str) -> Optional[str]:
    """A problem line for a ROLL reward class with no counterpart here (None otherwise)."""
    if not worker_cls.startswith("roll."):
        return None
    known = "known to ROLL, not built here yet" if worker_cls in ROLL_REWARD_WORKERS else "unknown"
    return (f"rewards.{domain}.worker_cls: {worker_cls!r} ({known}); available reward workers: "
            f"{', '.join(available_reward_workers())} (or a class of your own: `pkg.module.Class`, "
            f"a subclass of roll_gspo.workers.rewards.RewardWorker)")


# --------------------------------------------------------------------------------------------
# Values refused with a reason (instead of "invalid value; valid values: ...")
# --------------------------------------------------------------------------------------------
_REFUSED_TEMPLATES = {
    "base": "it wraps prompts in a fixed instruction text of ROLL's",
    "longCOT_qwen2.5": "it adds a fixed long-CoT system text of ROLL's",
}


def choice_refusal(path: str, value: Any) -> Optional[str]:
    """A specific message for a value outside a key's choices that ROLL accepts, or None."""
    leaf = path.rpartition(".")[2]
    if leaf == "strategy_name" and value in UNBUILT_STRATEGIES:
        instead, change = UNBUILT_STRATEGIES[value]
        use = f"use `strategy_name: {instead}`" if instead else "there is no counterpart"
        return f"{path}: strategy {value!r} is not built here; {use} and {change}"
    if leaf == "policy_loss" and value == "vanilla":
        return (f"{path}: {value!r} is ambiguous: verl's loss_mode vanilla is the clipped PPO surrogate (write "
                f"`policy_loss: ppo`), ROLL's pg_variant vanilla is the plain policy gradient -A * logp (write "
                f"`policy_loss: reinforce`, or ROLL's `actor_train.pg_variant: vanilla`)")
    if leaf in ("template", "global_template") and value in _REFUSED_TEMPLATES:
        return (f"{path}: template {value!r} is not built here ({_REFUSED_TEMPLATES[value]}); put "
                f"that text in the data (a system turn) and use `native`, `qwen2_5` or `chatml`")
    return None


# --------------------------------------------------------------------------------------------
# Normalising ROLL spellings before the strict walk
# --------------------------------------------------------------------------------------------
def is_named_teachers(block: Any) -> bool:
    """ROLL's multi-teacher `teacher:` (named role blocks) rather than one role block: a non-empty
    mapping of mappings none of whose names is a role key."""
    return (isinstance(block, dict) and bool(block) and all(isinstance(v, dict) for v in block.values())
            and not set(block) & {f.name for f in dataclasses.fields(RoleConfig)})


def normalise_roll_values(raw: Dict[str, Any]) -> None:
    """In place, on a raw or resolved config dict: ROLL spellings that mean one of our values.

    `strategy_config: null` -> {}; `interleave_probs: "1.0"` (concatenate, what ROLL does) ->
    null; `attn_implementation: fa2` -> flash_attention_2; ROLL reward class paths that have a
    worker here -> its path.
    """
    if not isinstance(raw, dict):
        return
    if is_named_teachers(raw.get("teacher")):  # ROLL's multi-teacher dict: our `teachers`
        raw["teachers"] = raw.pop("teacher")
    blocks = [raw.get(r) for r in ("actor_train", "actor_infer", "reference", "critic", "validation",
                                   "student_train", "student_infer", "teacher")]  # ROLL's OPD roles too
    blocks += list((raw.get("teachers") or {}).values()) if isinstance(raw.get("teachers"), dict) else []
    rewards = raw.get("rewards")
    if isinstance(rewards, dict):
        blocks += list(rewards.values())
        for reward in rewards.values():
            if isinstance(reward, dict) and isinstance(reward.get("worker_cls"), str):
                reward["worker_cls"] = map_reward_worker(reward["worker_cls"])
    for block in blocks:
        if not isinstance(block, dict):
            continue
        strategy = block.get("strategy_args")
        if isinstance(strategy, dict) and "strategy_config" in strategy and strategy["strategy_config"] is None:
            strategy["strategy_config"] = {}
        data = block.get("data_args")
        if isinstance(data, dict) and str(data.get("interleave_probs", "")).strip() in ("1", "1.0"):
            data["interleave_probs"] = None
        model = block.get("model_args")
        if isinstance(model, dict) and model.get("attn_implementation") == "fa2":
            model["attn_implementation"] = "flash_attention_2"


# --------------------------------------------------------------------------------------------
# Aliases, refusals and multi-key semantics on the checked (resolved, typed) dict
# --------------------------------------------------------------------------------------------
def _fields(cls: type) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _nested(cls: type) -> Dict[str, Any]:
    """Field name -> dataclass type (or ('dict', type) for `rewards`) of nested blocks."""
    hints = typing.get_type_hints(cls)
    out: Dict[str, Any] = {}
    for name in _fields(cls):
        tp = hints[name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = args[0] if typing.get_origin(tp) in (typing.Union,) and args else tp
        if is_block_type(inner):
            out[name] = inner
        elif typing.get_origin(inner) is dict and is_block_type(typing.get_args(inner)[1]):
            out[name] = ("dict", typing.get_args(inner)[1])
    return out


def _walk_blocks(cls: type, checked: Dict[str, Any], written: Dict[str, Any], path: str, visit) -> None:
    """Call visit(cls, checked_block, written_block, path) on every block of the config."""
    visit(cls, checked, written, path)
    for name, sub in _nested(cls).items():
        sub_checked = checked.get(name)
        sub_written = written.get(name) if isinstance(written, dict) else None
        sub_written = sub_written if isinstance(sub_written, dict) else {}
        child = f"{path}.{name}" if path else name
        if isinstance(sub, tuple):
            for key, value in (sub_checked or {}).items():
                if isinstance(value, dict):
                    _walk_blocks(sub[1], value, sub_written.get(key) or {}, f"{child}.{key}", visit)
        elif isinstance(sub_checked, dict):
            _walk_blocks(sub, sub_checked, sub_written, child, visit)


def resolve_aliases(cls: type, checked: Dict[str, Any], written: Dict[str, Any], problems: List[Finding]) -> None:
    """Copy every written ROLL alias onto its field; report aliases that contradict the field."""
    def visit(block_cls, block, block_written, path):
        for name, f in _fields(block_cls).items():
            target = f.metadata.get("alias_of")
            if not target or name not in block_written or block.get(name) is None:
                continue
            value = block[name]
            if f.metadata.get("alias_invert"):
                value = not value
            where = lambda k: f"{path}.{k}" if path else k  # noqa: E731
            if target in block_written and block.get(target) != value:
                problems.append(error(where(name),
                                      f"{where(name)} = {block[name]!r} (ROLL's name for "
                                      f"{where(target)}{', negated' if f.metadata.get('alias_invert') else ''}) "
                                      f"contradicts {where(target)} = {block.get(target)!r}; keep one of them"))
                continue
            block[target] = value
    _walk_blocks(cls, checked, written, "", visit)


def refused_value_problems(cls: type, checked: Dict[str, Any], written: Dict[str, Any],
                           problems: List[Finding], path: str = "") -> None:
    """Keys accepted only at ROLL's off value: refused with their reason otherwise. `path`: where
    the block `cls` sits (a strategy_config checked against its own schema)."""
    def visit(block_cls, block, block_written, path):
        for name, f in _fields(block_cls).items():
            if "refused_unless" not in f.metadata or name not in block_written:
                continue
            allowed = f.metadata["refused_unless"]
            value = block.get(name)
            if value == allowed or (allowed in (None, {}, 0) and value in (None, {}, 0, False)):
                continue
            where = f"{path}.{name}" if path else name
            problems.append(error(where, f"{where} = {value!r} is refused: {f.metadata['refusal']} (accepted value: "
                                         f"{allowed!r}, or remove the key)"))
    _walk_blocks(cls, checked, written, path, visit)


def _norm_mapping(mean: Optional[str], std: Optional[str]) -> Dict[str, Any]:
    """ROLL's (norm_mean_type, norm_std_type) as our (reward_norm, reward_shift, reward_scale)."""
    if mean is None and std is None:
        return {"reward_norm": None, "reward_shift": False, "reward_scale": False}
    if mean is not None and std is not None:
        return {"reward_norm": mean, "reward_shift": False, "reward_scale": False}
    if mean is not None:
        return {"reward_norm": mean, "reward_shift": True, "reward_scale": False}
    return {"reward_norm": std, "reward_shift": False, "reward_scale": True}


def apply_roll_semantics(checked: Dict[str, Any], written: Dict[str, Any], problems: List[Finding]) -> None:
    """ROLL keys that act through several of ours."""
    # pg_clip / use_pg_clip_range
    if checked.get("pg_clip") is not None and not checked.get("use_pg_clip_range"):
        clash: List[str] = [k for k in ("pg_clip_low", "pg_clip_high")
                 if k in written and checked[k] != checked["pg_clip"]]
        if clash:
            problems.append(error("pg_clip", f"pg_clip = {checked['pg_clip']} sets both clip bounds (use_pg_clip_range "
                                             f"is not true) but {', '.join(clash)} also written with another value; "
                                             f"write pg_clip alone, or use_pg_clip_range: true with pg_clip_low / "
                                             f"pg_clip_high"))
        else:
            checked["pg_clip_low"] = checked["pg_clip_high"] = checked["pg_clip"]
    if checked.get("use_pg_clip_range") is True and "pg_clip" in written and checked.get("pg_clip") is not None:
        problems.append(error("pg_clip", "use_pg_clip_range: true reads pg_clip_low / pg_clip_high, so pg_clip would "
                                         "be ignored; remove pg_clip"))
    # norm_mean_type / norm_std_type
    if "norm_mean_type" in written or "norm_std_type" in written:
        mean, std = checked.get("norm_mean_type"), checked.get("norm_std_type")
        if mean is not None and std is not None and mean != std:
            problems.append(error("norm_mean_type", f"norm_mean_type = {mean!r} with norm_std_type = {std!r}: "
                                                    f"different statistics for mean and std are not built; use the "
                                                    f"same for both"))
        else:
            mapped = _norm_mapping(mean, std)
            clash = [f"{k} = {checked[k]!r}" for k, v in mapped.items() if k in written and checked[k] != v]
            if clash:
                problems.append(error("norm_mean_type", f"norm_mean_type = {mean!r} / norm_std_type = {std!r} mean "
                                                        f"{', '.join(f'{k}: {v!r}' for k, v in mapped.items())}, which "
                                                        f"contradicts {', '.join(clash)}; keep one family of keys"))
            else:
                checked.update(mapped)
    # ROLL's TensorBoard folder is tracker_kwargs.log_dir (its logging_dir holds text logs); here
    # it is logging_dir. ROLL appends exp_name and a timestamp; this project does not.
    tracker_kwargs = checked.get("tracker_kwargs") or {}
    if checked.get("track_with") == "tensorboard" and "log_dir" in tracker_kwargs:
        checked["logging_dir"] = tracker_kwargs.pop("log_dir")
    # ROLL writes `data_args.template` on every role; the rollout and reference roles read no
    # data, so the copy that repeats the acting (training) template says nothing and is cleared.
    # A different one stays and is refused as never read (role_reads).
    acting = checked.get("global_template") or (checked.get("actor_train", {}).get("data_args") or {}).get("template")
    # tag_to_template: one template renders every prompt here, so only a map that says the same acts
    others = {tag: t for tag, t in (checked.get("tag_to_template") or {}).items() if t != acting}
    if others:
        problems.append(error("tag_to_template", f"tag_to_template: {others} differ from the template in use "
                                                 f"({acting!r}); per-tag templates are not built (one template "
                                                 f"renders every prompt)", "give every tag that template, or put "
                                                                           "the text in the data"))
    for role in ("actor_infer", "reference", "critic"):
        data = (checked.get(role) or {}).get("data_args") or {}
        if data.get("template") is not None and data.get("template") == acting:
            data["template"] = None
    # global_template: the template of every role's data
    template = checked.get("global_template")
    if template is not None:
        for role in ("actor_train", "validation"):
            data = checked.get(role, {}).get("data_args", {})
            role_written = ((written.get(role) or {}).get("data_args") or {})
            if "template" in role_written and data.get("template") not in (None, template):
                problems.append(error("global_template", f"global_template = {template!r} contradicts "
                                                         f"{role}.data_args.template = {data.get('template')!r}; keep "
                                                         f"one"))
            else:
                data["template"] = template


def apply_verl_rollout_correction(checked: Dict[str, Any], written: Dict[str, Any], problems: List[Finding]) -> None:
    """verl's `rollout_correction` block (rollout_is / rollout_rs) written as ROLL's
    `train_infer_correction` (is_weight / filters), which is what acts. A ROLL block that says the
    same (a printed, resolved config holds both) is accepted; one that says otherwise is an error."""
    verl = checked.get("rollout_correction") or {}
    if verl.get("rollout_is") is None and verl.get("rollout_rs") is None:
        return
    target = checked.setdefault("train_infer_correction", {})
    weight: Dict[str, Any] = {"enabled": False}
    if verl.get("rollout_is") is not None:
        weight = {"enabled": True, "weight_type": verl["rollout_is"], "upper_bound": verl.get("rollout_is_threshold")}
    filters = []
    if verl.get("rollout_rs") is not None:
        high = verl.get("rollout_rs_threshold")
        if high is None:
            problems.append(error("rollout_correction.rollout_rs", f"rollout_correction.rollout_rs = "
                                                                   f"{verl['rollout_rs']!r} needs "
                                                                   f"rollout_correction.rollout_rs_threshold (the "
                                                                   f"upper bound of the kept weights, > 1)"))
            return
        low = verl.get("rollout_rs_threshold_lower")
        if low is None:  # a threshold <= 0 is refused with the filter's own check
            low = 1.0 / high if high > 0 else 0.0
        filters = [{"enabled": True, "agg_type": verl["rollout_rs"], "ratio_enabled": True,
                    "ratio_low": float(low), "ratio_high": float(high), "diff_enabled": False}]
    roll_written = written.get("train_infer_correction")
    if isinstance(roll_written, dict) and roll_written:
        current_weight = target.get("is_weight") or {}
        same_weight = all(current_weight.get(k) == v for k, v in weight.items()) if weight["enabled"] \
            else not current_weight.get("enabled")
        current_filters = [f for f in (target.get("filters") or []) if isinstance(f, dict) and f.get("enabled")]
        same_filters = len(current_filters) == len(filters) and all(
            all(have.get(k) == v for k, v in want.items()) for have, want in zip(current_filters, filters))
        if not (same_weight and same_filters):
            problems.append(error("rollout_correction", "rollout_correction (verl's names) and train_infer_correction "
                                                        "(ROLL's) are both written and say different things; they "
                                                        "configure the same correction, keep one"))
        return
    target["is_weight"] = {**(target.get("is_weight") or {}), **weight}
    target["filters"] = filters


def apply_roll_compat(cls: type, checked: Dict[str, Any], written: Dict[str, Any], problems: List[Finding]) -> None:
    """All of the above, in order, on the checked dict (in place)."""
    refused_value_problems(cls, checked, written, problems)
    resolve_aliases(cls, checked, written, problems)
    apply_roll_semantics(checked, written, problems)
    apply_verl_rollout_correction(checked, written, problems)


# --------------------------------------------------------------------------------------------
# `hydra:` blocks
# --------------------------------------------------------------------------------------------
# Hydra keys that mean here what they mean to ROLL (run_pipeline.py runs in the directory it is
# started from, writes no `.hydra/` folder and never changes directory); `searchpath` acts.
ACCEPTED_HYDRA_VALUES = {"run.dir": (".",), "output_subdir": (None,), "job.chdir": (False, None)}


def _flatten(block: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(block, dict):
        return {prefix: block}
    out = {}
    for key, value in block.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def hydra_block_problems(hydra_block: Any) -> List[Finding]:
    """Problems with the `hydra:` block of a YAML (Hydra has already checked its spelling)."""
    problems = []
    for key, value in _flatten(hydra_block or {}).items():
        if key == "searchpath" or key.startswith("searchpath."):
            continue
        if key in ACCEPTED_HYDRA_VALUES:
            if value not in ACCEPTED_HYDRA_VALUES[key]:
                problems.append(error(
                    f"hydra.{key}", f"hydra.{key} = {value!r} is refused: run_pipeline.py composes the YAML with "
                    f"Hydra but does not run under @hydra.main, so it never changes directory nor writes "
                    f"Hydra's output folder; accepted: {ACCEPTED_HYDRA_VALUES[key]} (output goes to "
                    f"output_dir)"))
            continue
        problems.append(error(f"hydra.{key}", f"hydra.{key} is refused: it configures Hydra's application runner "
                                              f"(@hydra.main), which run_pipeline.py does not use; only "
                                              f"hydra.run.dir: ., hydra.output_subdir: null, hydra.job.chdir: false "
                                              f"and hydra.searchpath are accepted"))
    return problems


# Megatron-LM / FSDP keys of ROLL's megatron_* / fsdp2_* strategy_config: DeepSpeed would ignore
# them silently, so a YAML whose strategy name was changed to deepspeed_* must drop them.
FOREIGN_STRATEGY_KEYS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "context_parallel_size", "virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size",
    "use_distributed_optimizer", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "sequence_parallel", "overlap_grad_reduce", "overlap_param_gather", "moe_token_dispatcher_type",
    "bias_activation_fusion", "apply_rope_fusion", "moe_grouped_gemm", "moe_layer_recompute",
    "fsdp_size", "param_dtype", "reduce_dtype", "reshard_after_forward", "offload_policy",
)


# Megatron keys of ROLL's recipes that have a DeepSpeed meaning here, translated when a recipe's
# megatron_* strategy is renamed to deepspeed_* (the only change ROLL v0.3's users then make).
MEGATRON_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                           "expert_model_parallel_size", "context_parallel_size")


def translate_megatron_keys(name: str, role) -> List[Finding]:
    """Megatron keys of a deepspeed_* role's strategy_config that act here, turned into their
    DeepSpeed form (in place); problems for the values that cannot act.

    * parallel sizes of 1 mean data parallelism alone, which is what DeepSpeed ranks do: dropped;
      above 1 they are refused (model parallelism is not built; ZeRO-3 shards the weights instead);
    * `use_distributed_optimizer`: Megatron's optimizer-state sharding over data-parallel ranks is
      ZeRO stage 1 (true) or stage 0 (false), unless the config gives zero_optimization itself;
    * `recompute_granularity: full` is gradient checkpointing of every layer (model_args);
      `selective` (attention only) has no transformers equivalent and is refused.
    """
    config = role.strategy_args.strategy_config
    if not role.strategy_args.strategy_name.startswith("deepspeed") or not config:
        return []
    key = f"{name}.strategy_args.strategy_config"
    problems = []
    for size in MEGATRON_PARALLEL_SIZES:
        if size in config:
            if config[size] in (1, None):
                config.pop(size)
            else:
                problems.append(error(f"{key}.{size}", f"{key}.{size} = {config[size]}: Megatron model parallelism is "
                                                       f"not built; DeepSpeed ranks are data-parallel (ZeRO-3 shards "
                                                       f"the weights across them). Set it to 1"))
    if "use_distributed_optimizer" in config:
        sharded = bool(config.pop("use_distributed_optimizer"))
        if "zero_optimization" not in config:
            config["zero_optimization"] = {"stage": 1 if sharded else 0}
    if "recompute_granularity" in config:
        granularity = config.pop("recompute_granularity")
        if granularity == "full":
            if name != "reference":  # the frozen reference has no backward pass to recompute
                role.model_args.gradient_checkpointing = True
        elif granularity is not None:
            problems.append(error(f"{key}.recompute_granularity", f"{key}.recompute_granularity = {granularity!r}: "
                                                                  f"only `full` (every layer, gradient checkpointing) "
                                                                  f"is built here; use full or drop it"))
    return problems


def foreign_strategy_key_problems(name: str, role) -> List[Finding]:
    """translate_megatron_keys (in place), then the Megatron/FSDP keys DeepSpeed would ignore."""
    if not role.strategy_args.strategy_name.startswith("deepspeed"):
        return []
    problems = translate_megatron_keys(name, role)
    if problems:
        return problems
    foreign = [k for k in (role.strategy_args.strategy_config or {}) if k in FOREIGN_STRATEGY_KEYS]
    if not foreign:
        return []
    key = f"{name}.strategy_args.strategy_config"
    return [error(key, f"{key}: {foreign} are Megatron/FSDP options, which DeepSpeed would silently ignore; drop "
                       f"them and give a DeepSpeed config (e.g. `${{deepspeed_zero3}}` from "
                       f"configs/deepspeed_zero3.yaml; parallel sizes come from world_size / device_mapping)")]


def under_dataset_dir(name: str, dataset_dir: Optional[str]) -> str:
    """`name` under `dataset_dir` when a file is there (relative names only), else as written."""
    import os

    if dataset_dir and not name.startswith("builtin:") and not os.path.isabs(name):
        candidate = os.path.join(dataset_dir, name)
        if os.path.exists(candidate):
            return candidate
    return name


