"""The base of every reward worker: what all domains share around their own score.

Per response, in order: a response that stops inside its reasoning (see
`roll_gspo.rewards.unfinished_think`) or fails `format_pattern` scores 0 with status `format`
and is not scored further; the others get the worker's own score (status `ok`, or `error` /
`timeout`, scored 0); then `response_length_penalty_coef * tokens / response_length` is
subtracted from every score. The statuses are counted per domain in the pipeline's metrics.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence

import torch

from roll_gspo.catalog.reward_workers import PACKAGE, REWARD_WORKERS, RewardWorkerKind
from roll_gspo.schema.config import RewardConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import RankWorker
from roll_gspo.rewards import RewardProcess, checked_call, unfinished_think
from roll_gspo.rewards.scoring import Outcome
from roll_gspo.rewards.shaping import length_penalty, matches_format

logger = logging.getLogger("roll_gspo.rewards")


class RewardWorker(RankWorker):
    """Scores (prompt, response, ground truth) triples.

    A subclass either returns a plain reward function from `build_reward_fn` (run in a killable
    child process when `timeout_s` > 0, see `roll_gspo.rewards.scoring`) or overrides
    `score_responses` to score a whole batch its own way (sandbox, judge, reward model).
    """

    #: Raw scores at or above this count as a correct answer (`val/accuracy`); None: no notion
    #: of correct (e.g. a reward model's scores).
    correct_threshold: Optional[float] = 1.0
    #: The catalog's facts of a built-in worker (whether it loads a model, its module), found by the
    #: class name; None for a user's own class. Config checks and placement read the catalog itself,
    #: since they sit below this torch-and-Ray module.
    kind: ClassVar[Optional[RewardWorkerKind]] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = REWARD_WORKERS.get(cls.__name__) if cls.__module__.startswith(PACKAGE) else None

    def __init__(self, reward_cfg: RewardConfig, *, domain: str, dist_env: Dict[str, Any],
                 response_length: Optional[int] = None):
        super().__init__(dist_env)
        self.cfg = reward_cfg
        self.domain = domain
        self.response_length = response_length
        self.reward_fn: Optional[Callable[..., float]] = None
        self.process: Optional[RewardProcess] = None
        self.ready = False
        # Ray restarted this worker after its process died (the role's `max_restarts`): reported
        # once, with the first scores it returns.
        import warnings

        import ray

        self.restart_unreported = False
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:  # in an actor
            with warnings.catch_warnings():  # Ray's own property warns about an API it uses itself
                warnings.simplefilter("ignore")
                self.restart_unreported = bool(ray.get_runtime_context().was_current_actor_reconstructed)

    def setup(self) -> None:
        self.ready = True
        if self.cfg.response_length_penalty_coef and not self.response_length:
            raise ValueError(f"rewards.{self.domain}.response_length_penalty_coef needs the response length "
                             "(the worker was started without `response_length`)")
        self.reward_fn = self.build_reward_fn()
        if self.reward_fn is not None and self.cfg.timeout_s and self.cfg.timeout_s > 0:
            self.process = RewardProcess(self.reward_fn, self.cfg.timeout_s, self.reward_kwargs())

    def build_reward_fn(self) -> Optional[Callable[..., float]]:
        """`fn(prompt, response, ground_truth, **reward_kwargs) -> float`, or None when the
        subclass overrides `score_responses`."""
        raise NotImplementedError

    def reward_kwargs(self) -> dict:
        return dict(self.cfg.reward_kwargs)

    def score_responses(self, prompts: Sequence[str], responses: Sequence[str], truths: Sequence[Any],
                        batch: Batch) -> List[Outcome]:
        """`(score, status, message)` per response."""
        calls = list(zip(prompts, responses, truths))
        if self.process is not None:
            return self.process.score_many(calls)
        kwargs = self.reward_kwargs()
        return [checked_call(self.reward_fn, args, kwargs) for args in calls]

    def compute_scores(self, batch: Batch) -> Batch:
        """batch: the responses' meta (prompt_text, response_text, ground_truth, prompt_ids,
        response_ids, domain, finished) -> tensor `scores` (B,), meta `reward_status`
        ("ok" / "error" / "timeout" / "format") and `reward_correct` (1.0 / 0.0, None when the
        worker has no notion of a correct answer), `reward_metrics` (the named numbers of a
        `ScoreWithMetrics`, else None) and `worker_restarted` (1 on one row when this is a
        restarted worker's first answer)."""
        if not self.ready:  # a restarted worker: Ray re-ran __init__ only
            self.setup()
        prompts, responses, truths = batch["prompt_text"], batch["response_text"], batch["ground_truth"]
        outcomes: List[Optional[Outcome]] = [None] * len(batch)
        to_score = []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            if unfinished_think(prompt, response):
                outcomes[i] = (0.0, "format", "response ends inside its reasoning (no </think>)")
            elif not matches_format(response, self.cfg.format_pattern):
                outcomes[i] = (0.0, "format", "response does not match format_pattern")
            else:
                to_score.append(i)
        if to_score:
            scored = self.score_responses([prompts[i] for i in to_score], [responses[i] for i in to_score],
                                          [truths[i] for i in to_score], batch.select(to_score))
            for i, outcome in zip(to_score, scored):
                outcomes[i] = outcome
        lengths = [len(ids) for ids in batch["response_ids"]] if "response_ids" in batch else \
            [len(str(r)) for r in responses]
        scores, statuses, correct, metrics = [], [], [], []
        for (score, status, message), length in zip(outcomes, lengths):
            metrics.append(getattr(score, "metrics", None))
            if status not in ("ok", "format"):
                logger.warning("reward %s on domain %r: %s (scored 0)", status, self.domain, message)
            correct.append(None if self.correct_threshold is None else float(score >= self.correct_threshold))
            scores.append(score - length_penalty(length, self.response_length or 1,
                                                 self.cfg.response_length_penalty_coef))
            statuses.append(status)
        restarted = [0] * len(scores)
        if self.restart_unreported and restarted:
            restarted[0], self.restart_unreported = 1, False
        return Batch({"scores": torch.tensor(scores, dtype=torch.float32)},
                     {"reward_status": statuses, "reward_correct": correct, "reward_metrics": metrics,
                      "worker_restarted": restarted})

    def close(self) -> None:
        """Stop the reward child process (it also dies with this worker)."""
        if self.process is not None:
            self.process.close()
