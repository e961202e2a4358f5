"""What every pipeline does before and around its step loop."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Dict, Iterable, Sequence

from roll_gspo.schema.config import PipelineConfig


def prepare_models(cfg: PipelineConfig, roles: Sequence[str]) -> PipelineConfig:
    """The config with the roles' built-in model names resolved (built and cached on first use) to
    folders, so every worker loads a plain Hugging Face folder; `cfg` itself is read-only. A reward
    domain's built-in model (a judge or reward model) is built here too: a warm-started built-in's
    builder is registered in this process (pipelines.warm_start), not in the reward worker's."""
    from roll_gspo.builtin.cache import BUILTIN_PREFIX
    from roll_gspo.builtin.models import resolve_model
    from roll_gspo.catalog.reward_workers import loads_model
    from roll_gspo.schema.frozen import replaced

    key = "{}.model_args.model_name_or_path"
    changes = {key.format(role): resolve_model(getattr(cfg, role).model_args.model_name_or_path) for role in roles}
    if cfg.teachers and cfg.uses_teacher():  # ROLL's named teachers
        changes.update({key.format(f"teachers.{name}"): resolve_model(role.model_args.model_name_or_path)
                        for name, role in cfg.teachers.items()})
    for domain, reward in (cfg.rewards or {}).items():
        name = reward.model_args.model_name_or_path
        if loads_model(reward.worker_cls) and isinstance(name, str) and name.startswith(BUILTIN_PREFIX):
            changes[key.format(f"rewards.{domain}")] = resolve_model(name)
    return replaced(cfg, changes)


@contextmanager
def progress_bar(steps: Iterable[int], description: str):
    """A tqdm bar over pipeline steps on a terminal (none when stderr is a file or a pipe, where
    its redraws would be noise); log records are printed above it, never through it."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with tqdm(list(steps), desc=description, unit="step", dynamic_ncols=True, disable=None) as bar, \
            logging_redirect_tqdm([logging.getLogger("roll_gspo")]):
        yield bar


@contextmanager
def timed(timings: Dict[str, float], name: str):
    """Adds the time the block takes to `timings[name]` (a phase may run more than once a step)."""
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
