"""Import an object named by a config string (`pkg.module:name`, `pkg.module:obj.attr` or
`pkg.module.name`), never `eval`. One place for reward functions, worker classes and preflight."""
import importlib
from typing import Any


def import_object(path: str) -> Any:
    """The object at `path`; ValueError for a malformed path, ImportError naming what is missing."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"import path must look like 'pkg.module:name', got {path!r}")
    path = path.strip()
    module_name, sep, attr_path = path.partition(":")
    if not sep:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"{path!r} is not an import path like 'pkg.module:name' or 'pkg.module.name'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import module {module_name!r} of {path!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{path!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def import_callable(path: str) -> Any:
    obj = import_object(path)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable (got {type(obj).__name__})")
    return obj
