"""The GSPO-vs-GRPO study's smoke mode: the three arms on the MoE micro model, one seed, one
tiny step; the table, plots and claim verdicts are written."""
import json

import pytest

pytestmark = pytest.mark.e2e


def test_study_smoke_mode_writes_table_plots_and_claims(tmp_path, session_cache, ray_session):
    from benchmarks.study_gspo_vs_grpo import main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["table"]) == {"moe"}
    assert set(summary["table"]["moe"]) == {"gspo", "grpo", "grpo_replay"}
    moe = summary["table"]["moe"]["grpo_replay"]
    assert 0.0 <= moe["mean:moe/expert_volatility"] <= 1.0 and moe["val_last"] >= 0.0
    assert any("clips far more tokens" in line for line in summary["claims"])
    assert any("Routing Replay" in line for line in summary["claims"])
    assert (tmp_path / "study.png").stat().st_size > 0
    assert "| moe | grpo_replay |" in (tmp_path / "table.md").read_text()
    # The report rebuilt from runs.jsonl alone is the same table and the same verdicts.
    (tmp_path / "study.png").unlink()
    assert main(["--report-only", "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "summary.json").read_text())
    assert json.dumps(again["table"]) == json.dumps(summary["table"]) and again["claims"] == summary["claims"]
    assert (tmp_path / "study.png").stat().st_size > 0
