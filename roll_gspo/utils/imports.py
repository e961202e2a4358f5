"""Import an object named by a config string (`pkg.module:name` or `pkg.module.name`), never
`eval`."""
import importlib
from typing import Any


def import_object(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path like 'pkg.module:name'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"{path!r}: module {module_name!r} has no attribute {attr!r}") from None
