"""Metric trackers behind `track_with`, one small class each, found by name in `TRACKERS`.

Every tracker gets the step's metrics as `{name: float}` (non-finite values already dropped) and
`tracker_kwargs` as keywords for its library. wandb, swanlab and mlflow are optional (the
`trackers` extra); asking for one that is not installed is an error naming the package.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Type


@dataclass
class TrackerContext:
    """What a tracker may need besides its kwargs."""
    exp_name: str
    output_dir: str
    logging_dir: str
    config: Dict[str, Any] = field(default_factory=dict)  # the resolved run config
    resume_step: Optional[int] = None  # a resumed run continues after this step (None: fresh)

    @property
    def resume(self) -> bool:
        return self.resume_step is not None


class Tracker:
    def __init__(self, context: TrackerContext, **kwargs: Any):
        self.context = context

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


TRACKERS: Dict[str, Type[Tracker]] = {}


def register_tracker(name: str) -> Callable[[Type[Tracker]], Type[Tracker]]:
    def add(cls: Type[Tracker]) -> Type[Tracker]:
        TRACKERS[name] = cls
        return cls
    return add


def make_tracker(name: str, context: TrackerContext, kwargs: Optional[Dict[str, Any]] = None) -> Optional[Tracker]:
    """The tracker called `name` ('none': None)."""
    if name == "none":
        return None
    if name not in TRACKERS:
        raise ValueError(f"track_with: unknown tracker {name!r}; valid: {', '.join(sorted(TRACKERS))}, none")
    return TRACKERS[name](context, **dict(kwargs or {}))


def _import(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"track_with: {module} needs the `{module}` package ({exc}); install the "
                          f"trackers extra: pip install -e \".[trackers]\"") from exc


@register_tracker("tensorboard")
class TensorBoardTracker(Tracker):
    def __init__(self, context: TrackerContext, **kwargs: Any):
        super().__init__(context)
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides a crashed run's events after the resumed step.
        purge = {} if context.resume_step is None else {"purge_step": context.resume_step + 1}
        self.writer = SummaryWriter(log_dir=context.logging_dir, **{**kwargs, **purge})

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@register_tracker("stdout")
class StdoutTracker(Tracker):
    """Every metric, one JSON object per step on stdout (for log scrapers; the console line
    shows a few)."""

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        sys.stdout.write(json.dumps({"step": step, **metrics}) + "\n")
        sys.stdout.flush()


@register_tracker("wandb")
class WandbTracker(Tracker):
    """`wandb.init(**tracker_kwargs)`; project defaults to exp_name, files under output_dir.
    Offline: WANDB_MODE=offline or `mode: offline`."""

    def __init__(self, context: TrackerContext, **kwargs: Any):
        super().__init__(context)
        wandb = _import("wandb")
        kwargs.setdefault("project", context.exp_name)
        kwargs.setdefault("name", context.exp_name)
        kwargs.setdefault("dir", context.output_dir)
        kwargs.setdefault("config", context.config)
        self.run = wandb.init(**kwargs)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


@register_tracker("swanlab")
class SwanLabTracker(Tracker):
    """`swanlab.init(**tracker_kwargs)`; project and experiment_name default to exp_name, logs
    under <output_dir>/swanlog. Without a login use `mode: offline` (or local / disabled)."""

    def __init__(self, context: TrackerContext, **kwargs: Any):
        super().__init__(context)
        self.swanlab = _import("swanlab")
        kwargs.setdefault("project", context.exp_name)
        kwargs.setdefault("experiment_name", context.exp_name)
        kwargs.setdefault("logdir", os.path.join(context.output_dir, "swanlog"))
        kwargs.setdefault("config", context.config)
        self.run = self.swanlab.init(**kwargs)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.swanlab.finish()


@register_tracker("mlflow")
class MlflowTracker(Tracker):
    """One MLflow run. tracker_kwargs: `tracking_uri` (default MLFLOW_TRACKING_URI, else
    `file:<output_dir>/mlruns`), `experiment_name` (default exp_name), `run_name`, `tags`. The
    resolved config is logged as the artifact config.json. A `file:` store is allowed explicitly
    (MLflow 3 refuses it unless MLFLOW_ALLOW_FILE_STORE is set)."""

    def __init__(self, context: TrackerContext, tracking_uri: Optional[str] = None,
                 experiment_name: Optional[str] = None, run_name: Optional[str] = None,
                 tags: Optional[Dict[str, str]] = None):
        super().__init__(context)
        mlflow = _import("mlflow")
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            "file:" + os.path.abspath(os.path.join(context.output_dir, "mlruns"))
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = experiment_name or context.exp_name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name or context.exp_name,
                                             tags=tags or {}).info.run_id
        self.client.log_dict(self.run_id, context.config, "config.json")

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    # MLflow keys allow letters, digits, _ - . space : / only.
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in key)
