"""`rewards` role: CPU actors that score responses, one worker class per kind of reward.

A reward that raises, returns a non-number or exceeds `timeout_s` scores 0 and is counted
(`reward/errors`, `reward/timeouts`); the run goes on. Subclass `RewardWorker` and name it in
`rewards.<domain>.worker_cls` for a custom worker.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict

import torch

from roll_gspo.config.schema import RewardConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import RankWorker
from roll_gspo.rewards import load_reward_fn, math_verify_reward, regex_match_reward, score_many_with_timeout

logger = logging.getLogger("roll_gspo.rewards")
WARM_UP_ANSWERS = ("4c%;5A", "$\\frac{1}{2}$", "\\boxed{x^2+1}", "x = 3.5%")


class RewardWorker(RankWorker):
    """Scores (prompt, response, ground truth) triples with `self.reward_fn`."""

    def __init__(self, reward_cfg: RewardConfig, *, domain: str, dist_env: Dict[str, Any]):
        super().__init__(dist_env)
        self.cfg = reward_cfg
        self.domain = domain
        self.reward_fn = None
        # Ray restarted this worker after its process died (the role's `max_restarts`): reported
        # once, with the first scores it returns.
        import warnings

        import ray

        with warnings.catch_warnings():  # Ray's own property warns about an API it uses itself
            warnings.simplefilter("ignore")
            self.restart_unreported = bool(ray.get_runtime_context().was_current_actor_reconstructed)

    def setup(self) -> None:
        self.reward_fn = self.build_reward_fn()

    def build_reward_fn(self) -> Callable[..., float]:
        raise NotImplementedError

    def compute_scores(self, batch: Batch) -> Batch:
        """batch: the responses' meta (prompt_text, response_text, ground_truth, prompt_ids,
        response_ids, domain, finished) -> tensor `scores` (B,) and meta `reward_status`
        ("ok" / "error" / "timeout"), and `worker_restarted` (1 on one row when this is a restarted
        worker's first answer)."""
        if self.reward_fn is None:  # a restarted worker: Ray re-ran __init__ only
            self.setup()
        calls = list(zip(batch["prompt_text"], batch["response_text"], batch["ground_truth"]))
        outcomes = score_many_with_timeout(self.reward_fn, calls, self.cfg.timeout_s, self.cfg.reward_kwargs)
        scores, statuses = [], []
        for score, status, message in outcomes:
            if status != "ok":
                logger.warning("reward %s on domain %r: %s (scored 0)", status, self.domain, message)
            scores.append(score)
            statuses.append(status)
        restarted = [0] * len(scores)
        if self.restart_unreported and restarted:
            restarted[0], self.restart_unreported = 1, False
        return Batch({"scores": torch.tensor(scores, dtype=torch.float32)},
                     {"reward_status": statuses, "worker_restarted": restarted})


class MathRuleRewardWorker(RewardWorker):
    """1 when math-verify judges the response's answer equal to the ground truth, else 0."""

    def build_reward_fn(self):
        # math-verify warns on every call that its SIGALRM timeout is off in threads; ours applies.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        # Its first number and first LaTeX answer import sympy and the LaTeX parser (0.2-0.4 s
        # each): paid here, while the models load, instead of inside some training step.
        score_many_with_timeout(math_verify_reward, [("", answer, "1") for answer in WARM_UP_ANSWERS],
                                self.cfg.timeout_s)
        return math_verify_reward


class RegexMatchRewardWorker(RewardWorker):
    """1 when the response (or the regex `pattern`'s capture) equals the ground truth."""

    def build_reward_fn(self):
        return functools.partial(regex_match_reward, pattern=self.cfg.pattern)


class FunctionRewardWorker(RewardWorker):
    """Calls the user function named by `reward_fn` (`pkg.module:function`)."""

    def build_reward_fn(self):
        return load_reward_fn(self.cfg.reward_fn)
