"""The registry of config steps: each check, fill or warning is declared where its keys live.

Each concern declares its steps in the module that owns its keys::

    @check("check", keys=("gamma", "lambd"), doc="`gamma` / `lambd` outside [0, 1]")
    def _gae_ranges(cfg, yaml_keys): ...      # yields Findings

`validate_config` runs every registered step (`run_steps`), phase by phase:

* ``normalise``: rewrite what the YAML wrote into its canonical form (the pipeline ROLL picks by its
  start script, device_mapping strings parsed); may change the config;
* ``derive``: fill the defaults and values that follow from other keys; may change the config;
* ``check``: refusals; must not change the config (a step that does is a bug, raised as such);
* ``settle``: values that need a config every check passed (vLLM's memory share); may change it;
* ``warn``: warnings and notices; must not change the config.

Errors of the first three phases are raised together, one `ConfigError`, after ``check``. Inside a
phase steps run in the order they are declared, modules by name (`check_modules`: every module of
this folder but the registry, the runner and preflight); an order that matters is declared (`after`),
and a step that needs others to have found nothing names them (`requires`). A new module of steps is
a new file in this folder; nothing else changes.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from roll_gspo.config.errors import ConfigError
from roll_gspo.config.findings import Finding

PHASES = ("normalise", "derive", "check", "settle", "warn")
MUTATING_PHASES = ("normalise", "derive", "settle")
# The modules of this folder that declare no steps: the registry, the runner and preflight.
NOT_STEP_MODULES = ("registry", "validate", "preflight")


StepFn = Callable[[Any, Optional[AbstractSet[str]]], Iterable[Finding]]


@dataclass(frozen=True)
class Step:
    """A registered step: `fn(cfg, yaml_keys)` yields its findings."""
    name: str
    phase: str
    keys: Tuple[str, ...]
    doc: str  # one line: what it refuses, warns about or fills in (the config reference lists it)
    fn: StepFn = field(compare=False, repr=False)
    module: str = ""
    after: Tuple[str, ...] = ()  # steps of the same phase that must run first
    requires: Tuple[str, ...] = ()  # steps that must have found no error, else this one is skipped
    rollout_only: bool = False  # skipped in pipelines without a rollout phase (sft)


_REGISTRY: Dict[str, Step] = {}


def check(phase: str, keys: Sequence[str], doc: str, name: Optional[str] = None, after: Sequence[str] = (),
          requires: Sequence[str] = (), rollout_only: bool = False) -> Callable[[StepFn], StepFn]:
    """Register the decorated function as a step of `phase`; `name` defaults to `module.function`;
    `rollout_only`: the step concerns keys of the rollout phase, skipped where there is none (sft)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if not doc or "\n" in doc.strip():
        raise ValueError("a step's doc is one line saying what it refuses, warns about or fills in")

    def register(fn: StepFn) -> StepFn:
        module = fn.__module__
        step = Step(name or f"{module.rpartition('.')[2]}.{fn.__name__}", phase, tuple(keys), " ".join(doc.split()),
                    fn, module, tuple(after), tuple(requires), rollout_only)
        _REGISTRY[step.name] = step  # a module imported again replaces its steps
        return fn
    return register


def check_modules() -> Tuple[str, ...]:
    """Every module of `roll_gspo.config.checks` but NOT_STEP_MODULES, by name: the modules that declare
    steps, in the order their steps run within a phase."""
    from roll_gspo.config import checks

    return tuple(f"{checks.__name__}.{module.name}" for module in sorted(pkgutil.iter_modules(checks.__path__),
                                                                          key=lambda module: module.name)
                 if module.name not in NOT_STEP_MODULES)


def load_steps() -> None:
    """Import every module of `check_modules()` (their decorators fill the registry)."""
    for module in check_modules():
        importlib.import_module(module)


def registered_steps(phase: Optional[str] = None) -> List[Step]:
    """The steps in the order they run (of one phase, or all)."""
    load_steps()
    rank = {m: i for i, m in enumerate(check_modules())}
    declared = list(_REGISTRY.values())
    ordered: List[Step] = []
    for current in PHASES if phase is None else (phase,):
        pending = sorted((s for s in declared if s.phase == current),
                         key=lambda s: rank.get(s.module, len(rank)))  # stable: declaration order in a module
        names = {s.name for s in pending}
        done: set = set()
        while pending:
            ready = next((s for s in pending if all(a in done or a not in names for a in s.after)), None)
            if ready is None:
                raise RuntimeError(f"config steps wait on each other (after=): {[s.name for s in pending]}")
            pending.remove(ready)
            done.add(ready.name)
            ordered.append(ready)
    unknown = sorted({d for s in ordered for d in s.after + s.requires if d not in _REGISTRY})
    if unknown:
        raise RuntimeError(f"config steps name steps that are not registered: {unknown}")
    return ordered


def run_steps(cfg: Any, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """Run every step on `cfg`; raise ConfigError with every error once the checks have run,
    else return the findings of every phase (errors excluded: there are none)."""
    found: List[Finding] = []
    failed: set = set()  # steps that found an error
    for step in registered_steps():
        if step.phase == "settle" and any(f.level == "error" for f in found):
            raise ConfigError([f for f in found if f.level == "error"])
        if any(name in failed for name in step.requires) or (step.rollout_only and not cfg.has_rollout()):
            continue
        before = None if step.phase in MUTATING_PHASES else repr(cfg)
        own = list(step.fn(cfg, yaml_keys))
        if before is not None and repr(cfg) != before:
            raise RuntimeError(f"config step {step.name} ({step.phase} phase) changed the config; a step that "
                               f"fills or rewrites keys belongs to the normalise, derive or settle phase")
        bad = [f for f in own if not isinstance(f, Finding)]
        if bad:
            raise TypeError(f"config step {step.name} yielded {bad[0]!r}, not a Finding")
        own = [f if f.source else dataclasses.replace(f, source=step.name) for f in own]
        if any(f.level == "error" for f in own):
            if step.phase == "warn":
                raise RuntimeError(f"config step {step.name} (warn phase) found an error; refusals are checks")
            failed.add(step.name)
        found += own
    errors = [f for f in found if f.level == "error"]
    if errors:
        raise ConfigError(errors)
    return found
