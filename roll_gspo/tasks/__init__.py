"""Tasks: prompts plus the reward that scores replies to them, registered once per source.

`sources`: where tasks come from (reasoning-gym's generators, the built-in ones);
`task`: a run's task (`TaskSpec`), its rows and the one reply scorer (`score_reply`);
`sample_metrics`: pass@k and maj@k, for validation and the evaluation command.
"""
from roll_gspo.tasks.sample_metrics import (answer_spread, grouped_sample_metrics, pass_at_k, reference_answer,
                                            sample_metrics)
from roll_gspo.tasks.sources import SOURCES, TaskSource, register_source, resolve_task
from roll_gspo.tasks.task import TaskSpec, score_reply, spec_problems, task_rows, write_task_data

__all__ = ["SOURCES", "TaskSource", "TaskSpec", "answer_spread", "grouped_sample_metrics", "pass_at_k",
           "reference_answer", "register_source", "resolve_task", "sample_metrics", "score_reply", "spec_problems", "task_rows", "write_task_data"]
