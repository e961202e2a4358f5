"""`rewards` role: CPU actors that score responses, one worker class per kind of reward.

Name one in `rewards.<domain>.worker_cls`; subclass `RewardWorker` for a custom one. A reward
that raises, returns a non-number, overruns `timeout_s` (and is killed) or fails the format
check scores 0 and is counted per domain (`reward/<domain>/errors`, `.../timeouts`,
`.../format`); the run goes on.
"""
from roll_gspo.workers.rewards.base import RewardWorker
from roll_gspo.workers.rewards.rule import (FunctionRewardWorker, MathRuleRewardWorker, MultipleChoiceRewardWorker,
                                            RegexMatchRewardWorker)

from roll_gspo.catalog.reward_workers import PACKAGE, REWARD_WORKERS

# The workers outside `rule` (the catalog names their modules) import on first use.
_LAZY = {kind.name: f"{PACKAGE}.{kind.module}" for kind in REWARD_WORKERS.values() if kind.module != "rule"}


def __getattr__(name):  # heavier workers import on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RewardWorker", "MathRuleRewardWorker", "RegexMatchRewardWorker", "FunctionRewardWorker",
           "MultipleChoiceRewardWorker", *_LAZY]
