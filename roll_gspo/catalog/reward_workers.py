"""The built-in reward workers by class name, each with the facts config checks and placement ask.

The classes live in `roll_gspo.workers.rewards` (Ray actors, torch); this table is what the layers
below them read instead of matching class names: whether a worker loads a model (so a
`device_mapping` can place it and its attention kernel matters), which module holds it (the
package imports the heavier ones on first use), and its name in the `worker_cls` help. A worker
class finds its entry by name (`RewardWorker.kind`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

PACKAGE = "roll_gspo.workers.rewards"


@dataclass(frozen=True)
class RewardWorkerKind:
    """A built-in reward worker: `module` under `PACKAGE`; `loads_model`: it loads a judge or reward
    model (and may use GPUs); `listed`: offered by name where a ROLL class has no counterpart here
    (the task worker is named by `tasks` instead)."""
    name: str
    module: str
    loads_model: bool
    listed: bool = True

    @property
    def path(self) -> str:
        """The class path a YAML's `worker_cls` names."""
        return f"{PACKAGE}.{self.name}"


REWARD_WORKERS: Dict[str, RewardWorkerKind] = {k.name: k for k in (
    RewardWorkerKind("MathRuleRewardWorker", "rule", False),
    RewardWorkerKind("RegexMatchRewardWorker", "rule", False),
    RewardWorkerKind("FunctionRewardWorker", "rule", False),
    RewardWorkerKind("MultipleChoiceRewardWorker", "rule", False),
    RewardWorkerKind("CodeSandboxRewardWorker", "code_sandbox", False),
    RewardWorkerKind("LLMJudgeRewardWorker", "llm_judge", True),
    RewardWorkerKind("RewardModelWorker", "reward_model", True),
    RewardWorkerKind("IFEvalRewardWorker", "ifeval", False),
    RewardWorkerKind("TaskRewardWorker", "task", False, listed=False),
)}


def kind_of(worker_cls: str) -> Optional[RewardWorkerKind]:
    """The built-in kind a `worker_cls` names by its class name (a subclass elsewhere: None)."""
    return REWARD_WORKERS.get(str(worker_cls).rpartition(".")[2])


def model_workers() -> Tuple[str, ...]:
    """The names of the workers that load a model."""
    return tuple(k.name for k in REWARD_WORKERS.values() if k.loads_model)


def loads_model(worker_cls: str) -> bool:
    """Whether the worker a `worker_cls` names loads a judge or reward model."""
    kind = kind_of(worker_cls)
    return kind is not None and kind.loads_model


def help_text() -> str:
    """The `worker_cls` help: every built-in worker (what each scores: the doc it links)."""
    return (f"The worker's class path; built in, under `{PACKAGE}`: "
            + ", ".join(f"`{k.name}`" for k in REWARD_WORKERS.values())
            + " ([data_and_rewards.md](data_and_rewards.md#reward-workers)).")
