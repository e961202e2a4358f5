"""The agentic pipeline's turns on continuous batching (the rank's engine loop): the same FrozenLake
episodes played in waves (one `generate_turns` call per wave) and one request per turn through the
rank's engine loop give the same trajectories (real Ray rank, vLLM; a turn's tokens depend on its
seed alone), and benchmarks/bench_agentic_batching.py's --quick run reports both modes (structure
only: its times are never checked)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.mark.e2e
def test_waves_and_continuous_turns_give_the_same_trajectories(tmp_path, tiny_model, ray_session):
    from benchmarks import bench_agentic_batching as bench

    out = tmp_path / "report.json"
    report = bench.main(["--quick", "--model", tiny_model, "--json", str(out)])
    assert json.loads(out.read_text())["modes"].keys() == {"waves", "continuous"}
    assert report["same_trajectories"] is True  # ids, masks, messages, rewards, stops: all equal
    assert report["max_log_prob_gap"] <= 1e-4  # the batch's make-up moves float sums, not samples
    for mode in ("waves", "continuous"):
        row = report["modes"][mode]
        assert row["turns"] > report["episodes"] and row["tokens"] > 0 and 0 < row["busy_fraction"] <= 1
    assert report["modes"]["waves"]["turns"] == report["modes"]["continuous"]["turns"]
    assert set(report["endpoint"]) >= {"overhead_ms", "direct_ms", "endpoint_ms"}
