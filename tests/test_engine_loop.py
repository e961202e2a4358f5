"""Continuous batching in a rollout rank (roll_gspo.strategies.engine_loop): the
cases in tests/engine_loop_cases.py, run in a fresh interpreter. In the full suite an in-process vLLM
engine this module builds shared the process with the engines and threads of the modules before it,
and its forward then failed ("pipeline model parallel group is not initialized"); alone, or in a
process of its own, it passes. The cases are the test: any failure among them fails this one, with
their output."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engine_loop_cases_in_their_own_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp_path / "cases"), os.path.join(REPO, "tests", "engine_loop_cases.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
