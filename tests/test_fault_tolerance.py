"""Replacing ranks that die or hang (`fault_tolerance`): the rules without Ray (restart budget, hang
verdicts, auto resume, which runs replace their rollout ranks, the config checks), then the Ray
mechanics on small actors (no model, a few seconds): a rank killed with kill -9 or frozen with
SIGSTOP mid-call is replaced and its call answered by the new process, one death past the budget
stops the cluster with the reason; a reward worker hung past its deadline is killed, restarted and its shard
scored again. The whole pipeline's case (kill -9 of the vLLM rank mid-run) is
tests/test_resume_chaos.py's."""
import os
import signal
import time

import pytest
import ray

from roll_gspo.distributed.cluster import RankWorker
from roll_gspo.distributed.fault_tolerance import (HangWatch, RestartBudget, auto_resume_checkpoint,
                                                   probe_interval_s, replaceable_rollout)


# -- rules, no Ray --------------------------------------------------------------------------------------
def test_restart_budget_counts_per_rank_and_reports_each_restart_once():
    budget = RestartBudget(max_restarts=2)
    assert budget.allows("actor_infer", 0)
    assert budget.record("actor_infer", 0) == 1 and budget.record("actor_infer", 0) == 2
    assert not budget.allows("actor_infer", 0) and budget.allows("actor_infer", 1)
    assert budget.metrics(["actor_infer"]) == {"fault/restarts/actor_infer": 2.0}
    assert budget.metrics(["actor_infer"]) == {"fault/restarts/actor_infer": 0.0}  # reported once
    assert "replaced 2 times already" in budget.exhausted_sentence("actor_infer", 0)
    assert "max_restarts = 2" in budget.exhausted_sentence("actor_infer", 0)
    assert not RestartBudget(0).allows("actor_infer", 0)
    assert "off" in RestartBudget(0).exhausted_sentence("actor_infer", 0)


def test_a_slow_engine_is_not_hung_a_stuck_or_silent_one_is():
    slow = HangWatch(timeout_s=10, started=0.0, progress_at=0.0)
    for t in range(0, 60, 4):  # answers every probe, one more step each time: slow, never hung
        slow.probe_sent(t)
        slow.answered(t + 1, steps=t, in_flight=8)
        assert slow.verdict(t + 1) is None
    stuck = HangWatch(timeout_s=10, started=0.0, progress_at=0.0)
    for t in range(0, 30, 4):  # answers, but its step counter stays: hung once 10 s passed
        stuck.probe_sent(t)
        stuck.answered(t + 1, steps=5, in_flight=8)
    assert "held 8 requests while its engine took no step for fault_tolerance.hang_timeout_s = 10 s" in stuck.verdict(29)
    idle = HangWatch(timeout_s=10, started=0.0, progress_at=0.0)  # no requests: a load or a score call, not hung
    idle.answered(1, steps=5, in_flight=0)
    idle.answered(25, steps=5, in_flight=0)
    assert idle.verdict(25) is None
    silent = HangWatch(timeout_s=10, started=0.0, progress_at=0.0)
    silent.probe_sent(1)
    assert silent.verdict(10.5) is None
    assert "did not answer a health probe" in silent.verdict(11.5)
    assert probe_interval_s(300) == 10 and probe_interval_s(2) == 0.5


def test_auto_resume_only_after_a_rank_death_within_the_limit_from_a_checkpoint():
    assert auto_resume_checkpoint(True, 0, 2, ["ckpt/step_2", "ckpt/step_4"]) == "ckpt/step_4"
    assert auto_resume_checkpoint(True, 2, 2, ["ckpt/step_4"]) is None  # limit reached
    assert auto_resume_checkpoint(True, 0, 0, ["ckpt/step_4"]) is None  # off
    assert auto_resume_checkpoint(True, 0, 2, []) is None  # nothing to resume from
    assert auto_resume_checkpoint(False, 0, 2, ["ckpt/step_4"]) is None  # restarts exhausted, a memory kill


def test_which_runs_replace_their_rollout_ranks(tmp_path):
    from tests.config_helpers import load

    assert replaceable_rollout(load(tmp_path))
    assert not replaceable_rollout(load(tmp_path, overrides=["fault_tolerance.max_restarts=0"]))
    assert not replaceable_rollout(load(tmp_path, overrides=["rollout_endpoint.enabled=true"]))
    from tests.test_agentic_e2e import small_config

    assert replaceable_rollout(small_config(tmp_path / "agentic"))  # synchronous: turns sent again
    assert not replaceable_rollout(small_config(tmp_path / "ahead", async_generation_ratio=1))  # played beside training


@pytest.mark.parametrize("override, expected", [
    ("fault_tolerance.max_restarts=-1", "fault_tolerance.max_restarts = -1 is refused: an integer >= 0"),
    ("fault_tolerance.hang_timeout_s=0", "fault_tolerance.hang_timeout_s = 0.0 is refused: seconds > 0"),
    ("fault_tolerance.reward_timeout_s=-5", "fault_tolerance.reward_timeout_s = -5.0 is refused: seconds > 0"),
    ("fault_tolerance.auto_resume_on_failure=-2", "auto_resume_on_failure = -2 is refused"),
])
def test_fault_tolerance_refusals(tmp_path, override, expected):
    from tests.config_helpers import problems

    assert expected in problems(tmp_path, overrides=[override])


def test_auto_resume_without_checkpoints_warns(tmp_path):
    from roll_gspo.config import validate_config
    from tests.config_helpers import load

    cfg = load(tmp_path, overrides=["fault_tolerance.auto_resume_on_failure=2", "save_steps=0"])
    assert any("save_steps = 0 writes one only at the end" in w for w in validate_config(cfg))


def test_a_replaced_ranks_pool_continues_exactly_from_the_copy_of_its_last_advance():
    """k >= 2: the rank's pool as its last advance left it (what `advance(with_state=True)` hands the
    driver) given to a fresh engine, and the same advance sent again, returns what the lost rank's
    advance would have: the same groups, tokens, log-probs and counts."""
    from roll_gspo.strategies.engine import Sampling
    from roll_gspo.strategies.request_pool import RequestPool
    from tests.test_async_dynamic_sampling import StepEngine

    rows = [{"prompt_ids": [5, 6, i], "sample_seed": 11 * i, "ground_truth": str(i)} for i in range(6)]
    sampling = Sampling(max_new_tokens=4)
    lost = RequestPool(StepEngine())
    lost.advance(rows[:4], 2, step=1, bound=2, sampling=sampling, n=2)
    copy = lost.state()  # what the driver keeps
    assert copy["held"], "the first advance holds groups for the second"
    want = lost.advance(rows[4:], 2, step=2, bound=2, sampling=sampling, n=2)
    replacement = RequestPool(StepEngine())
    replacement.load_state(copy)
    got = replacement.advance(rows[4:], 2, step=2, bound=2, sampling=sampling, n=2)
    assert [(g.key, [r.token_ids for r in g.requests], [r.log_probs for r in g.requests]) for g in got[0]] == \
        [(g.key, [r.token_ids for r in g.requests], [r.log_probs for r in g.requests]) for g in want[0]]
    assert got[1] == want[1] and replacement.state() == lost.state()


# -- Ray: small actors --------------------------------------------------------------------------------------
class Rank(RankWorker):
    """A rank with an 'engine' that steps while it works (or freezes on `hang`), and the health
    probe the replaceable cluster asks (as ActorInferWorker's)."""

    ray_concurrency_groups = {"health": 1}

    def __init__(self, *, dist_env):
        super().__init__(dist_env)
        self.steps, self.in_flight, self.given = 0, 0, None

    @ray.method(concurrency_group="health")
    def health(self):
        return self.steps, self.in_flight

    def give(self, value):
        self.given = value

    def work(self, value, seconds):
        """Steps for `seconds`, then answers (value, what a hook gave it, its pid)."""
        self.in_flight = 1
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.steps += 1
            time.sleep(0.01)
        self.in_flight = 0
        return value, self.given, os.getpid()

    def hang(self, value):
        """Holds a request and takes no step: hung (the probe still answers)."""
        self.in_flight = 1
        time.sleep(3600)


def replaceable(ray_session, world_size=2, max_restarts=2, hang_timeout_s=2.0):
    from roll_gspo.distributed.replaceable import ReplaceableCluster

    cluster = ReplaceableCluster("test_rollout", Rank, world_size, 0.1, 0, budget=RestartBudget(max_restarts),
                                 hang_timeout_s=hang_timeout_s)
    ray_session.get(cluster.setup_async())
    given = []

    def hook(rank, worker):
        ray_session.get(worker.give.remote(f"weights for rank {rank}"))
        given.append(rank)
        return "weights given"

    cluster.on_replaced.append(hook)
    return cluster, given


def pid_of(ray_session, cluster, rank):
    return ray_session.get(cluster.workers[rank].whereabouts.remote())[1]


@pytest.mark.e2e
def test_a_killed_or_frozen_rank_is_replaced_and_its_calls_answered(ray_session, caplog):
    from roll_gspo.distributed.cluster import RestartsExhaustedError

    cluster, given = replaceable(ray_session)
    try:
        old = [pid_of(ray_session, cluster, rank) for rank in (0, 1)]
        # kill -9 of rank 1 while both work: rank 1's call is answered by its new process.
        calls = [cluster.call_async(rank, "work", f"prompt {rank}", 3.0) for rank in (0, 1)]
        time.sleep(1.0)
        os.kill(old[1], signal.SIGKILL)
        (v0, g0, p0), (v1, g1, p1) = cluster.gather(calls)
        assert (v0, g0, p0) == ("prompt 0", None, old[0])  # untouched
        assert v1 == "prompt 1" and g1 == "weights for rank 1" and p1 not in old and given == [1]
        assert cluster.budget.metrics([cluster.name]) == {"fault/restarts/test_rollout": 1.0}
        assert any("role test_rollout rank 1" in r.message and "died" in r.message
                   and "replaced in its placement bundle (restart 1 of 2" in r.message for r in caplog.records)
        # SIGSTOP of rank 0: it stops answering its probes; killed and replaced within the deadline.
        call = cluster.call_async(0, "work", "again", 1.0)
        os.kill(old[0], signal.SIGSTOP)
        ((value, _, pid),) = cluster.gather([call])
        assert value == "again" and pid != old[0] and given == [1, 0]
        assert any("did not answer a health probe" in r.message for r in caplog.records)
        # A rank that answers but whose engine takes no step while it holds a request: hung too.
        # Its replacement hangs again on the same call: rank 1's budget runs out, the run stops.
        replaced_pid = pid_of(ray_session, cluster, 1)
        frozen = cluster.call_async(1, "hang", "x")
        with pytest.raises(RestartsExhaustedError) as error:
            cluster.gather([frozen])
        message = str(error.value)
        assert replaced_pid not in old
        assert message.startswith("role test_rollout rank 1 (node ") and " is unresponsive (not dead): stopped answering: it held 1 " \
            "requests while its engine took no step" in message
        assert "It was replaced 2 times already in this run (fault_tolerance.max_restarts = 2)" in message
        assert "The run stops; its last complete checkpoint is intact" in message
        assert cluster.workers == []  # every rank stopped
    finally:
        cluster.shutdown()


@pytest.mark.e2e
def test_calls_awaited_on_their_own_are_sent_again_to_a_replaced_rank(ray_session):
    """`submit` (the agentic pipeline's turns, each awaited on its own): the cluster's watcher
    replaces a rank killed while it works, or frozen, and the call's future gets the new process's
    answer; past the budget the futures fail with the reason."""
    from roll_gspo.distributed.cluster import RestartsExhaustedError

    cluster, given = replaceable(ray_session, max_restarts=1)
    try:
        old = [pid_of(ray_session, cluster, rank) for rank in (0, 1)]
        turns = [cluster.submit(rank, "work", f"turn {rank}", 2.0) for rank in (0, 1)]
        time.sleep(0.5)
        os.kill(old[1], signal.SIGKILL)
        (v0, g0, p0), (v1, g1, p1) = [turn.result(timeout=120) for turn in turns]
        assert (v0, g0, p0) == ("turn 0", None, old[0])  # untouched
        assert v1 == "turn 1" and g1 == "weights for rank 1" and p1 not in old and given == [1]
        turn = cluster.submit(0, "work", "again", 1.0)
        os.kill(old[0], signal.SIGSTOP)  # no answer to its probes: killed and replaced
        value, _, pid = turn.result(timeout=120)
        assert value == "again" and pid != old[0] and given == [1, 0]
        assert cluster.budget.metrics([cluster.name]) == {"fault/restarts/test_rollout": 2.0}
        with pytest.raises(RestartsExhaustedError, match=r"is unresponsive \(not dead\): stopped answering: it held 1 requests"):
            cluster.submit(1, "hang", "x").result(timeout=120)  # rank 1's one restart is spent
        assert cluster.workers == []
        with pytest.raises(RestartsExhaustedError):  # a later call gets the reason, too
            cluster.submit(0, "work", "late", 0.1).result(timeout=10)
    finally:
        cluster.shutdown()


@pytest.mark.e2e
def test_a_hung_reward_worker_is_killed_and_its_shard_scored_again(ray_session, tmp_path, caplog):
    from pipelines.reward_scoring import RewardScorer
    from roll_gspo.distributed.batch import Batch
    from roll_gspo.distributed.cluster import Cluster
    from roll_gspo.schema.config import FaultToleranceConfig, RewardConfig
    from roll_gspo.workers.rewards import FunctionRewardWorker

    marker = str(tmp_path / "hung")
    reward = RewardConfig(worker_cls="roll_gspo.workers.rewards.FunctionRewardWorker",
                          reward_fn="tests.reward_fns:hangs_once", reward_kwargs={"marker": marker}, timeout_s=0)
    cluster = Cluster("reward_math", FunctionRewardWorker, 1, 0.1, 0, init_args=(reward,),
                      init_kwargs={"domain": "math", "response_length": 8}, max_restarts=2)
    ray_session.get(cluster.setup_async())
    try:
        scorer = RewardScorer({"math": cluster}, {"math": "math"},
                              FaultToleranceConfig(reward_timeout_s=8.0, max_restarts=2))  # a restart (a new process) fits under load
        batch = Batch(meta={"prompt_text": ["1+1="] * 3, "response_text": ["2", "x3", "44"],
                            "ground_truth": ["2"] * 3, "domain": ["math"] * 3, "response_ids": [[1], [2], [3]]})
        scorer.score(batch)
        assert os.path.exists(marker)  # it did hang once
        assert batch["scores"].tolist() == [1.0, 0.5, 1.0] and batch["reward_status"] == ["ok"] * 3
        metrics = scorer.metrics(batch)
        assert metrics["reward/worker_restarts"] == 1.0 and metrics["fault/restarts/reward_math"] == 1.0
        assert any("reward worker reward_math rank 0 restarted (its call ran past fault_tolerance.reward_timeout_s"
                   in r.message for r in caplog.records)
        hung = [r.message for r in caplog.records if "is hung" in r.message]  # said at the deadline, before the restart
        assert hung == ["reward worker reward_math rank 0 is hung: its call ran past fault_tolerance.reward_timeout_s "
                        "= 8 s; killed, Ray restarts it and its responses are scored again"], hung
    finally:
        cluster.shutdown()
