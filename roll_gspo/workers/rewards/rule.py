"""Rule rewards: math-verify, exact/regex match, a user function, multiple choice."""
from __future__ import annotations

import functools
import logging

from roll_gspo.rewards import load_reward_fn, math_verify_reward, multiple_choice_reward, regex_match_reward
from roll_gspo.workers.rewards.base import RewardWorker

WARM_UP_ANSWERS = ("4c%;5A", "$\\frac{1}{2}$", "\\boxed{x^2+1}", "x = 3.5%")


class MathRuleRewardWorker(RewardWorker):
    """1 when math-verify judges the response's answer equal to the ground truth, else 0."""

    def build_reward_fn(self):
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        # Its first number and first LaTeX answer import sympy and the LaTeX parser (0.2-0.4 s
        # each): paid here, while the models load, and inherited by the forked reward process
        # (and by each one restarted after a timeout).
        for answer in WARM_UP_ANSWERS:
            math_verify_reward("", answer, "1")
        return math_verify_reward


class RegexMatchRewardWorker(RewardWorker):
    """1 when the response (or the regex `pattern`'s capture) equals the ground truth."""

    def build_reward_fn(self):
        return functools.partial(regex_match_reward, pattern=self.cfg.pattern)


class FunctionRewardWorker(RewardWorker):
    """Calls the user function named by `reward_fn` (`pkg.module:function`)."""

    def build_reward_fn(self):
        return load_reward_fn(self.cfg.reward_fn)


class MultipleChoiceRewardWorker(RewardWorker):
    """Multiple choice (ROLL's CrossThinkQA worker): the chosen option letter from `\\boxed{B}`,
    `Answer: B`, `(B)` or a bare `B`, against the ground truth's letter. `reward_type: hard`:
    1/0; `soft`: 0.5 when right but not in `\\boxed{}`."""

    def build_reward_fn(self):
        reward_type = self.cfg.reward_type or "hard"
        if reward_type not in ("hard", "soft"):
            raise ValueError(f"rewards.{self.domain}.reward_type={reward_type!r}: multiple choice takes hard or soft")
        return functools.partial(multiple_choice_reward, reward_type=reward_type)
