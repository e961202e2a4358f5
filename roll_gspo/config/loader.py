"""Load a pipeline YAML strictly: Hydra composition and override grammar, OmegaConf
interpolation, then a typed walk over ``schema.PipelineConfig`` that reports every unknown key
(with a "did you mean"), wrong type and invalid choice at once, before anything starts.

Semantic checks (batch arithmetic, contradictions, GSPO traps) live in ``validate.py``.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import tempfile
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from roll_gspo.config import roll_compat
from roll_gspo.config.errors import ConfigError
from roll_gspo.config.schema import PipelineConfig, RewardConfig

# Where `--config NAME` is looked up when NAME is not a path (repository root relative).
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_SEARCH_DIRS = (REPO_ROOT / "examples", REPO_ROOT / "configs")
# Top-level keys that are not pipeline keys: Hydra's own, and `_name` anchors for interpolation.
PASSTHROUGH_TOP_LEVEL = ("hydra", "defaults")


# --------------------------------------------------------------------------------------------
# Finding and composing the file
# --------------------------------------------------------------------------------------------
def resolve_config_path(config: str) -> Path:
    """A path as given, else a name (with or without `.yaml`) in examples/ or configs/."""
    candidate = Path(config).expanduser()
    if candidate.is_file():
        return candidate.resolve()
    names = [config] if config.endswith((".yaml", ".yml")) else [config + ".yaml", config + ".yml"]
    for folder in CONFIG_SEARCH_DIRS:
        for name in names:
            if (folder / name).is_file():
                return (folder / name).resolve()
    known = sorted(p.name for d in CONFIG_SEARCH_DIRS if d.is_dir() for p in d.glob("*.yaml"))
    hint = difflib.get_close_matches(Path(config).name, known, n=1)
    raise FileNotFoundError(
        f"config {config!r} not found as a path nor in {', '.join(str(d) for d in CONFIG_SEARCH_DIRS)}"
        + (f"; did you mean {hint[0]!r}?" if hint else f"; available: {', '.join(known)}"))


def _roll_config_search_root() -> Path:
    """A search-path root whose sibling `config` is this project's configs/ folder, so that ROLL's
    `defaults: [../config/deepspeed_zero3@_here_]` finds configs/deepspeed_zero3.yaml when the
    YAML has no `../config/` of its own (Hydra looks `../config/NAME` up relative to each root)."""
    configs = (REPO_ROOT / "configs").resolve()
    tag = hashlib.sha1(str(configs).encode()).hexdigest()[:12]
    base = Path(tempfile.gettempdir()) / f"roll_gspo_hydra_{tag}"
    (base / "root").mkdir(parents=True, exist_ok=True)
    link = base / "config"
    if not link.is_symlink():
        try:
            link.symlink_to(configs, target_is_directory=True)
        except FileExistsError:
            pass  # another process made it at the same moment
    return base / "root"


def _search_path_override(path: Path) -> str:
    """`hydra.searchpath=[...]`: the YAML's own entries, then configs/ (plain names such as
    `deepspeed_zero3@_here_`) and the root that maps ROLL's `../config/` onto configs/."""
    own = []
    try:
        own = list((OmegaConf.load(path).get("hydra") or {}).get("searchpath") or [])
    except Exception:  # unreadable: Hydra reports it with the file name
        pass
    ours = [f"file://{(REPO_ROOT / 'configs').resolve()}", f"file://{_roll_config_search_root()}"]
    return "hydra.searchpath=[" + ",".join(str(p) for p in own + ours) + "]"


def hydra_block_problems(path: Path) -> List[str]:
    """Problems with the YAML's own `hydra:` block (see roll_compat.hydra_block_problems)."""
    try:
        block = OmegaConf.to_container(OmegaConf.load(path)).get("hydra")
    except Exception:
        return []
    return [f"{path.name}: {p}" for p in roll_compat.hydra_block_problems(block)]


def compose_yaml(path: Path) -> DictConfig:
    """Compose one YAML with Hydra (so `defaults:` lists work) and return it unlocked.

    `defaults:` entries are looked up next to the YAML first, then in configs/ (ROLL's
    `../config/NAME` included)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if path.suffix != ".yaml":  # Hydra composes only `.yaml` files; a `.yml` is read as is
        cfg = OmegaConf.load(path)
        if not isinstance(cfg, DictConfig):
            raise ValueError(f"the top level is a {type(cfg).__name__}, not a mapping of keys")
        if "defaults" in cfg:
            raise ValueError("a `defaults:` list needs the file to be named `*.yaml`")
        return cfg
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(path.parent), version_base=None), warnings.catch_warnings():
        # A `defaults:` list without `_self_` composes the file's own keys last (they win), which
        # is what users expect; Hydra's upgrade notice about it is noise here.
        warnings.filterwarnings("ignore", message=".*Defaults list is missing `_self_`")
        cfg = compose(config_name=path.stem, overrides=[_search_path_override(path)])
    OmegaConf.set_struct(cfg, False)
    for key in PASSTHROUGH_TOP_LEVEL:
        cfg.pop(key, None)
    return cfg


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Apply Hydra-grammar overrides (`a.b=1`, `+a.c=2`, `++a.d=3`, `~a.e`) in place.

    Keys missing from the YAML but present in the schema may be set without `+`; a key known to
    neither is reported by the strict walk with a suggestion.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as exc:
        raise ConfigError([f"command-line override: {exc}".replace("\n", " ")]) from None
    for override in parsed:
        key = override.key_or_group
        if override.is_sweep_override():
            raise ConfigError([f"override {override.input_line!r}: sweeps are not supported here"])
        if override.is_delete():
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
            if not isinstance(parent, DictConfig) or leaf not in parent:
                raise ConfigError([f"override {override.input_line!r}: there is no key {key!r} to delete"])
            parent.pop(leaf)
            continue
        if override.is_add() and OmegaConf.select(cfg, key) is not None:
            raise ConfigError([f"override {override.input_line!r}: {key!r} already exists; "
                               f"drop the '+' to change it"])
        OmegaConf.update(cfg, key, override.value(), merge=False, force_add=True)


# --------------------------------------------------------------------------------------------
# The strict typed walk
# --------------------------------------------------------------------------------------------
def _unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _type_name(tp: Any) -> str:
    tp, optional = _unwrap_optional(tp)
    name = getattr(tp, "__name__", str(tp).replace("typing.", ""))
    if typing.get_origin(tp) is list:
        name = "list"
    elif typing.get_origin(tp) is dict or dataclasses.is_dataclass(tp):
        name = "mapping"
    return f"{name} or null" if optional else name


def _schema_paths(cls: type, prefix: str = "") -> List[str]:
    """Every key path of a dataclass schema, nested ones included (`rewards.<domain>.x`)."""
    paths = []
    for name, tp in _field_types(cls).items():
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        inner, _ = _unwrap_optional(tp)
        if dataclasses.is_dataclass(inner):
            paths += _schema_paths(inner, path)
        elif typing.get_origin(inner) is dict and dataclasses.is_dataclass(typing.get_args(inner)[1]):
            paths += _schema_paths(typing.get_args(inner)[1], f"{path}.<domain>")
    return paths


def _suggest(key: str, cls: type, path: str) -> str:
    """A "did you mean" naming the full path of the closest key: a near spelling at this level,
    else the same (or a near) key elsewhere in the schema (a key written at the wrong level)."""
    valid = list(_field_types(cls))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {(f'{path}.{close[0]}' if path else close[0])!r}?"
    everywhere = _schema_paths(PipelineConfig)
    leaves = sorted({p.rpartition(".")[2] for p in everywhere})
    near = difflib.get_close_matches(key, leaves, n=1, cutoff=0.8)
    if near:
        # Paths under the current block first, then the shallowest (stable: schema order).
        candidates = [p for p in everywhere if p.rpartition(".")[2] == near[0]]
        candidates.sort(key=lambda p: (not p.startswith(f"{path}."), p.count(".")))
        shown = " or ".join(repr(p) for p in candidates[:3])
        return f"; did you mean {shown}?"
    return f"; valid keys here: {', '.join(valid)}"


def _field_types(cls: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _walk(value: Any, tp: Any, path: str, problems: List[str], choices: Optional[list] = None) -> Any:
    """Check `value` against type `tp` (and `choices`), collecting problems; return it coerced
    (int -> float). Unresolved interpolations (`${...}`) are left for the resolved pass."""
    if tp is Any or (isinstance(value, str) and "${" in value):
        return value
    if choices is not None and value not in choices:
        valid = ", ".join("null" if c is None else repr(c) for c in choices if c != "")
        problems.append(roll_compat.choice_refusal(path, value)
                        or f"{path}: invalid value {value!r}; valid values: {valid}")
        return value
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if not optional:
            problems.append(f"{path}: null is not allowed (expected {_type_name(inner)})")
        return None
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping of keys, got {type(value).__name__} {value!r}")
            return value
        fields = _field_types(inner)
        field_choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(inner)}
        out = {}
        for key, sub in value.items():
            sub_path = f"{path}.{key}" if path else str(key)
            if key not in fields:
                problems.append(f"unknown key {sub_path!r}" + _suggest(str(key), inner, path))
                continue
            out[key] = _walk(sub, fields[key], sub_path, problems, field_choices[key])
        return out
    origin = typing.get_origin(inner)
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
            return value
        _, value_type = typing.get_args(inner)
        return {k: _walk(v, value_type, f"{path}.{k}", problems) for k, v in value.items()}
    if origin is list:
        (item_type,) = typing.get_args(inner)
        if isinstance(value, str) and item_type is str:
            value = [value]  # `file_name: data.jsonl` means a list of one
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {type(value).__name__} {value!r}")
            return value
        return [_walk(v, item_type, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(inner, True)
    if not ok:
        problems.append(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return value
    return float(value) if inner is float else value


def _build(cls: type, values: Dict[str, Any]) -> Any:
    """Instantiate a dataclass from checked values, nested dataclasses included."""
    kwargs = {}
    for name, tp in _field_types(cls).items():
        if name not in values:
            continue
        inner, _ = _unwrap_optional(tp)
        value = values[name]
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            value = _build(inner, value)
        elif typing.get_origin(inner) is dict and isinstance(value, dict):
            _, value_type = typing.get_args(inner)
            if dataclasses.is_dataclass(value_type):
                value = {k: _build(value_type, v) for k, v in value.items()}
        kwargs[name] = value
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------
def _normalise_legacy_values(raw: Dict[str, Any]) -> None:
    """Accept the boolean spellings users write for `resume_from_checkpoint`."""
    resume = raw.get("resume_from_checkpoint")
    if resume is True:
        raw["resume_from_checkpoint"] = "auto"
    elif resume is False:
        raw["resume_from_checkpoint"] = None


def load_config_dict(raw_cfg: DictConfig) -> PipelineConfig:
    """Strictly check a composed config (interpolations unresolved) and build the dataclass."""
    raw = OmegaConf.to_container(raw_cfg, resolve=False)
    _normalise_legacy_values(raw)  # before the walk, which would reject a bool here
    roll_compat.normalise_roll_values(raw)
    anchors = {k for k in raw if isinstance(k, str) and (k.startswith("_") or k in roll_compat.DEEPSPEED_ANCHORS)}
    pipeline_keys = {k: v for k, v in raw.items() if k not in anchors}

    problems: List[str] = []
    _walk(pipeline_keys, PipelineConfig, "", problems)  # unknown keys, on what the user wrote
    if problems:
        raise ConfigError(problems)

    # Defaults under the user's values, so `${response_length}` resolves even when unset. A
    # user's `rewards:` replaces the default domain instead of merging with it.
    defaults = dataclasses.asdict(PipelineConfig())
    if "rewards" in raw:
        defaults["rewards"] = {k: dataclasses.asdict(RewardConfig()) for k in (raw["rewards"] or {})}
    merged = OmegaConf.merge(OmegaConf.create(defaults), raw_cfg)
    try:
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError([f"interpolation failed: {exc}".replace("\n", " ")]) from None
    for key in anchors:
        resolved.pop(key, None)
    _normalise_legacy_values(resolved)
    roll_compat.normalise_roll_values(resolved)
    checked = _walk(resolved, PipelineConfig, "", problems)
    if problems:
        raise ConfigError(problems)
    # ROLL's names and multi-key semantics, knowing which keys the user wrote.
    roll_compat.apply_roll_compat(PipelineConfig, checked, pipeline_keys, problems)
    if problems:
        raise ConfigError(problems)
    return _build(PipelineConfig, checked)


def written_key_paths(raw_cfg: DictConfig) -> Set[str]:
    """Dotted paths of every key the YAML (with overrides) writes, blocks and leaves alike."""
    paths: Set[str] = set()

    def visit(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{prefix}.{key}" if prefix else str(key)
                paths.add(path)
                visit(value, path)

    visit(OmegaConf.to_container(raw_cfg, resolve=False), "")
    return paths


def load_config(config: str, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Compose `config` (path or example name), apply overrides, check strictly, validate.

    Raises ConfigError listing every problem; returns the typed config with derived defaults
    filled in. Warnings (GSPO traps) are logged by ``validate.validate_config``.
    """
    from roll_gspo.config.validate import validate_config

    path = resolve_config_path(config)
    try:
        raw_cfg = compose_yaml(path)
    except Exception as exc:  # Hydra wraps YAML syntax errors in several exception types
        raise ConfigError([f"{path}: cannot be read as a YAML config: {exc}".replace("\n", " ")]) from None
    hydra_problems = hydra_block_problems(path)
    if hydra_problems:
        raise ConfigError(hydra_problems)
    apply_overrides(raw_cfg, overrides)
    cfg = load_config_dict(raw_cfg)
    validate_config(cfg, yaml_keys=written_key_paths(raw_cfg))
    return cfg


def config_to_yaml(cfg: PipelineConfig) -> str:
    """The resolved config as YAML; a literal `judge_api_key` is masked (`env:NAME` is shown)."""
    data = dataclasses.asdict(cfg)
    for reward in data.get("rewards", {}).values():
        key = reward.get("judge_api_key")
        if key and not str(key).startswith("env:"):
            reward["judge_api_key"] = "***"
    return OmegaConf.to_yaml(OmegaConf.create(data))
