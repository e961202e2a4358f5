"""What a `TrainerLoop` trains on and where it comes from: a `Rollout` (one step's samples, their
rewards as a future, the source's metrics, the weight versions that sampled them) and the
`RolloutSource` contract a pipeline's producer of rollouts fulfils (prompt groups for RLVR,
episodes for agentic runs).

A pipeline hands the loop a `MakeSource`: given the run plan, it builds the source of the plan's
rollout mode. Each mode is a component of its own, never a branch inside a source: synchronous and
one step ahead are the loop's `RolloutBuffer` (pipelines.rollout_buffer) over a plain source
(`PromptGroupSource`, `EpisodeSource`); a staleness bound k >= 2 is a pooled source
(`PooledPromptGroupSource`, `PooledEpisodeSource`) over pools (pipelines.pools); an agent's
episodes are `AgentSource`'s (pipelines.agent_source)."""
from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from roll_gspo.distributed.batch import Batch
from roll_gspo.models.causal_lm import build_sequences

from pipelines.common import timed

if TYPE_CHECKING:
    from roll_gspo.config.plan.run_plan import RunPlan
    from roll_gspo.schema.config import PipelineConfig

    from pipelines.setup import RunClusters

_NOT_STARTED = object()


class RewardFuture:
    """A rollout's rewards: scoring starts once (`start` may be called any number of times; the
    loop calls it right after sending its first log-prob pass, so the CPU reward workers score
    meanwhile) and its result is awaited once (`result`: the reward metrics; the scores are in the
    rollout's batch by then)."""

    def __init__(self, start: Optional[Callable[[], Any]], finish: Callable[[Any], Dict[str, float]]):
        self._start, self._finish = start, finish
        self._pending: Any = _NOT_STARTED
        self._awaited = False

    @classmethod
    def ready(cls, metrics: Callable[[], Dict[str, float]] = dict) -> "RewardFuture":
        """Rewards known already (scored while sampling, or the environments'): nothing to start;
        `metrics` is evaluated when the result is awaited."""
        return cls(None, lambda _: metrics())

    @property
    def started(self) -> bool:
        """Whether scoring has been started (always, once the result was awaited)."""
        return self._pending is not _NOT_STARTED

    def start(self) -> None:
        """Start scoring, unless it has been started already."""
        if not self.started:
            self._pending = self._start() if self._start is not None else None

    def result(self, timings: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        """Wait for the scores (starting them if nobody has); returns the reward metrics. Once. The
        wait is `timings["reward"]`: what is left of scoring once the log-prob passes are done
        (rewards known already take no time and add no phase)."""
        if self._awaited:
            raise RuntimeError("a rollout's rewards are awaited once; this one was already")
        self._awaited = True
        scoring = self._start is not None and timings is not None
        with timed(timings, "reward") if scoring else contextlib.nullcontext():
            self.start()
            return self._finish(self._pending)


@dataclasses.dataclass
class Rollout:
    """One step's samples as a source produced them: `batch` holds the trainer's tensors (input_ids,
    attention_mask (B, P+T); prompt_lengths (B,); response_mask, rollout_log_probs (B, T)) and the
    rows' meta; `rewards` fills its `scores` (B,) when awaited."""
    batch: Batch
    rewards: RewardFuture
    metrics: Dict[str, float]  # the source's own: data/* (prompt groups), traj/* (episodes)
    weight_versions: List[int]  # per row: the pipeline step whose weights sampled it
    trainable: bool = True  # False: not one generated token to train on, the step is skipped


class RolloutSource(abc.ABC):
    """Produces what a `TrainerLoop` trains on: one `Rollout` per step, the validation and the
    advantage estimate of its kind of samples, and the state a checkpoint keeps of it."""

    @abc.abstractmethod
    def connect(self, clusters: RunClusters) -> None:
        """The started clusters: the rollout engine (and the reward workers) it samples and scores with."""

    @abc.abstractmethod
    def produce(self, step: int, timings: Dict[str, float]) -> Rollout:
        """`step`'s rollout, sampled now by the rollout engine's current weights."""

    def start_ahead(self, step: int) -> Any:
        """Start sampling `step`'s rollout without waiting for it (a buffer of depth >= 1); returns what
        `finish_ahead` takes."""
        raise NotImplementedError(f"{type(self).__name__} does not generate ahead")

    def finish_ahead(self, started: Any) -> Rollout:
        """Wait for the rollout `start_ahead` started."""
        raise NotImplementedError(f"{type(self).__name__} does not generate ahead")

    def restore(self, batch: Batch) -> Rollout:
        """A rollout generated ahead again from the batch a checkpoint saved of it."""
        raise NotImplementedError(f"{type(self).__name__} does not generate ahead")

    @abc.abstractmethod
    def advantages(self, batch: Batch) -> Tuple[torch.Tensor, Dict[str, float]]:
        """(B, T) advantages of a scored batch (with log-probs, and the critic's `values` for PPO),
        and their metrics."""

    @abc.abstractmethod
    def step_metrics(self, rollout: Rollout, step_seconds: float) -> Dict[str, float]:
        """The source's metrics of a finished step (lengths, throughput, data position)."""

    @abc.abstractmethod
    def validate(self, step: int) -> Dict[str, float]:
        """The `val/*` metrics at `step` (empty when the run has no validation); its samples as
        rollout-file records in `validation_records` (pipelines.rollout_records)."""

    validation_records: List[Dict[str, Any]] = []  # the last validate's samples (read by the loop's writer)

    def pool_states(self) -> Optional[List[Any]]:
        """What a pooled source holds in flight between steps (each rollout rank's request pool, or
        the episode pool); a checkpoint saves it beside the rollouts generated ahead. None: nothing."""
        return None

    def load_pool_states(self, states: Optional[List[Any]]) -> None:
        """Give the rollout ranks back what `pool_states` returned (on resume, before the first rollout)."""

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the source (its prompt sampler, running reward statistics)."""
        return {"sampler": None, "running_stats": None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Back to where `state` (a checkpoint's driver state) was."""


# How a pipeline builds its source: (config, tokenizer, run plan) -> the source of the plan's rollout mode.
MakeSource = Callable[["PipelineConfig", Any, "RunPlan"], RolloutSource]


def add_sequence_tensors(batch: Batch, pad_id: int) -> None:
    """The trainer's tensors of prompts and their responses: input_ids, attention_mask (B, P+T),
    prompt_lengths (B,), response_mask (B, T)."""
    input_ids, attention, prompt_lengths, response_mask = build_sequences(
        batch["prompt_ids"], batch["response_ids"], pad_id)
    batch["input_ids"], batch["attention_mask"] = input_ids, attention
    batch["prompt_lengths"], batch["response_mask"] = prompt_lengths, response_mask
