"""Chaos, end to end on the real stack: a driver killed with kill -9 or stopped with SIGTERM and
resumed gives exactly the numbers of an uninterrupted run (vLLM and hf_infer rollout); a vLLM rank
and a reward worker killed mid-run (in the resumed run of the SIGTERM / kill -9 chain) are replaced
and the run ends with the uninterrupted run's numbers; a training rank killed mid-run resumes
automatically; a disk that fills up during a checkpoint.

Drivers that are killed run as `run_pipeline.py` subprocesses with a private Ray, as a user runs
them; uninterrupted and resumed runs run in this process on the session's Ray."""
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from roll_gspo.lifecycle.checkpoint import ABANDONED_DIR, complete_checkpoints, read_state
from roll_gspo.utils.logging import LOG_DIR_ENV
from tests.test_console import check_console, read_logs
from tests.test_pipeline_e2e import REPO_ROOT_FOR_SUBPROCESS, load_weights, read_metrics, run, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]
HF_INFER = {"strategy_args": {"strategy_name": "hf_infer", "strategy_config": {}}}
# ~1 s steps: a signal sent once a step is logged lands in the next step even on an idle machine.
SLOW_REWARDS = {"math_rule": {"reward_fn": "tests.reward_fns:slow_digit_fraction", "reward_kwargs": {"seconds": 0.05}}}
# The runs in this process (uninterrupted, resumed) get no signal: the same reward without the pause
# (the scores do not depend on it; 0.8 s a step saved).
NO_PAUSE_REWARDS = {"math_rule": {"reward_fn": "tests.reward_fns:slow_digit_fraction", "reward_kwargs": {"seconds": 0.0}}}
WAIT_S = 600  # generous: the machine running the suite may be shared and slow


def comparable(row):
    """A metrics row without what depends on wall-clock time (stalls too) or on processes that died (`fault/*`)."""
    return {k: v for k, v in row.items()
            if not k.startswith(("time/", "throughput/", "fault/", "stall/")) and k != "sync/seconds"}


def row_differences(got, want, ignore=()):
    """The keys on which two steps' comparable rows differ, each with both values ({} when equal): an
    assertion message that names the metric, not a truncated dict."""
    mine = {k: v for k, v in comparable(got).items() if k not in ignore}
    theirs = {k: v for k, v in comparable(want).items() if k not in ignore}
    return {k: (mine.get(k, "<absent>"), theirs.get(k, "<absent>"))
            for k in sorted(set(mine) | set(theirs)) if mine.get(k, "<absent>") != theirs.get(k, "<absent>")}


def config(tmp_path, model, name, **changes):
    folder = tmp_path / name
    folder.mkdir()
    base = dict(max_steps=4, save_steps=2, save_total_limit=2)
    if "rewards" not in changes:
        base["rewards"] = SLOW_REWARDS
    cfg = write_config(folder, model, **{**base, **changes})
    return cfg, str(folder / "config.yaml")


def start_driver(config_path, log_path, *overrides, cache=None):
    """`run_pipeline.py` as a user starts it; `cache`: its own ROLL_GSPO_CACHE (built-in data built there)."""
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a private Ray, as a user's plain run starts
    if cache is not None:
        env["ROLL_GSPO_CACHE"] = cache
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "run_pipeline.py", "--config", config_path, *overrides],
                                cwd=REPO_ROOT_FOR_SUBPROCESS, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for_step(cfg, step, driver, log_path):
    """Wait until metrics.jsonl holds a row of `step` (the driver must still be running)."""
    path = os.path.join(cfg.output_dir, "metrics.jsonl")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as handle:
                steps = [json.loads(line)["step"] for line in handle if line.endswith("\n")]
            if step in steps:
                return
        assert driver.poll() is None, f"driver exited early ({driver.returncode}):\n{open(log_path).read()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no metrics row of step {step} within {WAIT_S} s")


def private_ray_processes(driver):
    return [p for p in psutil.Process(driver.pid).children(recursive=True)]


def assert_all_gone(processes, within_s=60):
    deadline = time.monotonic() + within_s
    alive = processes
    while time.monotonic() < deadline:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.5)
    raise AssertionError(f"processes left running after the driver ended: "
                         f"{[(p.pid, p.name()) for p in alive]}")


def kill_driver_after_step(cfg, config_path, tmp_path, step, *overrides):
    """Start a driver, kill -9 it once `step` is logged; its private Ray must die with it."""
    log = str(tmp_path / f"killed_{step}.log")
    driver = start_driver(config_path, log, *overrides)
    wait_for_step(cfg, step, driver, log)
    processes = private_ray_processes(driver)
    assert any("raylet" in p.name() for p in processes)
    driver.kill()
    driver.wait()
    assert_all_gone(processes)


def check_same_as(reference, cfg, resumed_steps, ignore=()):
    records = read_metrics(cfg)
    assert [r["step"] for r in records] == [r["step"] for r in reference["records"]]
    for got, want in zip(records, reference["records"]):
        assert row_differences(got, want, ignore) == {}, got["step"]
    assert any(r["step"] in resumed_steps for r in records)
    final = load_weights(os.path.join(cfg.output_dir, "final_model"))
    assert final.keys() == reference["weights"].keys()
    for key, value in final.items():
        assert torch.equal(value, reference["weights"][key]), key


def uninterrupted(tmp_path, model, **changes):
    cfg, _ = config(tmp_path, model, "uninterrupted", rewards=NO_PAUSE_REWARDS, **changes)
    records = run(cfg)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    return {"records": records, "weights": load_weights(os.path.join(cfg.output_dir, "final_model"))}


@pytest.fixture(scope="module")
def vllm_reference(tmp_path_factory, tiny_model, ray_session):
    """The uninterrupted vLLM run (4 steps, a checkpoint each) the vLLM chaos runs compare with."""
    return uninterrupted(tmp_path_factory.mktemp("vllm_reference"), tiny_model, save_steps=1)


def wait_for_checkpoint(cfg, step, driver, log_path):
    """Wait until the checkpoint of `step` is complete (the driver must still be running)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if f"step_{step}" in [os.path.basename(p) for p in complete_checkpoints(cfg.output_dir)]:
            return
        assert driver.poll() is None, f"driver exited early ({driver.returncode}):\n{open(log_path).read()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no complete checkpoint of step {step} within {WAIT_S} s")


def test_vllm_sigterm_then_kill9_then_older_resume_match_an_uninterrupted_run(tmp_path, tiny_model, ray_session,
                                                                              vllm_reference, monkeypatch):
    """Four pipeline start-ups: the uninterrupted run (shared), a driver stopped by SIGTERM, a resumed
    driver killed with kill -9, and an explicit resume from an older checkpoint that finishes the run
    (the kill -9 leaves a newer one, moved aside). `auto` after a rank's kill -9 is the hf_infer test's path.
    Two more tests ride on these runs (a pipeline start fewer each):
    - the first driver is a run as a user starts it, with a fresh cache: its console and log folder
      are tests/test_console.py's checks (check_console_of_a_run);
    - the last run loses two processes and still ends at max_steps with exactly the uninterrupted
      run's numbers: the reward worker kills itself in its first step (Ray restarts it; its responses
      are scored again), and kill -9 of the vLLM rank while it generates a later step's responses
      (replaced in its bundle, given the current weights, its prompts generated again with the same
      seeds: the same responses). Counted, one console line each; the numbers (restarts aside) are
      the uninterrupted run's."""
    reference = vllm_reference
    cfg, path = config(tmp_path, tiny_model, "interrupted", save_steps=1)
    # 1. SIGTERM after step 1: the step in progress finishes, a checkpoint is saved, exit 0.
    log = str(tmp_path / "sigterm.log")
    driver = start_driver(path, log, cache=str(tmp_path / "cache"))
    wait_for_step(cfg, 1, driver, log)
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=WAIT_S) == 0, open(log).read()[-3000:]
    output = open(log).read()
    assert re.search(r"stopped by SIGTERM after step \d of 4; checkpoint .*Resume with: .*resume_from_checkpoint=auto",
                     output), output[-3000:]
    stopped_at = read_state(complete_checkpoints(cfg.output_dir)[-1])["step"]
    assert stopped_at in (1, 2) and not os.path.exists(os.path.join(cfg.output_dir, "final_model"))
    check_console_of_a_run(output, os.path.join(cfg.output_dir, "logs"))
    # 2. Resumed (auto), then kill -9 once step 3's checkpoint is complete (step 4 under way);
    #    its private Ray dies with it.
    log = str(tmp_path / "killed_3.log")
    driver = start_driver(path, log, "resume_from_checkpoint=auto")
    wait_for_checkpoint(cfg, 3, driver, log)
    processes = private_ray_processes(driver)
    assert any("raylet" in p.name() for p in processes)
    driver.kill()
    driver.wait()
    assert_all_gone(processes)
    assert not os.path.exists(os.path.join(cfg.output_dir, "final_model"))  # killed mid-run
    assert {"step_2", "step_3"} <= {os.path.basename(p) for p in complete_checkpoints(cfg.output_dir)}
    # 3. An explicit resume from the older step 2, in this process, with save_total_limit 1: step_3
    #    moves aside, and steps 3 and 4 are exactly the uninterrupted run's. Its reward worker kills
    #    itself in step 3 (its first call), and its vLLM rank is killed while it generates step 4.
    marker = str(tmp_path / "reward_worker_died")
    older = write_config(tmp_path / "interrupted", tiny_model, max_steps=4, save_steps=1, save_total_limit=1,
                         rewards={"math_rule": {"reward_fn": "tests.reward_fns:dies_once",
                                                "reward_kwargs": {"marker": marker, "seconds": 0.0}}},
                         resume_from_checkpoint=os.path.join(cfg.output_dir, "checkpoints", "step_2"))
    monkeypatch.delenv(LOG_DIR_ENV, raising=False)  # the run sets it (its ranks' log folder); restored after
    killed: list = []
    watcher = kill_the_rollout_rank_once(marker, killed)
    with console_records() as console:
        records = run_as_the_cli_does(older)
    watcher.join(timeout=5)
    assert killed, "the rollout rank ran no generate call after the reward worker died"
    drop = "reward/worker_restarts"  # counted below
    assert [r["step"] for r in records] == [r["step"] for r in reference["records"]]
    for got, want in zip(records, reference["records"]):
        assert row_differences(got, want, ignore=(drop,)) == {}, got["step"]
    check_same_as(reference, older, resumed_steps={3, 4}, ignore=(drop,))
    (side,) = [n for n in os.listdir(older.output_dir) if ".after_step_2." in n]
    with open(os.path.join(older.output_dir, side)) as handle:
        crashed_rows = [json.loads(line) for line in handle]
    assert row_differences(crashed_rows[0], reference["records"][2]) == {}  # step 3 both times
    assert [os.path.basename(p) for p in complete_checkpoints(older.output_dir)] == ["step_4"]
    aside = os.path.join(older.output_dir, "checkpoints", ABANDONED_DIR)
    assert [os.listdir(os.path.join(aside, branch)) for branch in os.listdir(aside)] == [["step_3"]]
    # The replacements: no step twice, none missing; each restart counted once, in the step that lost
    # the process (the reward worker in step 3, the vLLM rank in a later generate), one console line each.
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    (lost_in,) = [r["step"] for r in records if r["fault/restarts/actor_infer"]]
    assert lost_in >= 3 and sum(r["fault/restarts/actor_infer"] for r in records) == 1
    output = "\n".join(console)
    assert re.search(rf"WARNING role actor_infer rank 0 \(node [\d.]+, pid {killed[0]}\) died: .*; replaced in its "
                     rf"placement bundle \(restart 1 of 3 for this rank, [\d.]+ s\); weights of step {lost_in - 1}\. "
                     rf"Its output: \S+actor_infer-0-{killed[0]}\.log", output), output[-3000:]
    assert re.search(r"WARNING reward worker reward_math_rule rank 0 restarted \(its process died; restart 1 of 3",
                     output), output[-3000:]
    assert [r["reward/worker_restarts"] for r in records] == [r["fault/restarts/reward_math_rule"] for r in records]
    assert os.path.exists(marker) and sum(r["reward/worker_restarts"] for r in records) == 1
    assert [r["step"] for r in records if r["reward/worker_restarts"]] == [3]
    assert all(r["reward/errors"] == 0 for r in records)


def check_console_of_a_run(output, log_dir):
    """The console of a run as a user starts it (run_pipeline.py, private Ray), with a fresh cache so
    it builds its data set: nothing third-party on the console before the first step, no line twice;
    what the libraries printed (Ray, DeepSpeed, vLLM) is in <output_dir>/logs/ (tests/test_console.py's
    checks, on this test's first driver: a pipeline start fewer)."""
    check_console(output)
    assert sum("building task arith" in line for line in output.splitlines()) == 1, output[-3000:]
    logs = read_logs(log_dir)
    driver_log = "".join(text for name, text in logs.items() if name.startswith("driver-"))
    rollout_log = "".join(text for name, text in logs.items() if name.startswith("actor_infer-0-"))
    trainer_logs = [text for name, text in logs.items() if name.startswith("actor_train-")]
    assert "Started a local Ray instance" in driver_log  # Ray
    assert re.search(r"^INFO .*\[\w+\.py:\d+\] ", rollout_log, re.M)  # vLLM's records
    assert len(trainer_logs) == 2
    if not torch.cuda.is_available():  # DeepSpeed's accelerator notice, once per training rank
        assert all("Setting accelerator to CPU" in text for text in trainer_logs)


def kill_the_rollout_rank_once(marker, killed, method="generate"):
    """A thread: once `marker` exists (None: at once), kill -9 of this session's vLLM rank while it
    runs `method` (Ray names the process after the call it runs: `generate` for a rollout,
    `serve_generate` for an agentic turn); its pid goes to `killed`."""
    def watch():
        deadline = time.monotonic() + WAIT_S
        while marker is not None and time.monotonic() < deadline and not os.path.exists(marker):
            time.sleep(0.01)
        while time.monotonic() < deadline:
            for process in psutil.Process().children(recursive=True):
                try:
                    if process.name().startswith("ray::ActorInferWorker") and process.name().endswith(f".{method}"):
                        kill_while_generating(process, within_s=1, method=method)
                        killed.append(process.pid)
                        return
                except (psutil.Error, AssertionError):
                    continue
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def console_records():
    """The records of the project's loggers ("roll_gspo", whose handlers print the console's lines)
    from WARNING up while the block runs, as `LEVEL message` strings."""
    messages: list = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(f"{record.levelname} {record.getMessage()}")

    handler, logger = Collect(logging.WARNING), logging.getLogger("roll_gspo")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def run_as_the_cli_does(cfg):
    """`cfg`'s run as run_pipeline.py starts it, in this process: rank output in <output_dir>/logs."""
    from pipelines import run_pipeline_from_config

    run_pipeline_from_config(cfg)
    return read_metrics(cfg)


# strategy_config null replaces write_config's DeepSpeed block (null means {}).
FSDP2 = {"strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": None}}


@pytest.mark.parametrize("trainer", [FSDP2], ids=["fsdp2"])
def test_hf_infer_training_rank_kill9_auto_resumes_matching_an_uninterrupted_run(tmp_path, tiny_model, ray_session,
                                                                                 trainer, capsys, monkeypatch):
    """kill -9 of a training rank after step 3 (FSDP2, hf_infer rollout): the run stops with the rank
    named, `fault_tolerance.auto_resume_on_failure` resumes it from step 2's checkpoint in the same
    driver, and the metrics and final weights equal an uninterrupted run's, bit for bit (DeepSpeed's
    checkpoints go through kill -9 of the driver in the vLLM test above; `auto` after a kill -9 of
    the driver is the same resolve, and a torn metrics row is test_checkpoint_safety's). The driver is
    the command line's (`roll_gspo.cli.main`) in this process on the session's Ray: it is not killed,
    so it needs no private Ray (a private Ray ending with its killed driver is the vLLM test's)."""
    from roll_gspo.cli import main

    reference = uninterrupted(tmp_path, tiny_model, actor_infer=HF_INFER, actor_train=trainer)
    cfg, path = config(tmp_path, tiny_model, "interrupted", actor_infer=HF_INFER, actor_train=trainer,
                       fault_tolerance={"auto_resume_on_failure": 1})
    monkeypatch.delenv(LOG_DIR_ENV, raising=False)  # the run sets it (its ranks' log folder); restored after
    killed: list = []
    watcher = kill_a_training_rank_after_step(cfg, 3, killed)
    capsys.readouterr()
    assert main(["--config", path]) == 0
    watcher.join(timeout=5)
    assert killed, "no training rank was killed"
    rank, processes = killed
    output = capsys.readouterr().err
    match = re.search(r"error: role actor_train rank \d \(node [\d.]+, pid (\d+)\) died: .*The run stops; its last "
                      r"complete checkpoint is intact", output)
    assert match and int(match.group(1)) == rank.pid, output[-3000:]
    assert re.search(r"auto resume 1 of 1 \(fault_tolerance.auto_resume_on_failure\): resuming from \S+step_2\b",
                     output), output[-3000:]
    check_same_as(reference, cfg, resumed_steps={3, 4})  # steps 3 and 4 once, the resumed run's
    assert len([n for n in os.listdir(cfg.output_dir) if ".after_step_2." in n]) == 1  # the stopped run's step 3
    assert_all_gone(processes)  # the stopped run's ranks, as the resumed run's


def kill_a_training_rank_after_step(cfg, step, killed):
    """A thread: once metrics.jsonl holds a row of `step`, kill -9 of one of this session's training
    ranks; then `killed` holds that process and every rank process of the run at that moment."""
    path = os.path.join(cfg.output_dir, "metrics.jsonl")

    def watch():
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as handle:
                    if step in [json.loads(line)["step"] for line in handle if line.endswith("\n")]:
                        break
            time.sleep(0.2)
        ranks = []
        for process in psutil.Process().children(recursive=True):
            try:
                if process.name().startswith("ray::") and "Worker" in process.name():
                    ranks.append(process)
            except psutil.Error:  # a process that ended meanwhile
                continue
        rank = next(p for p in ranks if p.name().startswith("ray::ActorTrainWorker"))
        rank.kill()
        killed.extend([rank, ranks])

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def wait_until(cfg, driver, log_path, holds, what):
    """Wait until `holds(rows of metrics.jsonl)` (the driver must still be running)."""
    path = os.path.join(cfg.output_dir, "metrics.jsonl")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as handle:
                rows = [json.loads(line) for line in handle if line.endswith("\n")]
            if holds(rows):
                return rows
        assert driver.poll() is None, f"driver exited early ({driver.returncode}):\n{open(log_path).read()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def kill_while_generating(rank, within_s=WAIT_S, method="generate"):
    """kill -9 of a rollout rank while it runs `method` (Ray names the process after the call it runs)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if rank.name().endswith(f".{method}"):
            rank.kill()
            return
        time.sleep(0.005)
    raise AssertionError(f"the rollout rank ran no {method} call within {within_s} s")


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a few MB: room for one checkpoint of the micro model, not for two."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_during_a_checkpoint_is_a_clear_error_and_keeps_the_previous(tmp_path, tiny_model, ray_session,
                                                                               small_disk):
    from roll_gspo.lifecycle.checkpoint import CheckpointError

    cfg = write_config(tmp_path, tiny_model, output_dir=str(small_disk / "out"), max_steps=3, save_steps=1,
                       save_total_limit=1)
    with pytest.raises(CheckpointError) as error:
        run(cfg)
    message = str(error.value)
    # torch.save reports a full disk obscurely ("unexpected pos", "iostream error"): the message says it.
    assert re.search(r"could not write the checkpoint of step 2 under .*: \w+Error: .*The disk looks full: "
                     r"[\d.]+ MiB free", message), message
    assert len(message) < 1000  # the cause, not Ray's whole traceback
    assert "previous checkpoint" in message and "step_1 is intact" in message
    (last,) = complete_checkpoints(cfg.output_dir)
    assert os.path.basename(last) == "step_1" and read_state(last)["step"] == 1
    assert os.listdir(os.path.dirname(last)) == ["step_1"]  # the half-written folder is gone
