"""Import an object named by a config string (`pkg.module:name`, `pkg.module:obj.attr` or
`pkg.module.name`), never `eval`. One place for reward functions, worker classes and preflight."""
import contextlib
import importlib
import sys
from typing import Any, Iterator


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


class _WhileLoading:
    """Meta-path finder: module `target` executes inside `context()` (a context manager); found and
    loaded by its own loader otherwise."""

    def __init__(self, target: str, context: Any):
        self.target, self.context = target, context

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, context = spec.loader, self.context

        class Loader:
            def __getattr__(self, name):  # get_source, is_package, ...: the file's own loader
                return getattr(loader, name)

            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                with context():
                    return loader.exec_module(module)

        spec.loader = Loader()
        return spec


class _WithoutWhileLoading(_WhileLoading):
    """While module `target` executes, `import blocked` raises ImportError (unless `blocked` was
    imported before); afterwards `blocked` imports as usual."""

    def __init__(self, target: str, blocked: str):
        self.blocked = blocked
        super().__init__(target, self._blocking)

    @contextlib.contextmanager
    def _blocking(self) -> Iterator[None]:
        if self.blocked in sys.modules:
            yield
            return
        sys.modules[self.blocked] = None  # type: ignore[assignment]  # `import blocked` -> ImportError
        try:
            yield
        finally:
            if sys.modules.get(self.blocked, 0) is None:
                del sys.modules[self.blocked]


def _install(finder: _WhileLoading) -> None:
    if not any(type(f) is type(finder) and f.target == finder.target for f in sys.meta_path):
        sys.meta_path.insert(0, finder)


# DeepSpeed's autotuner (the `deepspeed --autotuning` launcher, never used here) logs to mlflow when it
# can import it, and `import deepspeed` imports the autotuner: with mlflow-skinny installed (the
# mlflow tracker's extra) every DeepSpeed rank also imported mlflow, pandas and fastapi. Measured
# on a loaded 2-core machine: `import deepspeed` after torch and transformers 6.4-11.5 s -> 1.4-1.8 s;
# a PPO run and its resume (6 DeepSpeed ranks in all) 109 -> 94 CPU-seconds. Without mlflow the
# autotuner only sets has_mlflow = False.
DEEPSPEED_WITHOUT_MLFLOW = ("deepspeed.autotuning.autotuner", "mlflow")

# Two transformers modules import an optional package whenever it is installed, and
# `from transformers import AutoModelForCausalLM` imports both: the candidate generator (assisted
# decoding, never used here) imports sklearn.metrics (scikit-learn comes with reasoning-gym and
# lm-eval), the loss registry's object-detection losses import scipy.optimize. Each rank paid ~1.3 CPU-seconds for them
# (3 runs on a loaded 2-core machine: 4.3-4.5 -> 3.2-3.6 CPU-s for transformers' auto classes
# without sklearn; scipy.optimize 0.4 s more). The module then sees the package as absent, a state
# transformers supports (what reads it: assisted decoding's confidence-threshold tuning, DETR-style
# matching losses).
TRANSFORMERS_WITHOUT = {"transformers.generation.candidate_generator": "sklearn",
                        "transformers.loss.loss_utils": "scipy"}


# vLLM's audio helpers (multimodal input, never used here) import scipy.signal for resampling when it is
# installed (reasoning-gym and lm-eval bring scipy), and `from vllm import LLM` imports them: ~0.5-0.8
# CPU-seconds in every vLLM rank's start-up. The module guards the import (a placeholder that raises
# only when audio is resampled with scipy), so leaving scipy.signal out is a state vLLM supports.
VLLM_WITHOUT_SCIPY_SIGNAL = ("vllm.multimodal.audio", "scipy.signal")


def _reported_absent(package: str) -> Any:
    flag = f"is_{package}_available"

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        if package in sys.modules:  # imported already: nothing to save
            yield
            return
        import transformers.utils as transformers_utils

        reported = getattr(transformers_utils, flag)
        setattr(transformers_utils, flag, lambda: False)  # what the module binds at its import
        try:
            yield
        finally:
            setattr(transformers_utils, flag, reported)

    return context


def import_deepspeed_without_mlflow() -> None:
    """From now on in this process, importing DeepSpeed leaves mlflow out (idempotent; the mlflow
    tracker still imports it where a run asks for it)."""
    _install(_WithoutWhileLoading(*DEEPSPEED_WITHOUT_MLFLOW))


def import_transformers_without_optional_packages() -> None:
    """From now on in this process, the modules of `TRANSFORMERS_WITHOUT` leave their package out
    (idempotent; the package itself still imports where something asks for it)."""
    for module, package in TRANSFORMERS_WITHOUT.items():
        _install(_WhileLoading(module, _reported_absent(package)))


def lighter_imports() -> None:
    """All of the above: what every rank installs before it imports its libraries."""
    import_deepspeed_without_mlflow()
    import_transformers_without_optional_packages()
    _install(_WithoutWhileLoading(*VLLM_WITHOUT_SCIPY_SIGNAL))
