"""The run's tasks (`tasks`, roll_gspo.tasks) as specs; their checks are `roll_gspo.config.checks.tasks`'s."""
from __future__ import annotations

import dataclasses
from typing import List

from roll_gspo.schema.config import PipelineConfig
from roll_gspo.tasks import TaskSpec


def task_specs(cfg: PipelineConfig) -> List[TaskSpec]:
    """The run's tasks as `TaskSpec`s (unresolved), in the YAML's order."""
    return [TaskSpec(key=key, **dataclasses.asdict(task)) for key, task in cfg.tasks.items()]
