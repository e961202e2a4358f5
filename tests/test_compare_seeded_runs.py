"""scripts/compare_seeded_runs.py: the step-by-step comparison of two seeded runs'
metrics.jsonl that a change meant to move nothing is checked with."""
import importlib.util
import math
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "compare_seeded_runs", Path(__file__).resolve().parents[1] / "scripts" / "compare_seeded_runs.py")
compare = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = compare  # its dataclass looks its module up
spec.loader.exec_module(compare)

RUN = [{"step": 1, "reward/mean": 0.5, "loss": 0.1, "time/step_s": 1.0},
       {"step": 2, "reward/mean": 0.6, "loss": 0.2, "time/step_s": 1.1}]


def test_identical_runs_and_wall_clock_figures_do_not_count():
    other = [dict(row, **{"time/step_s": 9.0}) for row in RUN]
    assert compare.compare_metrics(RUN, other) == []


def test_a_moved_value_is_reported_at_its_first_step_with_its_largest_gap():
    moved = [dict(RUN[0]), dict(RUN[1], loss=0.5)]
    moved[0]["loss"] = 0.1 + 1e-9
    (difference,) = compare.compare_metrics(RUN, moved)
    assert (difference.key, difference.first_step) == ("loss", 1)
    assert math.isclose(difference.largest_gap, 0.3)
    assert compare.compare_metrics(RUN, [moved[0], RUN[1]], tolerance=1e-6) == []


def test_a_missing_step_is_a_difference_and_a_new_key_is_listed_apart():
    assert [d.key for d in compare.compare_metrics(RUN, RUN[:1])] == ["loss", "reward/mean"]
    extra = [dict(row, **{"val/accuracy": 0.3, "sync/seconds": 0.1}) for row in RUN]
    assert compare.compare_metrics(RUN, extra) == []
    assert compare.keys_of_one_side(RUN, extra) == ([], ["val/accuracy"])  # sync/seconds: wall-clock
    nan = [dict(row, loss=float("nan")) for row in RUN]
    assert compare.compare_metrics(nan, nan) == []


def test_two_revisions_run_into_two_folders(tmp_path, monkeypatch):
    """`--before A --after B` (both revisions, each in a worktree): the second run must not land in the
    first one's output folder, where it would stop on the first run's checkpoints."""
    folders = []

    def fake_run(command, cwd=None, env=None, **kwargs):
        folders.extend(arg.split("=", 1)[1] for arg in command if str(arg).startswith("output_dir="))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    monkeypatch.setattr(compare.tempfile, "mkdtemp", lambda prefix="": str(tmp_path / prefix))
    monkeypatch.setattr(compare, "read_metrics", lambda path: RUN)
    assert compare.main(["--before", "HEAD~1", "--after", "HEAD", "--keep", str(tmp_path / "out")]) == 0
    assert folders == [str(tmp_path / "out" / "before"), str(tmp_path / "out" / "after")]
