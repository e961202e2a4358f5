"""What an agent run reads before any worker starts, below the endpoint that serves it: the agent
function a config names, its task file, and a verifiers environment with its tasks. The config's
checks (roll_gspo.config.checks.endpoint) and the sources that play the episodes (pipelines.agent_source,
roll_gspo.serving) share them."""
from __future__ import annotations

import inspect
import json
from typing import Any, Dict, List, Optional

from roll_gspo.utils.imports import import_object

INSTALL = "pip install 'verifiers==0.4.0' (or `make install`: the cpu and gpu extras carry it)"


def agent_function(path: str):
    """The agent `path` names; ValueError / ImportError saying why not."""
    fn = import_object(path)
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise ValueError(f"{path!r} is not an async function (`async def agent(client, task) -> float`)")
    try:
        inspect.signature(fn).bind(object(), object())
    except TypeError as exc:
        raise ValueError(f"{path!r} does not take (client, task): {exc}") from None
    return fn


def load_tasks(path: str, key: Optional[str] = None) -> List[Any]:
    """An agent's tasks: a `.jsonl` file (one JSON value a line; blank lines skipped) or a `.json`
    list; `key`: each row's `row[key]` instead of the row. ValueError naming the line or row."""
    import json

    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            rows = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json task file holds a list of tasks")
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise ValueError(f"{path}, line {number}: not JSON ({exc})") from None
    if not rows:
        raise ValueError(f"{path} holds no task")
    if key is not None:
        missing = [i for i, row in enumerate(rows) if not isinstance(row, dict) or key not in row]
        if missing:
            raise ValueError(f"{path}: row {missing[0]} has no key {key!r} (task_key)")
        rows = [row[key] for row in rows]
    return rows


def env_config(spec: Dict[str, Any]):
    """verifiers' env config for `spec` (its `[env]` block as a dict: `taskset.id`, optional env
    `id`, the agents' fields), validated by verifiers itself. ImportError naming the install
    command when verifiers is missing; ValueError saying why a spec is not an env."""
    try:
        from verifiers.v1.utils.loaders import resolve_env_config
    except ImportError as exc:
        raise ImportError(f"verifiers is not installed ({exc}): {INSTALL}") from None
    spec = _plain(spec)
    taskset = spec.get("taskset")
    if not isinstance(taskset, dict) or not isinstance(taskset.get("id"), str) or not taskset["id"]:
        raise ValueError("needs taskset.id: the id of a verifiers taskset (an importable package exporting a "
                         "vf.Taskset subclass in __all__)")
    try:
        return resolve_env_config(spec)
    except Exception as exc:  # noqa: BLE001  (an unknown id, a field verifiers refuses: its own message)
        raise ValueError(f"{type(exc).__name__}: {_first_line(exc)}") from None


def load_env(spec: Dict[str, Any]):
    """The verifiers `Env` `spec` describes and its tasks (a bounded taskset, in load order)."""
    config = env_config(spec)  # first: says how to install verifiers when it is missing
    from verifiers.v1.utils.loaders import load_environment

    try:
        env = load_environment(config)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{type(exc).__name__}: {_first_line(exc)}") from None
    if not env.taskset.bounded:
        raise ValueError(f"taskset {config.taskset.id!r} is infinite: bound it (verifiers' taskset config) first")
    tasks = list(env.taskset)
    if not tasks:
        raise ValueError(f"taskset {config.taskset.id!r} holds no task")
    return env, tasks


def _plain(value: Any) -> Any:
    """A plain, mutable deep copy (the run's config is frozen)."""
    return json.loads(json.dumps(value, default=lambda v: dict(v) if hasattr(v, "items") else list(v))) \
        if value is not None else None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text if len(text) < 600 else text[:600] + " ..."
