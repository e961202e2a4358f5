"""The console: one line per record whatever the terminal width or when piped; third-party
output (FutureWarnings, Ray's, DeepSpeed's and vLLM's notices, progress bars) kept out of it and in
the run's log folder; no line twice."""
import os
import re
import subprocess
import sys


from roll_gspo.metrics.recorder import MetricsTracker
from tests.conftest import REPO_ROOT

SCRIPT = """
import logging, warnings
from roll_gspo.utils.logging import setup_logging, use_log_dir
setup_logging()
use_log_dir({log_dir!r})
logging.getLogger("roll_gspo").info("step 1/2 | " + " | ".join(f"metric_{{i}} {{i}}.25" for i in range(40)))
warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
warnings.warn("a warning the user should see", UserWarning)
"""


def test_step_line_is_one_line_at_any_width_and_future_warnings_go_to_the_log_file(tmp_path):
    for columns in ("20", "300"):
        out = subprocess.run([sys.executable, "-c", SCRIPT.format(log_dir=str(tmp_path / columns))],
                             cwd=REPO_ROOT, env={**os.environ, "COLUMNS": columns, "PYTHONPATH": str(REPO_ROOT)},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = out.stderr.splitlines()
        step = [line for line in lines if "step 1/2" in line]
        assert len(step) == 1 and step[0].endswith("metric_39 39.25"), lines
        assert "FutureWarning" not in out.stderr and "a warning the user should see" in out.stderr
        logged = "".join(open(os.path.join(tmp_path / columns, name)).read() for name in os.listdir(tmp_path / columns))
        assert "FutureWarning" in logged and "metric_39 39.25" in logged


def test_console_line_names_reward():
    line = MetricsTracker.console_line(3, 10, {"reward/mean": 0.5, "val/accuracy": 0.25, "actor/clipfrac": 0.1})
    assert line == "step 3/10 | reward 0.5 | val_acc 0.25 | clipfrac 0.1"


# The console's own lines: `HH:MM:SS message` (utils.logging.LineFormatter), from a worker behind
# the prefix Ray forwards it with, `(ActorTrainWorker pid=123) `; ANSI colours aside.
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
RAY_WORKER_PREFIX = re.compile(r"^\(\w+ pid=\d+\) ")
PROJECT_LINE = re.compile(r"^\d\d:\d\d:\d\d ")
STEP_LINE = re.compile(r"\bstep \d+/\d+ \|")


def console_messages(output):
    """Each console line as (line, message): colours off, the message without Ray's prefix."""
    lines = [ANSI_COLOUR.sub("", line) for line in output.splitlines() if line.strip()]
    return [(line, RAY_WORKER_PREFIX.sub("", line)) for line in lines]


def check_console(output):
    """No third-party line before the first step line, and no message twice."""
    messages = console_messages(output)
    first_step = next((i for i, (_, message) in enumerate(messages) if STEP_LINE.search(message)), None)
    assert first_step is not None, output[-3000:]
    foreign = [line for line, message in messages[:first_step] if not PROJECT_LINE.match(message)]
    assert not foreign, "third-party lines on the console:\n" + "\n".join(foreign)
    texts = [PROJECT_LINE.sub("", message) for _, message in messages]
    twice = sorted({text for text in texts if texts.count(text) > 1})
    assert not twice, "printed more than once:\n" + "\n".join(twice)


def read_logs(folder):
    return {name: open(os.path.join(folder, name), errors="replace").read() for name in os.listdir(folder)
            if name.endswith(".log")}


BUILD_SCRIPT = """
import os
from roll_gspo.builtin.cache import build_atomically
from roll_gspo.utils.logging import setup_logging, use_log_dir
setup_logging()
use_log_dir({log_dir!r})

def build(folder):
    print("a library's progress bar", flush=True)
    os.write(2, b"a C library's warning\\n")

build_atomically({target!r}, build, what="thing")
"""


def test_a_build_says_so_once_and_keeps_the_libraries_output_in_the_log_file(tmp_path):
    script = BUILD_SCRIPT.format(log_dir=str(tmp_path / "logs"), target=str(tmp_path / "thing"))
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    console = (out.stdout + out.stderr).splitlines()
    assert len(console) == 2 and "building thing into" in console[0] and "built thing in" in console[1], console
    logged = "".join(read_logs(tmp_path / "logs").values())
    assert "a library's progress bar" in logged and "a C library's warning" in logged


def test_console_records_follow_stderr_when_the_stream_they_started_on_is_closed(tmp_path, monkeypatch):
    """A console handler made while stderr was a stream that is later closed and replaced (pytest
    capturing one test, a program embedding the CLI) writes to the stderr of the moment, and a
    build's output capture does not trip over the closed stream."""
    import io
    import logging

    from roll_gspo.utils import logging as roll_logging

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler = roll_logging.console_handler()
    logger = logging.getLogger("roll_gspo.test_console_follows_stderr")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logger.warning("after the swap")
        monkeypatch.setenv(roll_logging.LOG_DIR_ENV, str(tmp_path))
        with roll_logging.output_in_log_file():
            logger.warning("while captured")
        assert "after the swap" in second.getvalue()
    finally:
        logger.removeHandler(handler)


def test_a_dead_rank_is_one_line_naming_its_log_file(tmp_path, monkeypatch):
    import ray

    from roll_gspo.distributed.cluster import Cluster
    from roll_gspo.utils.logging import LOG_DIR_ENV

    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ("10.0.0.7", 4242))
    cluster = Cluster.__new__(Cluster)  # only what death_message reads
    cluster.name, cluster._whereabouts = "actor_train", ["whereabouts of rank 0"]
    message = cluster.death_message(0, RuntimeError("The actor died unexpectedly.\nmore of Ray's text"))
    assert message.count("\n") == 0 and str(tmp_path / "actor_train-0-4242.log") in message, message


# A run as a user starts it (run_pipeline.py, private Ray, a fresh cache): its console and log folder
# are checked on the first driver of tests/test_resume_chaos.py's vLLM test (check_console_of_a_run),
# which is such a run: a pipeline start fewer.


FAILING_RANK_SCRIPT = """
import sys

import ray

import pipelines
from roll_gspo import cli
from roll_gspo.distributed.cluster import Cluster, RankWorker, init_ray


class ActorInferWorker(RankWorker):
    def load_weight_bucket(self, bucket):
        if self.rank == 1:  # what vLLM raised on CPU for a prompt split over steps
            raise RuntimeError("CPU Generator does not use offset")


class ActorTrainWorker(RankWorker):
    def train_step(self, rollout_ranks):  # the trainer starts the weight sync itself
        ray.get([rank.load_weight_bucket.remote(None) for rank in rollout_ranks])


def run(cfg):  # the driver's side of a step: ranks of two roles, a call from one into the other
    from roll_gspo.utils.logging import use_log_dir

    use_log_dir({log_dir!r})
    init_ray(0.4, 0)
    infer = Cluster("actor_infer", ActorInferWorker, world_size=2, num_cpus=0.1, num_gpus=0)
    train = Cluster("actor_train", ActorTrainWorker, world_size=1, num_cpus=0.1, num_gpus=0)
    train.execute_all("train_step", infer.workers)


pipelines.run_pipeline_from_config = run
sys.exit(cli.main(["--config", {config!r}]))
"""


def test_an_exception_in_a_rank_is_one_console_line_naming_rank_error_and_log_file(tmp_path, tiny_model, ray_session):
    """A rollout rank raises inside a call from a training rank (as during weight sync), under
    the real command line (cli.main, joined to this session's Ray): the console gets one line,
    `error: role actor_infer rank 1: RuntimeError: ... (raised in ...; trace: <its log file>)`, no
    traceback; exit 1; the rank's log file holds the trace, the driver's Ray's whole text."""
    from omegaconf import OmegaConf

    from tests.test_pipeline_e2e import write_config

    write_config(tmp_path, tiny_model, max_steps=1)
    config = OmegaConf.load(tmp_path / "config.yaml")
    config.actor_infer.strategy_args = {"strategy_name": "hf_infer"}  # its preflight imports no vLLM (seconds)
    OmegaConf.save(config, tmp_path / "config.yaml")
    logs = tmp_path / "logs"
    script = FAILING_RANK_SCRIPT.format(log_dir=str(logs), config=str(tmp_path / "config.yaml"))
    address = ray_session.get_runtime_context().gcs_address
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RAY_ADDRESS": address, "PYTHONPATH": str(REPO_ROOT)})
    console = [line for _, line in console_messages(out.stdout + out.stderr)]
    assert out.returncode == 1, "\n".join(console)
    assert not [line for line in console if "Traceback" in line or line.startswith(" ")], "\n".join(console)
    errors = [line for line in console if line.startswith("error: ")]
    assert len(errors) == 1, "\n".join(console)
    match = re.fullmatch(r"error: role actor_infer rank 1: RuntimeError: CPU Generator does not use offset "
                         r"\(raised in ActorInferWorker\.load_weight_bucket; trace: (\S+)\)", errors[0])
    assert match, errors[0]
    trace_file = match.group(1)
    assert os.path.dirname(trace_file) == str(logs) and re.fullmatch(r"actor_infer-1-\d+\.log", os.path.basename(trace_file))
    trace = open(trace_file).read()
    assert "Traceback (most recent call last)" in trace and "in load_weight_bucket" in trace
    assert "RuntimeError: CPU Generator does not use offset" in trace
    driver_log = "".join(text for name, text in read_logs(logs).items() if name.startswith("driver-"))
    assert "ray::ActorTrainWorker.train_step()" in driver_log and "ray::ActorInferWorker.load_weight_bucket()" in driver_log
