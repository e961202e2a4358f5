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


class _WithoutWhileLoading:
    """Meta-path finder: while module `target` executes, `import blocked` raises ImportError (unless
    `blocked` was imported before); afterwards `blocked` imports as usual."""

    def __init__(self, target: str, blocked: str):
        self.target, self.blocked = target, blocked

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        import sys

        loader, blocked = spec.loader, self.blocked

        class Loader:
            def __getattr__(self, name):  # get_source, is_package, ...: the file's own loader
                return getattr(loader, name)

            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                if blocked in sys.modules:
                    return loader.exec_module(module)
                sys.modules[blocked] = None  # `import blocked` -> ImportError
                try:
                    return loader.exec_module(module)
                finally:
                    if sys.modules.get(blocked, 0) is None:
                        del sys.modules[blocked]

        spec.loader = Loader()
        return spec


# DeepSpeed's autotuner (the `deepspeed --autotuning` launcher, never used here) logs to mlflow when it
# can import it, and `import deepspeed` imports the autotuner: with mlflow-skinny installed (the
# mlflow tracker's extra) every DeepSpeed rank also imported mlflow, pandas and fastapi. Measured
# on a loaded 2-core machine: `import deepspeed` after torch and transformers 6.4-11.5 s -> 1.4-1.8 s;
# a PPO run and its resume (6 DeepSpeed ranks in all) 109 -> 94 CPU-seconds. Without mlflow the
# autotuner only sets has_mlflow = False.
DEEPSPEED_WITHOUT_MLFLOW = ("deepspeed.autotuning.autotuner", "mlflow")


def import_deepspeed_without_mlflow() -> None:
    """From now on in this process, importing DeepSpeed leaves mlflow out (idempotent; the mlflow
    tracker still imports it where a run asks for it)."""
    import sys

    if not any(isinstance(f, _WithoutWhileLoading) and (f.target, f.blocked) == DEEPSPEED_WITHOUT_MLFLOW
               for f in sys.meta_path):
        sys.meta_path.insert(0, _WithoutWhileLoading(*DEEPSPEED_WITHOUT_MLFLOW))
