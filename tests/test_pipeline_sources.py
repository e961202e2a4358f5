"""The trainer loop's seams: rollout sources behind one contract, each pipeline's `make_source`
picking the source of the run plan's rollout mode, rewards as a future started once and awaited
once, and the rollout buffer between source and loop (depth 0: synchronous; depth d: d rollouts
ahead), saved with a checkpoint and restored from it (also from the `next_rollout.pt` of
checkpoints written before the buffer)."""
import os

import pytest
import torch

from pipelines.agent_source import AgentSource
from pipelines.agentic_pipeline import EpisodeSource, PooledEpisodeSource, make_episode_source
from pipelines.checkpoint import NEXT_ROLLOUT_FILE, ROLLOUT_BUFFER_FILE, load_buffered
from pipelines.pools import PoolTally, groups_to_add, split_over_ranks
from pipelines.rlvr_pipeline import PooledPromptGroupSource, PromptGroupSource, make_prompt_group_source
from pipelines.rollout_buffer import RolloutBuffer
from pipelines.sources import RewardFuture, Rollout, RolloutSource
from pipelines.trainer_loop import TrainerLoop
from roll_gspo.builtin.tokenizer import build_tokenizer
from roll_gspo.config import load_config
from roll_gspo.config.plan.run_plan import build_run_plan
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
    assert buffer.batches() == [] and not buffer.in_flight  # nothing generated after the last step


def test_depth_2_keeps_two_rollouts_ahead_each_at_most_two_steps_stale():
    source = StepSource()
    buffer = RolloutBuffer(source, depth=2, last_step=5)
    # Step 1 samples its own and starts steps 2 and 3 with the same weights; each later step starts
    # the one two steps on, with the weights of the step before it.
    assert _steps(buffer, source, [1, 2, 3, 4, 5]) == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 2)]
    assert source.calls == [("produce", 1), ("start", 2), ("start", 3), ("finish", 2), ("finish", 3),
                            ("start", 4), ("finish", 4), ("start", 5), ("finish", 5)]
    assert buffer.batches() == [] and not buffer.in_flight


def test_a_depth_2_buffer_resumes_with_both_rollouts_it_held(tmp_path):
    whole = StepSource()
    uninterrupted = _steps(RolloutBuffer(whole, depth=2, last_step=5), whole, [1, 2, 3, 4, 5])
    source = StepSource()
    buffer = RolloutBuffer(source, depth=2, last_step=5)
    _steps(buffer, source, [1, 2])  # the checkpoint of step 2 holds steps 3 and 4
    saved = buffer.batches()
    assert [int(b["step"][0]) for b in saved] == [3, 4]
    torch.save(saved, os.path.join(tmp_path, ROLLOUT_BUFFER_FILE))
    resumed_source = StepSource()
    resumed_source.version = 2
    resumed = RolloutBuffer(resumed_source, depth=2, last_step=5)
    resumed.restore(load_buffered(str(tmp_path)))
    assert _steps(resumed, resumed_source, [3, 4, 5]) == uninterrupted[2:]
    assert resumed_source.calls == [("start", 5), ("finish", 5)]  # 3 and 4 came from the checkpoint


def test_a_negative_depth_is_refused():
    with pytest.raises(ValueError, match="depth -1"):
        RolloutBuffer(StepSource(), depth=-1, last_step=3)


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
    for source in (PromptGroupSource, EpisodeSource, AgentSource):
        assert issubclass(source, RolloutSource) and not issubclass(source, TrainerLoop)
    assert not issubclass(EpisodeSource, PromptGroupSource) and not issubclass(PromptGroupSource, EpisodeSource)
    assert not issubclass(AgentSource, EpisodeSource)  # it holds EpisodeSamples, as EpisodeSource does
    assert not issubclass(TrainerLoop, RolloutSource)


@pytest.mark.parametrize("ratio, pooled", [(0, False), (1, False), (2, True)])
def test_make_source_picks_the_rlvr_source_of_the_plans_mode(ratio, pooled):
    cfg = load_config("example_gspo.yaml", [f"async_generation_ratio={ratio}"])
    plan = build_run_plan(cfg)
    source = make_prompt_group_source(cfg, build_tokenizer(), plan)
    assert type(source) is (PooledPromptGroupSource if pooled else PromptGroupSource)
    if pooled:
        assert source.pools.staleness_bound == plan.staleness_bound == 2


@pytest.mark.parametrize("ratio, pooled", [(0, False), (1, False), (2, True)])
def test_make_source_picks_the_agentic_source_of_the_plans_mode(ratio, pooled):
    cfg = load_config("example_agentic.yaml", [f"async_generation_ratio={ratio}"])
    source = make_episode_source(cfg, build_tokenizer(), build_run_plan(cfg))
    assert type(source) is (PooledEpisodeSource if pooled else EpisodeSource)
    assert (source.pool_states() is not None) == pooled  # only a pooled source holds work between steps


def test_only_a_scoring_to_wait_for_is_a_reward_phase():
    timings = {}
    RewardFuture.ready().result(timings)  # the environments' rewards: nothing to wait for
    assert timings == {}
    RewardFuture(lambda: None, lambda pending: {}).result(timings)
    assert set(timings) == {"reward"}


def test_a_pool_keeps_its_batches_of_its_own_quota_in_flight():
    assert groups_to_add(2, 3, held=0) == 6 and groups_to_add(2, 3, held=4) == 2 and groups_to_add(2, 3, held=7) == 0
    assert groups_to_add(1.5, 3, held=0) == 5  # a fractional pool rounds up
    assert split_over_ranks(5, 2) == [3, 2] and split_over_ranks(1, 3) == [1, 0, 0]


def test_the_pool_tally_counts_drops_across_advances():
    tally = PoolTally()
    counts = {"dropped_past_bound": 2, "continuations": 3, "reprefill_tokens": 40, "new_groups": 4, "complete": 4}
    first = tally.metrics(5, counts)
    assert first == {"rollout/partial_groups": 5.0, "rollout/dropped_past_bound": 2.0,
                     "rollout/dropped_past_bound_total": 2.0, "rollout/continuations": 3.0,
                     "rollout/reprefill_tokens": 40.0, "rollout/new_groups": 4.0}
    assert tally.metrics(1, {**counts, "dropped_past_bound": 1})["rollout/dropped_past_bound_total"] == 3.0
