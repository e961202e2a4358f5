"""The strict typed walk of a config dict over the schema's dataclasses: every unknown key (with a
"did you mean"), wrong type and invalid choice is collected at once, and the checked values are
built into the dataclasses. The loader walks a whole pipeline config with it; a strategy_config
with a schema of its own (`FSDP2StrategyConfig`) is walked the same way."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Dict, List, Optional, Tuple

from roll_gspo.config.roll import roll_compat
from roll_gspo.config.findings import Finding, error
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.schema.config import is_block_type


def unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _type_name(tp: Any) -> str:
    tp, optional = unwrap_optional(tp)
    name = getattr(tp, "__name__", str(tp).replace("typing.", ""))
    if typing.get_origin(tp) is list:
        name = "list"
    elif typing.get_origin(tp) is dict or dataclasses.is_dataclass(tp):
        name = "mapping"
    return f"{name} or null" if optional else name


def schema_paths(cls: type, prefix: str = "") -> List[str]:
    """Every key path of a dataclass schema, nested ones included (`rewards.<domain>.x`)."""
    paths = []
    for name, tp in field_types(cls).items():
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        inner, _ = unwrap_optional(tp)
        if is_block_type(inner):
            paths += schema_paths(inner, path)
        elif typing.get_origin(inner) is dict and is_block_type(typing.get_args(inner)[1]):
            block = typing.get_args(inner)[1]
            paths += schema_paths(block, f"{path}.<{'domain' if block.__name__ == 'RewardConfig' else 'tag'}>")
    return paths


def _suggest(key: str, cls: type, path: str) -> str:
    """A "did you mean" naming the full path of the closest key: a near spelling at this level,
    else the same (or a near) key elsewhere in the schema (a key written at the wrong level)."""
    valid = list(field_types(cls))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {(f'{path}.{close[0]}' if path else close[0])!r}?"
    everywhere = schema_paths(PipelineConfig)
    leaves = sorted({p.rpartition(".")[2] for p in everywhere})
    near = difflib.get_close_matches(key, leaves, n=1, cutoff=0.8)
    if near:
        # Paths under the current block first, then the shallowest (stable: schema order).
        candidates = [p for p in everywhere if p.rpartition(".")[2] == near[0]]
        candidates.sort(key=lambda p: (not p.startswith(f"{path}."), p.count(".")))
        shown = " or ".join(repr(p) for p in candidates[:3])
        return f"; did you mean {shown}?"
    return f"; valid keys here: {', '.join(valid)}"


def field_types(cls: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def walk(value: Any, tp: Any, path: str, problems: List[Finding], choices: Optional[list] = None) -> Any:
    """Check `value` against type `tp` (and `choices`), collecting problems; return it coerced
    (int -> float). Unresolved interpolations (`${...}`) are left for the resolved pass."""
    if tp is Any or (isinstance(value, str) and "${" in value):
        return value
    if choices is not None and value not in choices:
        valid = ", ".join("null" if c is None else repr(c) for c in choices if c != "")
        problems.append(error(path, roll_compat.choice_refusal(path, value)
                        or f"{path}: invalid value {value!r}; valid values: {valid}"))
        return value
    inner, optional = unwrap_optional(tp)
    if value is None:
        if not optional:
            problems.append(error(path, f"{path}: null is not allowed (expected {_type_name(inner)})"))
        return None
    if is_block_type(inner):
        if not isinstance(value, dict):
            problems.append(error(path, f"{path}: expected a mapping of keys, got {type(value).__name__} {value!r}"))
            return value
        fields = field_types(inner)
        field_choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(inner)}
        out = {}
        for key, sub in value.items():
            sub_path = f"{path}.{key}" if path else str(key)
            if key not in fields:
                problems.append(error(sub_path, f"unknown key {sub_path!r}" + _suggest(str(key), inner, path)))
                continue
            out[key] = walk(sub, fields[key], sub_path, problems, field_choices[key])
        return out
    origin = typing.get_origin(inner)
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(error(path, f"{path}: expected a mapping, got {type(value).__name__} {value!r}"))
            return value
        _, value_type = typing.get_args(inner)
        if value_type is str:  # environment values: YAML reads `OMP_NUM_THREADS: 2` as an int, Ray wants "2"
            value = {k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in value.items()}
        return {k: walk(v, value_type, f"{path}.{k}", problems) for k, v in value.items()}
    if origin is list:
        (item_type,) = typing.get_args(inner)
        if isinstance(value, str) and item_type is str:
            value = [value]  # `file_name: data.jsonl` means a list of one
        if not isinstance(value, list):
            problems.append(error(path, f"{path}: expected a list, got {type(value).__name__} {value!r}"))
            return value
        return [walk(v, item_type, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(inner, True)
    if not ok:
        problems.append(error(path, f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}"))
        return value
    return float(value) if inner is float else value


def build(cls: type, values: Dict[str, Any]) -> Any:
    """Instantiate a dataclass from checked values, nested dataclasses included."""
    kwargs = {}
    for name, tp in field_types(cls).items():
        if name not in values:
            continue
        inner, _ = unwrap_optional(tp)
        value = values[name]
        if is_block_type(inner) and isinstance(value, dict):
            value = build(inner, value)
        elif typing.get_origin(inner) is dict and isinstance(value, dict):
            _, value_type = typing.get_args(inner)
            if is_block_type(value_type):
                value = {k: build(value_type, v) for k, v in value.items()}
        elif typing.get_origin(inner) is list and isinstance(value, list):
            (item_type,) = typing.get_args(inner)
            if is_block_type(item_type):
                value = [build(item_type, v) if isinstance(v, dict) else v for v in value]
        kwargs[name] = value
    return cls(**kwargs)
