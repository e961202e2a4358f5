"""scripts/gpu_check.py where there is no GPU: every check SKIPs, one line each,
and the exit status is 0. What it checks on a GPU is in docs/gpu.md."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CHECKS = ["deepspeed_builtin", "deepspeed_qwen05b", "cuda_ipc", "hf_generate_score", "fsdp2"]
LINE = re.compile(r"^(PASS|FAIL|SKIP) ([a-z0-9_]+): (.+)$")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the checks run (minutes): run the script itself")
def test_without_cuda_every_check_skips_in_one_line_and_exits_0():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("# gpu_check ") and "torch" in lines[0]
    results = [LINE.match(line) for line in lines if not line.startswith("#")]
    assert all(results), lines
    assert [m.group(2) for m in results] == CHECKS
    assert all(m.group(1) == "SKIP" and m.group(3).startswith("no CUDA device") for m in results)
