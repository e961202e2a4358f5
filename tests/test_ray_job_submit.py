"""The cluster path users take: `ray start --head`, then `ray job submit --working-dir . --
python run_pipeline.py --config example_gspo.yaml ...` runs to SUCCEEDED."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from roll_gspo.distributed.cluster import free_port
from tests.conftest import REPO_ROOT
from tests.ray_nodes import stop_ray_nodes
from tests.test_console import PROJECT_LINE, check_console

pytestmark = pytest.mark.e2e


def wait_for_dashboard(head, url, log_path, timeout_s=180):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert head.poll() is None, "ray start --head exited early:\n" + Path(log_path).read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=5):
                return
        except urllib.error.HTTPError:  # answering (e.g. 401 under token auth): it is up
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError("the Ray head's job server did not come up")


def test_ray_job_submit_runs_the_pipeline(tmp_path, session_cache, tiny_model):
    bin_dir = Path(sys.executable).parent
    ray_cli = str(bin_dir / "ray")
    # The head gets its own temp dir, so no other Ray user on this machine finds (and joins) it.
    # (Short path: Ray's unix socket paths must stay under 108 bytes.)
    temp_dir = Path(tempfile.mkdtemp(prefix="rg_ray_", dir="/tmp"))
    # Ray 2.60 heads require the token in ~/.ray/auth_token; the CLI only sends it in token mode.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "ROLL_GSPO_CACHE": session_cache}
    env.pop("RAY_ADDRESS", None)
    # `--block` keeps the head in this process group, so the test stops exactly this head
    # (`ray stop` would kill every Ray process on the machine).
    url = f"http://127.0.0.1:{free_port()}"
    log_path = tmp_path / "head.log"
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--num-cpus=4", f"--port={free_port()}",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={url.rsplit(':', 1)[1]}",
                             # Fixed default ports would collide with any other Ray on the machine.
                             f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
                             f"--metrics-export-port={free_port()}",
                             f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    output_dir = tmp_path / "job_out"
    try:
        wait_for_dashboard(head, url, log_path)
        submit = subprocess.run(
            [ray_cli, "job", "submit", "--address", url, "--working-dir", ".",
             "--", "python", "run_pipeline.py", "--config", "example_gspo.yaml", "max_steps=2",
             f"pretrain={tiny_model}", "eval_steps=0", "save_steps=0", "rollout_batch_size=4",
             f"output_dir={output_dir}"],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
        log = submit.stdout + submit.stderr
        assert submit.returncode == 0 and "succeeded" in log.lower(), log[-5000:]
        # The console a user reads (here through the job's log): each step's metrics on one whole
        # line, reward named `reward`, and no per-step third-party noise (it is in output/logs).
        step_lines = [line for line in log.splitlines() if re.search(r"step \d/2 \|", line)]
        assert len(step_lines) == 2 and all(re.search(r"\| reward [-\d.e]+ \|.*\| step_s [\d.e-]+$", line)
                                            for line in step_lines), step_lines
        assert "FutureWarning" not in log and "reset prefix cache" not in log, log[-5000:]
        # From the driver's first line to the first step only the project's lines, none twice
        # (Ray's job machinery prints before the driver starts; `ray job submit` frames the log).
        job_log = submit.stdout.split("Tailing logs until the job exits", 1)[1].split("\n", 1)[1]
        job_log = job_log.split(f"\n{'-' * 10}", 1)[0]
        check_console(job_log[re.search(PROJECT_LINE.pattern, job_log, re.M).start():])
    finally:
        stop_ray_nodes([head])
        shutil.rmtree(temp_dir, ignore_errors=True)
    with open(output_dir / "metrics.jsonl") as handle:
        steps = [json.loads(line)["step"] for line in handle]
    assert steps == [1, 2]
    assert (output_dir / "final_model" / "model.safetensors").exists()
