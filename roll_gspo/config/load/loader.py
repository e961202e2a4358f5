"""Load a pipeline YAML strictly: Hydra composition and override grammar, OmegaConf
interpolation, then the typed walk of ``typed_walk`` over ``schema.PipelineConfig``, which
reports every unknown key (with a "did you mean"), wrong type and invalid choice at once, before
anything starts.

Semantic checks (batch arithmetic, contradictions, GSPO traps) are the steps of ``registry``, run by
``validate.validate_config``.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import re
import tempfile
import warnings
from pathlib import Path
from typing import AbstractSet, Any, Dict, List, Optional, Sequence, Set, Tuple, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from roll_gspo.config.roll import roll_compat
from roll_gspo.config.errors import ConfigError
from roll_gspo.config.findings import Finding, notice
from roll_gspo.schema.config import PipelineConfig, RewardConfig
# The strict typed walk (typed_walk; FSDP2's strategy_config is walked the same way, plan/fsdp2).
from roll_gspo.config.typed_walk import build, field_types, walk

# Where `--config NAME` is looked up when NAME is not a path (repository root relative).
REPO_ROOT = Path(__file__).resolve().parents[3]
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
        own = list((cast(DictConfig, OmegaConf.load(path)).get("hydra") or {}).get("searchpath") or [])
    except Exception:  # unreadable: Hydra reports it with the file name
        pass
    ours = [f"file://{(REPO_ROOT / 'configs').resolve()}", f"file://{_roll_config_search_root()}"]
    return "hydra.searchpath=[" + ",".join(str(p) for p in own + ours) + "]"


def hydra_block_problems(path: Path) -> List[Finding]:
    """Problems with the YAML's own `hydra:` block (see roll_compat.hydra_block_problems)."""
    try:
        block = _container(OmegaConf.load(path)).get("hydra")
    except Exception:
        return []
    return [dataclasses.replace(p, message=f"{path.name}: {p.message}")
            for p in roll_compat.hydra_block_problems(block)]


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
# Entry point
# --------------------------------------------------------------------------------------------
def _normalise_legacy_values(raw: Dict[str, Any]) -> None:
    """Accept the boolean spellings users write for `resume_from_checkpoint`."""
    resume = raw.get("resume_from_checkpoint")
    if resume is True:
        raw["resume_from_checkpoint"] = "auto"
    elif resume is False:
        raw["resume_from_checkpoint"] = None


_INTERPOLATION_ROOT = re.compile(r"\$\{\s*([A-Za-z_][\w\-]*)\s*([.}\[])")


def interpolation_anchors(raw: Dict[str, Any]) -> Set[str]:
    """Top-level keys that are not pipeline keys but that some value interpolates (ROLL's
    `action_pattern: ...` then `${action_pattern}`, or whole blocks: `${custom_env.FrozenLake}`).
    They exist only to be interpolated and are dropped after resolution; a top-level key that
    nothing reads stays an unknown key (a typo is still an error). Resolvers (`${oc.env:X}`) and
    relative interpolations (`${.x}`) name no top-level key."""
    referenced: Set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)
        elif isinstance(node, str) and "${" in node:
            referenced.update(m.group(1) for m in _INTERPOLATION_ROOT.finditer(node))

    visit(raw)
    schema_keys = set(field_types(PipelineConfig))
    return {key for key in raw if isinstance(key, str) and key in referenced and key not in schema_keys}


def _container(node: Any, resolve: bool = False) -> Dict[str, Any]:
    """A config node as plain Python: a YAML config's top level is a mapping (OmegaConf's own type
    allows a list too)."""
    return cast(Dict[str, Any], OmegaConf.to_container(node, resolve=resolve))


def defaults_file_keys(path: Path, raw_cfg: DictConfig) -> Set[str]:
    """Top-level keys the composed config got from its `defaults:` files only (ROLL's
    `../config/traj_envs@_here_` defines anchors for many examples; a given example reads some)."""
    import yaml

    try:
        own = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return set()
    if not isinstance(own, dict) or "defaults" not in own:
        return set()
    return {str(k) for k in raw_cfg.keys()} - {str(k) for k in own}


def load_config_dict(raw_cfg: DictConfig,
                     from_defaults: AbstractSet[str] = frozenset()) -> Tuple[PipelineConfig, List[Finding]]:
    """Strictly check a composed config (interpolations unresolved) and build the dataclass; with
    the notices of the load. `from_defaults`: top-level keys only a `defaults:` file wrote; those
    that are no pipeline key and that nothing interpolates are ROLL's anchors for other examples,
    dropped with one notice."""
    raw = _container(raw_cfg)
    _normalise_legacy_values(raw)  # before the walk, which would reject a bool here
    roll_compat.normalise_roll_values(raw)
    anchors = {k for k in raw if isinstance(k, str) and (k.startswith("_") or k in roll_compat.DEEPSPEED_ANCHORS)}
    anchors |= interpolation_anchors(raw)
    unread = sorted(k for k in from_defaults if k in raw and k not in anchors and k not in field_types(PipelineConfig))
    notices = []
    if unread:
        anchors |= set(unread)
        notices.append(notice("", f"the defaults file(s) define top-level keys this config never reads (anchors of "
                                  f"other examples), ignored: {', '.join(unread)}"))
    pipeline_keys = {k: v for k, v in raw.items() if k not in anchors}

    problems: List[Finding] = []
    walk(pipeline_keys, PipelineConfig, "", problems)  # unknown keys, on what the user wrote
    if problems:
        raise ConfigError(problems, notices)

    # Defaults under the user's values, so `${response_length}` resolves even when unset. A
    # user's `rewards:` replaces the default domain instead of merging with it.
    defaults = dataclasses.asdict(PipelineConfig())
    if "rewards" in raw:
        defaults["rewards"] = {k: dataclasses.asdict(RewardConfig()) for k in (raw["rewards"] or {})}
    merged = OmegaConf.merge(OmegaConf.create(defaults), raw_cfg)
    try:
        resolved = _container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError([f"interpolation failed: {exc}".replace("\n", " ")], notices) from None
    for key in anchors:
        resolved.pop(key, None)
    _normalise_legacy_values(resolved)
    roll_compat.normalise_roll_values(resolved)
    checked = walk(resolved, PipelineConfig, "", problems)
    if problems:
        raise ConfigError(problems, notices)
    # ROLL's names and multi-key semantics, knowing which keys the user wrote.
    roll_compat.apply_roll_compat(PipelineConfig, checked, pipeline_keys, problems)
    if problems:
        raise ConfigError(problems, notices)
    return build(PipelineConfig, checked), notices


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


def load_config(config: str, overrides: Sequence[str] = (), cpu_host: Optional[bool] = False) -> PipelineConfig:
    """Compose `config` (path or example name), apply overrides, check strictly, validate.

    Raises ConfigError listing every problem; returns the typed config with derived defaults
    filled in. Warnings and notices (GSPO traps, keys that act differently) are logged. The GPU-only
    settings of roles that run on CPUs are adapted first, one notice each (``cpu_run``);
    `cpu_host` True (None: detect it when a role has GPU placement) also drops the roles' GPU
    placement, for a run on a machine without a GPU.
    """
    try:
        cfg, findings = load_config_findings(config, overrides, cpu_host)
    except ConfigError as exc:
        _log(exc.notices)
        raise
    _log(findings)
    return cfg


def _log(findings: Sequence[Finding]) -> None:
    for text in dict.fromkeys(finding.text for finding in findings):  # a notice naming several keys: once
        logging.getLogger("roll_gspo.config").warning(text)


def load_config_findings(config: str, overrides: Sequence[str] = (),
                         cpu_host: Optional[bool] = False) -> Tuple[PipelineConfig, List[Finding]]:
    """`load_config`, returning the load's warnings and notices (the CPU adaptation's, the
    validation's) instead of logging them; a ConfigError of the validation carries the notices
    noted before it (`ConfigError.notices`)."""
    from roll_gspo.config.plan.cpu_precision import resolve_auto_dtypes
    from roll_gspo.config.plan.cpu_run import adapt_to_cpu, megatron_to_deepspeed
    from roll_gspo.config.checks.validate import check_config

    path = resolve_config_path(config)
    try:
        raw_cfg = compose_yaml(path)
    except Exception as exc:  # Hydra wraps YAML syntax errors in several exception types
        raise ConfigError([f"{path}: cannot be read as a YAML config: {exc}".replace("\n", " ")]) from None
    hydra_problems = hydra_block_problems(path)
    if hydra_problems:
        raise ConfigError(hydra_problems)
    from_defaults = defaults_file_keys(path, raw_cfg)
    apply_overrides(raw_cfg, overrides)
    on_cpu = megatron_to_deepspeed(raw_cfg, cpu_host)
    cfg, notices = load_config_dict(raw_cfg, from_defaults)
    notices += on_cpu + adapt_to_cpu(cfg, cpu_host) + resolve_auto_dtypes(cfg)  # auto: by where each role runs
    try:
        return cfg, notices + check_config(cfg, yaml_keys=written_key_paths(raw_cfg))
    except ConfigError as exc:
        raise ConfigError(exc.findings, notices) from None


def config_to_yaml(cfg: PipelineConfig) -> str:
    """The resolved config as YAML; a literal `judge_api_key` is masked (`env:NAME` is shown)."""
    data = dataclasses.asdict(cfg)
    for reward in data.get("rewards", {}).values():
        key = reward.get("judge_api_key")
        if key and not str(key).startswith("env:"):
            reward["judge_api_key"] = "***"
    return OmegaConf.to_yaml(OmegaConf.create(data))
