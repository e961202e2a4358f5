"""`track_with`: every tracker takes two steps of metrics and `tracker_kwargs`, offline, and the
metrics are read back from what the real library wrote."""
import glob
import json
import os
import time

import pytest

from roll_gspo.metrics.recorder import MetricsTracker

STEPS = {1: {"reward/mean": 0.25, "actor/clipfrac": 0.5, "time/step_s": 1.5, "actor/kl": float("nan")},
         2: {"reward/mean": 0.75, "actor/clipfrac": 0.25, "time/step_s": 1.25, "actor/kl": 0.1}}


def track(tmp_path, name, kwargs=None):
    out = tmp_path / "out"
    tracker = MetricsTracker(str(out), str(out / "tb"), name, kwargs or {}, exp_name="trk",
                             config={"seed": 1, "actor_train": {"world_size": 2}})
    for step, metrics in STEPS.items():
        tracker.log(step, metrics)
    tracker.close()
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["reward/mean"] for r in lines] == [0.25, 0.75] and lines[0]["actor/kl"] is None
    return out, tracker


def test_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = track(tmp_path, "tensorboard", {"flush_secs": 5})
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [e.step for e in events.Scalars("actor/kl")] == [2]  # NaN is left out, not plotted as 0


def test_stdout(tmp_path, capsys):
    track(tmp_path, "stdout")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["step"], r["reward/mean"]) for r in lines] == [(1, 0.25), (2, 0.75)]


def test_none_writes_metrics_jsonl_only(tmp_path):
    out, tracker = track(tmp_path, "none")
    assert tracker.tracker is None and sorted(os.listdir(out)) == ["metrics.jsonl"]


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out, tracker = track(tmp_path, "wandb", {"project": "roll-test", "tags": ["ci"], "notes": "offline test"})
    run_files = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(run_files) == 1
    deadline = time.time() + 60  # wandb's service may still be writing the run file's tail
    while not any(r.HasField("exit") for r in read_wandb_records(run_files[0])) and time.time() < deadline:
        time.sleep(0.5)
    history, run_record = [], None
    for record in read_wandb_records(run_files[0]):
        if record.HasField("history"):
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.append((items.get("_step"), items.get("reward/mean")))
        if record.HasField("run"):
            run_record = record.run
    assert history == [(1, 0.25), (2, 0.75)]
    assert run_record.project == "roll-test" and list(run_record.tags) == ["ci"]  # tracker_kwargs passed


def read_wandb_records(path):
    """The protobuf records of a wandb run file (LevelDB log format: 32 KiB blocks of records
    with a 7-byte header, large ones split first/middle/last), after its 7-byte W&B header."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pieces, records = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pieces = chunk if kind in (1, 2) else pieces + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
    return records


def test_mlflow_file_store(tmp_path):
    from mlflow import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    track(tmp_path, "mlflow", {"tracking_uri": uri, "experiment_name": "roll-test", "tags": {"team": "rl"}})
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("roll-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert run.data.tags["team"] == "rl" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "actor/kl")] == [2]


def test_swanlab_offline(tmp_path):
    out, _ = track(tmp_path, "swanlab", {"mode": "offline", "project": "roll-test", "description": "offline test"})
    runs = glob.glob(str(out / "swanlog" / "run-*" / "run-*.swanlab"))
    assert len(runs) == 1
    data = open(runs[0], "rb").read()
    assert b"reward/mean" in data and b"actor/clipfrac" in data
    config = open(glob.glob(str(out / "swanlog" / "run-*" / "files" / "config.yaml"))[0]).read()
    assert "world_size" in config


def test_a_missing_tracker_library_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"trackers extra"):
        track(tmp_path, "wandb")
