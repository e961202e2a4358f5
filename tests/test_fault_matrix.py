"""Nothing hangs unseen (issue 57): the phase deadline's rule without Ray; on two small Ray actors a
rank stopped with SIGSTOP mid-call is reported unresponsive (not dead) at its bound, naming its peer
that answers, while a slow rank that answers is left alone; the fault matrix benchmark's verdicts; and
the suite's cell of the matrix on the real pipeline: a training rank stopped while it trains ends the
run within its bound, one line naming role, rank, phase and the resume command, the last checkpoint
intact (`benchmarks/bench_fault_matrix.py --quick`)."""
import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest

from roll_gspo.distributed.cluster import HealthProbed, RankWorker
from roll_gspo.distributed.fault_tolerance import PhaseDeadline, hung_message, phase_of

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fault_matrix.py"


def bench():
    spec = importlib.util.spec_from_file_location("bench_fault_matrix", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- rules, no Ray --------------------------------------------------------------------------------------
def test_phase_deadline_is_the_runs_own_timing_with_a_floor():
    deadline = PhaseDeadline(factor=10, floor_s=5, first_s=300)
    assert deadline.bound("setup") is None  # an actor may still be starting
    seconds, how = deadline.bound("train_step")
    assert seconds == 300 and "no earlier train_step" in how
    for took in (0.2, 0.3, 9.0):  # median 0.3 s: 10 x 0.3 = 3 s, below the floor
        deadline.record("train_step", took)
    seconds, how = deadline.bound("train_step")
    assert seconds == 5 and "phase_timeout_floor_s = 5" in how and "median train_step of this run, 0.3 s" in how
    for took in (2.0, 2.0, 2.0):  # median 2 s: 20 s
        deadline.record("train_step", took)
    assert deadline.bound("train_step")[0] == 20
    assert deadline.bound("compute_log_probs")[0] == 300  # timed per call
    assert phase_of("train_step") == "train (train_step)" and phase_of("sync_weights_to") == "weight sync (sync_weights_to)"
    line = hung_message("role actor_train rank 1 (node n, pid 7)", "train_step", 25, 21, "20 s", ["rank 0"])
    assert line.startswith("role actor_train rank 1 (node n, pid 7) is unresponsive (stopped or hung, not dead)")
    assert "ran train (train_step) for 25 s" in line and "rank 0 answers (waiting for it)" in line


def test_each_cell_is_aimed_at_a_call_this_config_runs():
    """example_gspo takes its old log-probs from vLLM: the training ranks run no compute_log_probs, so
    their log-probs cells signal at the nearest point; a role idle in validation (before step 0) is
    signalled while vLLM generates the validation replies; a training rank's own calls stay."""
    calls = bench().config_calls(str(BENCH.parents[1] / "examples" / "example_gspo.yaml"), [])
    assert calls["actor_train"]["log-probs"] is None and calls["actor_train"]["train"] == "train_step"
    assert calls["actor_train"]["validation"] == calls["reward"]["validation"] == ("actor_infer", "generate")
    assert calls["actor_infer"]["validation"] == "generate"
    assert bench().config_calls(str(BENCH.parents[1] / "examples" / "example_gspo.yaml"),
                                ["old_logprob_source=trainer"])["actor_train"]["log-probs"] == "compute_log_probs"


def test_fault_matrix_verdicts_and_markdown(tmp_path, capsys):
    module = bench()
    assert module.parse_cell("actor_train:weight-sync:stop") == ("actor_train", "weight sync", "stop")
    with pytest.raises(SystemExit, match="role:phase:signal"):
        module.parse_cell("actor_train:train")
    with pytest.raises(SystemExit, match="phase one of"):
        module.parse_cell("actor_train:sleeping:stop")
    good = {"cell": "a", "role": "actor_train", "phase": "train", "signal": "stop", "outcome": "clean exit",
            "detect_s": 4.0, "bound_s": 14.0, "within_bound": True, "checkpoint": "step 2", "rank": 1,
            "names": {"role": True, "rank": True, "phase": True, "resume": True},
            "error_line": "error: role actor_train rank 1 (node n, pid 7) is unresponsive (stopped or hung, not dead): "
                          "... ran train (train_step) for 9 s ... Resume with: python run_pipeline.py --config x "
                          "resume_from_checkpoint=auto"}
    assert module.failures({"cells": [good]}) == []
    late = {**good, "cell": "b", "detect_s": 20.0, "within_bound": False}
    hang = {**good, "cell": "c", "outcome": "HANG", "detect_s": None, "within_bound": False}
    vague = {**good, "cell": "d", "names": {**good["names"], "phase": False}}
    broken = {**good, "cell": "e", "checkpoint": "fails: OSError: x"}
    found = module.failures({"cells": [late, hang, vague, broken]})
    assert [f.split(":")[0] for f in found] == ["b", "c", "d", "e"] and "misses ['phase']" in found[2]
    assert module.names_all("error: role actor_train rank 1 ... ran train (train_step) ... Resume with: python "
                            "run_pipeline.py --config x resume_from_checkpoint=auto", "actor_train", 1, "train",
                            "train_step") == {"role": True, "rank": True, "phase": True, "resume": True}
    assert not module.names_all("error: role actor_train rank 1 died: gone. Resume with: python run_pipeline.py",
                                "actor_train", 1, "train", "train_step")["phase"]  # `actor_train` names no phase
    replaced = module.settle({"role": "actor_infer", "phase": "generate", "rank": 0, "bound_s": 35, "line_seen_s": 50.0,
                              "line": "WARNING role actor_infer rank 0 (node n, pid 7) is unresponsive (not dead): ...; "
                                      "replaced in its placement bundle (restart 1 of 3 for this rank, 25.0 s)"})
    assert replaced["detect_s"] == 25.0 and replaced["within_bound"]  # the line comes once the new rank is up
    saved = tmp_path / "m.json"
    saved.write_text(json.dumps({"command": "benchmarks/bench_fault_matrix.py --quick", "date": "d", "machine": "m",
                                 "cells": [good, hang]}))
    assert module.main(["--markdown", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "`benchmarks/bench_fault_matrix.py --quick` on d, m" in out
    assert "| actor_train rank 1 | train | SIGSTOP | clean exit | 4.0 | 14 | yes/yes/yes/yes | step 2 |" in out
    assert "| HANG |" in out


# -- small Ray actors -----------------------------------------------------------------------------------
class Trainer(HealthProbed, RankWorker):
    def __init__(self, dist_env):
        super().__init__(dist_env)

    def work(self, seconds):
        time.sleep(seconds)
        return os.getpid()


@pytest.mark.serial  # a stopped rank and a deadline: a fair share of the CPU
def test_a_stopped_rank_is_unresponsive_not_dead_and_a_slow_one_is_left_alone(ray_session):
    from roll_gspo.distributed.cluster import Cluster, WorkerHungError

    cluster = Cluster("test_train", Trainer, 2, 0.1, 0)
    try:
        pids = cluster.execute_all("whereabouts")
        cluster.bound_waits(PhaseDeadline(factor=2, floor_s=1.0, first_s=1.0))
        assert [pid for _, pid in pids] == cluster.execute_all("work", 1.5)  # slower than its bound, answering
        cluster.execute_all("work", 0.05)
        calls = cluster.execute_all_async("work", 30)
        time.sleep(0.3)
        os.kill(pids[1][1], signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerHungError) as error:
            cluster.gather(calls)
        took = time.monotonic() - started
        message = str(error.value)
        # bound: max(1 s floor, 2 x the median `work`, 0.05..1.5 s) = 1.55 s, plus one probe interval
        assert took < 1.55 + 0.4 + 2, took
        assert message.startswith(f"role test_train rank 1 (node {pids[1][0]}, pid {pids[1][1]}) is unresponsive "
                                  "(stopped or hung, not dead)"), message
        assert "while its role ran work for" in message and "rank 0 answers (waiting for it)" in message
        assert "phase_timeout_factor = 2 x the median work of this run" in message
        assert "The run stops; its last complete checkpoint is intact (resume with resume_from_checkpoint=auto)" \
            in message and "died" not in message  # the CLI adds the whole command (the real-pipeline test below)
        assert cluster.workers == []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pids[1][1]}"):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pids[1][1]}") or open(f"/proc/{pids[1][1]}/stat").read().split()[2] == "Z"
    finally:
        cluster.shutdown()


# -- the real pipeline: the suite's cell of the matrix ---------------------------------------------------
@pytest.mark.e2e
@pytest.mark.chaos
def test_a_training_rank_stopped_while_it_trains_ends_the_run_within_its_bound(tmp_path, tiny_model):
    from tests.test_resume_chaos import config

    module = bench()
    _, path = config(tmp_path, tiny_model, "cell", max_steps=4, save_steps=2)
    args = module.parser().parse_args(["--config", path, "--phase-floor", "5", "--hang-after", "120",
                                       "--catch-s", "30"])
    (cell,) = [module.parse_cell(text) for text in module.QUICK]
    got = module.run_cell(args, cell, str(tmp_path / "runs"))
    assert got["outcome"] == "clean exit" and got["exit_code"] == 1, got
    assert got["caught"] and got["title"].endswith(".train_step"), got
    assert got["within_bound"], got  # max(5 s, 10 x the median step) + one probe interval + 10 s
    assert got["names"] == {"role": True, "rank": True, "phase": True, "resume": True}, got["error_line"]
    assert "unresponsive (stopped or hung, not dead)" in got["error_line"]
    assert got["checkpoint"] == "step 2"
