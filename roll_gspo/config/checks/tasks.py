"""Checks of the `tasks` block (roll_gspo.tasks), before any worker starts: each task exists in its
source and takes its config, sizes and seeds make sense, a reward block of TaskRewardWorker scores
it, and no data file or domain mix competes with the tasks' own."""
from __future__ import annotations

from typing import List

from roll_gspo.config.findings import Finding, error
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.plan.tasks import task_specs
from roll_gspo.tasks import spec_problems

TASK_WORKER = "roll_gspo.workers.rewards.TaskRewardWorker"


@check("check", keys=("tasks", "actor_train.data_args.file_name", "actor_train.data_args.domain_interleave_probs"),
       doc="`tasks`: outside the rlvr pipeline, a task its source does not have or that refuses its config, "
           "sizes and seeds, a reward block that is not a TaskRewardWorker, weights all 0, data files or a domain "
           "mix beside the tasks", name="tasks.problems")
def task_problems(cfg: PipelineConfig, yaml_keys=None) -> List[Finding]:
    """Every problem of `cfg.tasks` (none when it is empty), each naming its key."""
    if not cfg.tasks:
        return []
    if cfg.pipeline != "rlvr":
        return [error("tasks", f"tasks: read by `pipeline: rlvr` only (this is `pipeline: {cfg.pipeline}`)")]
    problems: List[Finding] = []
    for spec in task_specs(cfg):
        path = f"tasks.{spec.key}"
        problems += [error(path, p) for p in spec_problems(spec, path)]
        if spec.key in cfg.rewards:
            problems.append(error(path, f"{path}: the key is also a `rewards` block's name; a task's key names its "
                                        f"rows' domain, so rename the task (its rewards block is `{path}.reward`)"))
        reward = cfg.rewards.get(spec.reward)
        if reward is None:
            problems.append(error(f"{path}.reward", f"{path}.reward = {spec.reward!r}: no such `rewards` block; add "
                                                    f"`rewards: {{{spec.reward}: {{worker_cls: {TASK_WORKER}}}}}`"))
        elif not _is_task_worker(reward.worker_cls):
            problems.append(error(f"{path}.reward", f"{path}.reward = {spec.reward!r}: "
                                                    f"rewards.{spec.reward}.worker_cls is {reward.worker_cls!r}; a "
                                                    f"task's rows are scored by {TASK_WORKER} (or a subclass)"))
    if cfg.tasks and not any(t.weight > 0 for t in cfg.tasks.values()):
        problems.append(error("tasks", "tasks: every task has weight 0, so no training prompt would be drawn"))
    data = cfg.actor_train.data_args
    if data.file_name:
        problems.append(error("actor_train.data_args.file_name", f"actor_train.data_args.file_name = "
                                                                 f"{list(data.file_name)}: with `tasks` the training "
                                                                 f"prompts are the tasks' rows; drop the files (or the "
                                                                 f"tasks)"))
    if data.domain_interleave_probs:
        problems.append(error("actor_train.data_args.domain_interleave_probs",
                              "actor_train.data_args.domain_interleave_probs: with `tasks` the mix is each task's "
                              "`weight` (tasks.<key>.weight)"))
    return problems


def _is_task_worker(path: str) -> bool:
    if path == TASK_WORKER or path.endswith(".TaskRewardWorker"):
        return True
    from roll_gspo.utils.imports import import_object

    try:  # a subclass of its own
        return any(c.__name__ == "TaskRewardWorker" for c in import_object(path).__mro__)
    except Exception:  # noqa: BLE001 - preflight reports an unimportable worker
        return False
