"""Environments by name: ``custom_envs.<tag>.env_type`` and ``env_config`` -> an env object.

`env_type` is one of:

* a built-in (`ENV_TYPES`): ``frozen_lake``, ``sokoban``, ``guess_the_number``, ``math_python``,
  and ROLL's / GEM's names for them (``game:GuessTheNumber-v0`` and its ``-easy`` / ``-hard`` /
  ``-random`` variants with GEM's settings, ``roll_math``, ``math_python``);
* a class path, ``pkg.module:Class`` or ``pkg.module.Class``: the user's env, any class with
  `reset` and `step` as in `base.Env`, constructed as ``Class(**env_config)``;
* a GEM env id, when GEM (`gem-llm`) is installed: made by ``gem.make(env_type, **env_config)``.

`env_problems` says what is wrong before anything runs (``--dry-run``): an unknown type (with the
valid ones), a class path that does not import or is not an env, ``env_config`` keys the
constructor does not take (named, with the ones it takes), an ``action_pattern`` that is not a
regex with a group, and, for the built-ins, values their constructors refuse (they are cheap:
maps and datasets are made at reset).
"""
from __future__ import annotations

import importlib.util
import inspect
import re
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

from roll_gspo.envs.base import action_pattern_problem, is_env_like
from roll_gspo.utils.imports import import_object

_FROZEN_LAKE = "roll_gspo.envs.frozen_lake:FrozenLakeEnv"
_SOKOBAN = "roll_gspo.envs.sokoban:SokobanEnv"
_GUESS = "roll_gspo.envs.guess_number:GuessTheNumberEnv"
_MATH = "roll_gspo.envs.math_python:MathPythonEnv"

# name -> class path of the built-ins (ROLL's and GEM's names included).
ENV_TYPES: Dict[str, str] = {
    "frozen_lake": _FROZEN_LAKE,
    "sokoban": _SOKOBAN,
    "guess_the_number": _GUESS,
    "math_python": _MATH,
    "game:GuessTheNumber-v0": _GUESS,
    "game:GuessTheNumber-v0-easy": _GUESS,
    "game:GuessTheNumber-v0-hard": _GUESS,
    "game:GuessTheNumber-v0-random": _GUESS,
    "roll_math": _MATH,
}
# Settings a name implies (GEM's registrations); env_config overrides them.
ENV_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "game:GuessTheNumber-v0-easy": {"min_number": 1, "max_number": 10, "max_turns": 4},
    "game:GuessTheNumber-v0-hard": {"min_number": 1, "max_number": 50, "max_turns": 7},
    "game:GuessTheNumber-v0-random": {"min_number": None, "max_number": None, "max_turns": None},
}
# Keys of env_config holding a regex whose (last) group is the action or answer.
PATTERN_KEYS = ("action_pattern", "answer_pattern")
# Namespaces of GEM's env ids (`game:Wordle-v0`, `math:GSM8K`; ROLL adds reasoning-gym's `rg:`).
GEM_NAMESPACES = ("game", "math", "code", "qa", "logic", "eval", "rg")
_CLASS_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)?$")


def _valid_types() -> str:
    return ", ".join(ENV_TYPES) + ", or a class path 'pkg.module:MyEnv'"


def _gem_ids() -> Optional[Dict[str, Any]]:
    """GEM's registry when `gem-llm` is installed, else None (it is not, beside this stack)."""
    if importlib.util.find_spec("gem") is None:
        return None
    try:
        from gem.envs.registration import ENV_REGISTRY  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - a broken optional install is the same as none
        return None
    return ENV_REGISTRY


def _env_class(env_type: str) -> Tuple[Optional[type], str]:
    """(the class, a label for messages); (None, "gem") for a GEM id. ValueError saying why
    `env_type` names no env."""
    if not isinstance(env_type, str) or not env_type.strip():
        raise ValueError(f"env_type must be a non-empty string; valid: {_valid_types()}")
    if env_type in ENV_TYPES:
        return import_object(ENV_TYPES[env_type]), env_type
    gem_ids = _gem_ids()
    if gem_ids is not None and env_type in gem_ids:
        return None, "gem"
    if env_type.partition(":")[0] in GEM_NAMESPACES and gem_ids is None:
        raise ValueError(f"env_type {env_type!r} is a GEM env id, and GEM (`gem-llm`) is not installed (it does not "
                         f"install beside this stack's hydra/omegaconf); built-in: {_valid_types()}")
    if not (_CLASS_PATH.match(env_type) and ("." in env_type or ":" in env_type)):
        raise ValueError(f"env_type {env_type!r} is unknown; valid: {_valid_types()}")
    try:
        cls = import_object(env_type)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"env_type {env_type!r} is not a built-in env ({', '.join(ENV_TYPES)}) and does not "
                         f"import as a class: {exc}") from None
    if not inspect.isclass(cls) or not is_env_like(cls):
        raise ValueError(f"env_type {env_type!r} is not an environment class: it needs reset(seed) and "
                         f"step(action) methods (got {type(cls).__name__} {getattr(cls, '__name__', cls)!r})")
    return cls, env_type


def _config(env_type: str, env_config: Any) -> Dict[str, Any]:
    if env_config is None:
        env_config = {}
    if not isinstance(env_config, Mapping):
        raise ValueError(f"env_config of {env_type!r} must be a mapping of constructor arguments, got {env_config!r}")
    return {**ENV_DEFAULTS.get(env_type, {}), **dict(env_config)}


def _signature_problems(cls: type, label: str, config: Dict[str, Any]) -> List[str]:
    """env_config keys the constructor does not take, and required ones it lacks."""
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return []
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = []
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        problems.append(f"env_config of {label!r} ({cls.__name__}): unknown key(s) {unknown}; "
                        f"accepted: {', '.join(accepted) or '(none)'}")
    missing = [p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                 p.KEYWORD_ONLY)
               and p.name not in config]
    if missing:
        problems.append(f"env_config of {label!r} ({cls.__name__}): missing required key(s) {missing}")
    return problems


def env_problems(env_type: str, env_config: Any) -> List[str]:
    """Everything wrong with one env declaration, as messages naming the key (empty when fine).
    Imports the env's module; builds only a built-in env (whose constructor is cheap)."""
    try:
        cls, label = _env_class(env_type)
        config = _config(env_type, env_config)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    for key in PATTERN_KEYS:
        if config.get(key) is not None:
            problem = action_pattern_problem(config[key], f"env_config.{key}")
            if problem:
                problems.append(problem)
    if cls is None:  # a GEM id: GEM checks its own arguments
        return problems
    problems += _signature_problems(cls, label, config)
    if not problems and env_type in ENV_TYPES:
        try:
            cls(**config)
        except (ValueError, TypeError) as exc:
            problems.append(f"env_config of {label!r}: {exc}")
    return problems


def make_env(env_type: str, env_config: Any) -> Any:
    """The env `env_type` names, built with `env_config` as keyword arguments; ValueError naming
    what is wrong (the same messages as `env_problems`)."""
    cls, label = _env_class(env_type)
    config = _config(env_type, env_config)
    if cls is None:
        import gem  # type: ignore[import-not-found]

        return gem.make(env_type, **config)
    try:
        return cls(**config)
    except TypeError as exc:
        problems = env_problems(env_type, env_config)
        raise ValueError("; ".join(problems) if problems else f"{label}: {exc}") from None
