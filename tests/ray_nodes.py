"""Stopping the `ray start --block` nodes that multi-node tests start (test_placement, test_ray_job_submit)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Sequence


def stop_ray_nodes(processes: Sequence[subprocess.Popen], grace_s: float = 30) -> None:
    """SIGTERM each `ray start --block` process alone (it stops its node's processes, ~2-5 s), then
    SIGKILL what is left in its process group after at most `grace_s`. (SIGTERM sent to the whole
    group left the `ray start` process running: every stop waited out the grace.)"""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)
