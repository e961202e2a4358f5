"""The trainer loop's seams (issue 35, outcome 3): rollout sources behind one contract, rewards as a
future started once and awaited once, and the rollout buffer between source and loop (depth 0:
synchronous; depth 1: one step ahead), saved with a checkpoint and restored from it (also from the
`next_rollout.pt` of checkpoints written before the buffer)."""
import os

import pytest
import torch

from pipelines.agentic_pipeline import EpisodeSource
from pipelines.checkpoint import NEXT_ROLLOUT_FILE, ROLLOUT_BUFFER_FILE, load_buffered
from pipelines.rlvr_pipeline import PromptGroupSource
from pipelines.rollout_buffer import RolloutBuffer
from pipelines.sources import RewardFuture, Rollout, RolloutSource
from pipelines.trainer_loop import TrainerLoop
from roll_gspo.distributed.batch import Batch


class StepSource(RolloutSource):
    """A rollout per step whose batch names the step and the weights (`version`) that sampled it."""

    def __init__(self):
        self.version, self.calls = 0, []

    def connect(self, clusters):
        pass

    def _rollout(self, batch):
        return Rollout(batch, RewardFuture.ready(), {}, weight_versions=list(batch["weight_version"]))

    def produce(self, step, timings):
        self.calls.append(("produce", step))
        return self._rollout(Batch({"step": torch.tensor([step])}, {"weight_version": [self.version]}))

    def start_ahead(self, step):
        self.calls.append(("start", step))
        return step, self.version  # the weights at the start are those that sample it

    def finish_ahead(self, started):
        step, version = started
        self.calls.append(("finish", step))
        return self._rollout(Batch({"step": torch.tensor([step])}, {"weight_version": [version]}))

    def restore(self, batch):
        return self._rollout(batch)

    def advantages(self, batch):
        return torch.zeros(1, 1), {}

    def step_metrics(self, rollout, step_seconds):
        return {}

    def validate(self, step):
        return {}


def _steps(buffer, source, steps):
    """The loop's use of the buffer: take, (train), fill, then the new weights (version = step)."""
    taken = []
    for step in steps:
        rollout = buffer.take(step, {})
        taken.append((int(rollout.batch["step"][0]), rollout.weight_versions[0]))
        buffer.fill({})
        source.version = step
    return taken


def test_depth_0_samples_each_step_with_the_newest_weights():
    source = StepSource()
    buffer = RolloutBuffer(source, depth=0, last_step=3)
    assert _steps(buffer, source, [1, 2, 3]) == [(1, 0), (2, 1), (3, 2)]
    assert source.calls == [("produce", 1), ("produce", 2), ("produce", 3)] and buffer.batches() == []


def test_depth_1_generates_the_next_step_before_this_one_trains():
    source = StepSource()
    buffer = RolloutBuffer(source, depth=1, last_step=3)
    assert _steps(buffer, source, [1, 2, 3]) == [(1, 0), (2, 0), (3, 1)]  # one step stale after the first
    assert source.calls == [("produce", 1), ("start", 2), ("finish", 2), ("start", 3), ("finish", 3)]
    assert buffer.batches() == [] and buffer.in_flight is None  # nothing generated after the last step


def test_the_buffer_is_saved_and_restored(tmp_path):
    source = StepSource()
    buffer = RolloutBuffer(source, depth=1, last_step=3)
    _steps(buffer, source, [1])  # the checkpoint of step 1 holds step 2's rollout
    saved = buffer.batches()
    assert [int(b["step"][0]) for b in saved] == [2]
    torch.save(saved, os.path.join(tmp_path, ROLLOUT_BUFFER_FILE))  # as write_checkpoint does
    resumed_source = StepSource()
    resumed_source.version = 1
    resumed = RolloutBuffer(resumed_source, depth=1, last_step=3)
    resumed.restore(load_buffered(str(tmp_path)))
    assert _steps(resumed, resumed_source, [2, 3]) == [(2, 0), (3, 1)]  # as the uninterrupted run
    assert ("produce", 2) not in resumed_source.calls


def test_a_checkpoint_from_before_the_buffer_still_resumes(tmp_path):
    old = Batch({"step": torch.tensor([5])}, {"weight_version": [3]})
    torch.save(old, os.path.join(tmp_path, NEXT_ROLLOUT_FILE))  # what checkpoints saved before the buffer
    source = StepSource()
    buffer = RolloutBuffer(source, depth=1, last_step=5)
    buffer.restore(load_buffered(str(tmp_path)))
    rollout = buffer.take(5, {})
    assert int(rollout.batch["step"][0]) == 5 and rollout.weight_versions == [3] and source.calls == []
    assert load_buffered(str(tmp_path / "nothing")) == []


def test_rewards_start_once_and_are_awaited_once():
    started, finished = [], []
    future = RewardFuture(lambda: started.append(1) or "calls", lambda pending: finished.append(pending) or {"m": 1.0})
    assert not future.started
    future.start()
    future.start()  # the second pass's start, say: already scoring
    assert started == [1] and future.started
    assert future.result() == {"m": 1.0} and finished == ["calls"]
    with pytest.raises(RuntimeError, match="awaited once"):
        future.result()
    lazy = RewardFuture(lambda: started.append(2), lambda pending: {})
    assert lazy.result() == {} and started == [1, 2]  # awaited before any pass started it: started then
    assert RewardFuture.ready(lambda: {"reward/mean": 0.5}).result() == {"reward/mean": 0.5}


def test_the_sources_share_a_contract_not_a_pipeline():
    for source in (PromptGroupSource, EpisodeSource):
        assert issubclass(source, RolloutSource) and not issubclass(source, TrainerLoop)
    assert not issubclass(EpisodeSource, PromptGroupSource) and not issubclass(PromptGroupSource, EpisodeSource)
    assert not issubclass(TrainerLoop, RolloutSource)


def test_only_a_scoring_to_wait_for_is_a_reward_phase():
    timings = {}
    RewardFuture.ready().result(timings)  # the environments' rewards: nothing to wait for
    assert timings == {}
    RewardFuture(lambda: None, lambda pending: {}).result(timings)
    assert set(timings) == {"reward"}
