"""Checkpoint folders and metrics files under crashes, without Ray: atomic commit, pruning cut
short mid-delete, an explicit resume from an older step with save_total_limit 1, metrics rows of
abandoned steps moved aside, an unwritable checkpoint folder."""
import json
import os
import shutil

import pytest

from roll_gspo.lifecycle import checkpoint as ckpt
from roll_gspo.metrics.recorder import MetricsTracker, move_rows_after, read_metrics

pytestmark = pytest.mark.chaos


def save(output_dir, step, keep, payload="weights"):
    """What the pipeline does: a temporary folder the ranks fill, then commit."""
    tmp = ckpt.begin_checkpoint(output_dir, step)
    with open(os.path.join(tmp, "model.bin"), "w") as handle:
        handle.write(f"{payload} {step}")
    return ckpt.commit_checkpoint(tmp, {"step": step}, output_dir, step, keep)


def names(output_dir):
    return [os.path.basename(p) for p in ckpt.complete_checkpoints(output_dir)]


def test_commit_is_a_rename_and_leftovers_are_ignored_then_removed(tmp_path):
    out = str(tmp_path)
    save(out, 1, keep=2)
    # A crash while writing step 2: its temporary folder holds everything but was never renamed.
    tmp = ckpt.begin_checkpoint(out, 2)
    open(os.path.join(tmp, ckpt.COMPLETE_MARKER), "w").close()
    assert names(out) == ["step_1"]
    assert ckpt.resolve_resume(out, "auto").endswith("step_1")
    assert not os.path.exists(tmp)  # removed at the start that resolved the resume
    assert ckpt.read_state(os.path.join(out, "checkpoints", "step_1")) == {"step": 1}


def test_pruning_interrupted_mid_delete_is_never_picked(tmp_path, monkeypatch):
    out = str(tmp_path)
    save(out, 1, keep=5)
    save(out, 2, keep=5)
    real_rmtree = shutil.rmtree

    def crash_half_way(path, *args, **kwargs):
        # Deletes some files (COMPLETE not necessarily first), then the process "dies".
        for name in sorted(os.listdir(path))[:1]:
            os.remove(os.path.join(path, name))
        raise KeyboardInterrupt("killed mid-delete")

    monkeypatch.setattr(ckpt.shutil, "rmtree", crash_half_way)
    with pytest.raises(KeyboardInterrupt):
        save(out, 3, keep=1)  # step_3 committed, then pruning step_1 and step_2 is cut short
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    root = os.path.join(out, "checkpoints")
    assert "step_1.deleting" in os.listdir(root)
    assert names(out)[-1] == "step_3"
    assert "step_1" not in names(out)
    assert ckpt.resolve_resume(out, "auto").endswith("step_3")
    assert not any(n.endswith(ckpt.DELETING_SUFFIX) for n in os.listdir(root))  # cleaned at start


def test_explicit_older_resume_with_save_total_limit_1_moves_newer_aside(tmp_path):
    out = str(tmp_path)
    for step in (1, 2, 3):
        save(out, step, keep=5, payload="first branch")
    older = os.path.join(out, "checkpoints", "step_1")
    assert ckpt.resolve_resume(out, older) == older
    assert names(out) == ["step_1"]
    aside = os.path.join(out, "checkpoints", ckpt.ABANDONED_DIR)
    (branch,) = os.listdir(aside)
    assert sorted(os.listdir(os.path.join(aside, branch))) == ["step_2", "step_3"]  # kept, not deleted
    # The new branch saves step 2 with save_total_limit 1: step_1 goes, the abandoned ones stay.
    save(out, 2, keep=1, payload="second branch")
    assert names(out) == ["step_2"]
    with open(os.path.join(out, "checkpoints", "step_2", "model.bin")) as handle:
        assert handle.read() == "second branch 2"
    assert ckpt.resolve_resume(out, "auto").endswith(os.path.join("checkpoints", "step_2"))
    assert sorted(os.listdir(os.path.join(aside, branch))) == ["step_2", "step_3"]
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.resolve_resume(out, os.path.join(out, "checkpoints", "step_9"))


def test_failed_checkpoint_write_is_a_clear_error_and_keeps_the_previous(tmp_path):
    """Root ignores file modes, so the failure is made with a folder where the state file must go
    (the disk-full case with real ranks is in test_resume_chaos.py)."""
    out = str(tmp_path)
    save(out, 1, keep=1)
    tmp = ckpt.begin_checkpoint(out, 2)
    os.makedirs(os.path.join(tmp, ckpt.STATE_FILE))
    with pytest.raises(ckpt.CheckpointError, match=r"step 2 .*previous checkpoint .*step_1 is intact"):
        ckpt.commit_checkpoint(tmp, {"step": 2}, out, 2, keep=1)
    assert names(out) == ["step_1"] and not os.path.exists(tmp)
    assert ckpt.read_state(os.path.join(out, "checkpoints", "step_1")) == {"step": 1}


def tensorboard_scalars(folder, key):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return [(e.step, round(e.value, 6)) for e in events.Scalars(key)]


def test_resume_moves_later_metrics_rows_aside_and_tensorboard_does_not_overlap(tmp_path):
    tb = str(tmp_path / "tb")
    first = MetricsTracker(str(tmp_path), tb, "tensorboard", {})
    for step in range(0, 6):
        first.log(step, {"reward/mean": step / 10})
    first.file.write('{"step": 6, "rew')  # a row torn by kill -9
    first.close()
    path = os.path.join(tmp_path, "metrics.jsonl")
    # Resumed from the checkpoint of step 3: rows 4, 5 and the torn one move aside, kept.
    resumed = MetricsTracker(str(tmp_path), tb, "tensorboard", {}, resume_step=3)
    (side,) = [n for n in os.listdir(tmp_path) if ".after_step_3." in n]
    moved = open(os.path.join(tmp_path, side)).read().splitlines()
    assert [json.loads(line)["step"] for line in moved[:2]] == [4, 5] and moved[2] == '{"step": 6, "rew'
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    for step in (4, 5):
        resumed.log(step, {"reward/mean": step})
    resumed.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4, 5]
    assert read_metrics(path)[-1]["reward/mean"] == 5
    assert tensorboard_scalars(tb, "reward/mean") == [(0, 0), (1, 0.1), (2, 0.2), (3, 0.3), (4, 4), (5, 5)]
    assert move_rows_after(path, 9) is None  # nothing after step 9: nothing moved
