"""The reward of a task's rows (`tasks.<key>`, roll_gspo.tasks): the task's own scorer on the
extracted answer, plus the task's format term."""
from __future__ import annotations

from roll_gspo.distributed.batch import Batch
from roll_gspo.tasks import score_reply
from roll_gspo.workers.rewards.base import RewardWorker


class TaskRewardWorker(RewardWorker):
    """Scores a task's row with `roll_gspo.tasks.score_reply`: 1 when the reply's extracted answer
    (no format needed) is correct by the task's own `score_answer` (reasoning-gym's, or the
    built-in rule), else 0, plus `tasks.<key>.format_weight` when the reply wrote one
    `<answer>...</answer>`. reasoning-gym's part payment for a near miss counts only with
    `tasks.<key>.partial_credit`. A reply counts as correct (`val/<task>/accuracy`) by the same
    verdict, format or not; each reply reports `accuracy`, `format_rate`, `answer_score` (the
    task's own score) and `truncated` (`reward/<task>/...`).

    A reply cut at `response_length` (no end-of-sequence token) is scored like any other, by the
    task's own rule on what it wrote (reasoning-gym scores a missing or partial answer itself); its
    `truncated` metric is 1, so a task whose replies run out of room shows it per task."""

    def build_reward_fn(self):
        try:  # imported here (about 2 s), so the forked reward process and its restarts inherit it
            import reasoning_gym  # noqa: F401
        except ImportError:  # only built-in tasks can be scored then; the config check said so
            pass
        return score_reply

    def compute_scores(self, batch: Batch) -> Batch:
        scored = super().compute_scores(batch)
        # Correct is the task's verdict on the answer, not the reward (which adds the format term).
        scored.meta["reward_correct"] = [
            metrics["accuracy"] if metrics and "accuracy" in metrics else (0.0 if status != "ok" else correct)
            for metrics, status, correct in zip(scored["reward_metrics"], scored["reward_status"],
                                                scored["reward_correct"])]
        # `finished` comes from the rollout engine (absent when a caller scores bare texts).
        finished = batch["finished"] if "finished" in batch else [True] * len(batch)
        for metrics, done in zip(scored["reward_metrics"], finished):
            if metrics is not None:
                metrics["truncated"] = float(not done)
        return scored
