"""A loaded config is read-only: `freeze` marks a schema object and everything under it, after
which setting a key raises `ReadOnlyConfigError` naming its key path.

Loading and validation fill and derive keys (`validate_config`'s normalise, derive and settle
phases); what the run decides from them afterwards goes in its `RunPlan` (roll_gspo.config.plan.run_plan),
never back into the config. A frozen config pickles and deep-copies frozen (Ray sends it to the
workers as it is); `thawed` gives a writable copy and `replaced` a frozen copy with some keys
changed, for code that derives a config of its own from a loaded one.

The flag lives in the object's `__dict__` (not a dataclass field), so repr, equality,
`dataclasses.asdict` and the YAML a config prints are those of the unfrozen config. Dicts of a
frozen config (`rewards`, `strategy_config`, `system_envs`, ...) become `FrozenDict`s: dicts that
refuse item assignment; lists stay lists.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Mapping, Optional, TypeVar

_FROZEN_AT = "_frozen_at"  # the key path prefix of a frozen block ("" at the top, "actor_train." below it)

T = TypeVar("T")


class ReadOnlyConfigError(dataclasses.FrozenInstanceError):
    """A key of a loaded (frozen) config was set."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(f"{path}: the config is read-only after loading. Set the key in the YAML or as an "
                         f"override ({path}=...); what the run derives from the keys is in its RunPlan "
                         f"(roll_gspo.config.plan.run_plan.build_run_plan), and `replaced(cfg, {{{path!r}: ...}})` makes a "
                         f"changed copy")


class SchemaBlock:
    """Base of the schema's dataclasses: writable until `freeze` marks it, read-only after."""

    def __setattr__(self, name: str, value: Any) -> None:
        prefix = self.__dict__.get(_FROZEN_AT)
        if prefix is not None:
            raise ReadOnlyConfigError(f"{prefix}{name}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        prefix = self.__dict__.get(_FROZEN_AT)
        if prefix is not None:
            raise ReadOnlyConfigError(f"{prefix}{name}")
        object.__delattr__(self, name)


class FrozenDict(Dict[Any, Any]):
    """A dict of a frozen config: reads as a dict (equal to one, same repr), refuses writes with the
    key path. Calling the class makes a plain dict (so `dataclasses.asdict`, `copy.copy` and
    `type(d)(d)` give writable copies that OmegaConf and JSON take); `_frozen_dict` makes one."""

    _path: Optional[str] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # a copy of a frozen dict is a plain dict
        return dict(*args, **kwargs)

    def _refuse(self, key: Any = None) -> None:
        if self._path is not None:
            raise ReadOnlyConfigError(f"{self._path}.{key}" if key is not None else self._path)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._refuse(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._refuse(key)
        super().__delitem__(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._refuse(key)
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self._refuse(key)
        return super().pop(key, *default)

    def popitem(self) -> Any:
        self._refuse()
        return super().popitem()

    def clear(self) -> None:
        self._refuse()
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._refuse()
        super().update(*args, **kwargs)

    def __ior__(self, other: Any) -> Any:  # type: ignore[misc]  # dict's |= writes in place, past update()
        self._refuse()
        return super().__ior__(other)

    def __reduce__(self) -> Any:
        return _rebuild_frozen_dict, (dict(self), self._path)

    def __copy__(self) -> Dict[Any, Any]:
        return dict(self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FrozenDict":
        return _rebuild_frozen_dict({copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()},
                                    self._path)


def _rebuild_frozen_dict(items: Mapping[Any, Any], path: Optional[str]) -> FrozenDict:
    out: FrozenDict = dict.__new__(FrozenDict)
    dict.update(out, items)
    out._path = path
    return out


def freeze(obj: T, prefix: str = "") -> T:
    """Make the schema object `obj` and everything under it read-only, in place; returns it.
    `prefix`: its key path, ending in a dot (messages name `prefix + key`)."""
    if not isinstance(obj, SchemaBlock) or not dataclasses.is_dataclass(obj):
        raise TypeError(f"freeze takes a schema dataclass, got {type(obj).__name__}")
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        frozen = _freeze_value(value, f"{prefix}{f.name}")
        if frozen is not value:
            object.__setattr__(obj, f.name, frozen)
    obj.__dict__[_FROZEN_AT] = prefix
    return obj


def _freeze_value(value: Any, path: str) -> Any:
    if isinstance(value, SchemaBlock):
        return freeze(value, f"{path}.")
    if isinstance(value, dict):
        return _rebuild_frozen_dict({key: _freeze_value(item, f"{path}.{key}") for key, item in value.items()}, path)
    if isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, (SchemaBlock, dict)):
                value[index] = _freeze_value(item, f"{path}[{index}]")
    return value


def is_frozen(obj: Any) -> bool:
    """Whether `obj` (a schema object) is read-only."""
    return isinstance(obj, SchemaBlock) and obj.__dict__.get(_FROZEN_AT) is not None


def thawed(obj: T) -> T:
    """A writable deep copy of a (frozen or not) schema object."""
    out = copy.deepcopy(obj)
    _thaw(out)
    return out


def _thaw(value: Any) -> Any:
    if isinstance(value, SchemaBlock):
        value.__dict__.pop(_FROZEN_AT, None)
        for f in dataclasses.fields(value):  # type: ignore[arg-type]  # SchemaBlocks are dataclasses
            item = getattr(value, f.name)
            plain = _thaw(item)
            if plain is not item:
                object.__setattr__(value, f.name, plain)
        return value
    if isinstance(value, dict):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, list):
        value[:] = [_thaw(item) for item in value]
    return value


def replaced(obj: T, changes: Mapping[str, Any]) -> T:
    """A copy of `obj` with the dotted key paths in `changes` set (`{"actor_train.model_args.
    model_name_or_path": folder}`; a dict key is a path part too: `rewards.math.world_size`),
    frozen when `obj` is. `obj` itself is unchanged."""
    out = thawed(obj)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node: Any = out
        for part in parents:
            node = node[part] if isinstance(node, dict) else getattr(node, part)
        if isinstance(node, dict):
            node[last] = value
        elif not hasattr(node, last):
            raise AttributeError(f"{path}: no such key")
        else:
            setattr(node, last, value)
    return freeze(out) if is_frozen(obj) else out
