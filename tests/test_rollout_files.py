"""Rollout files (docs/rollouts.md): the records built from a step's batch and the
files they go to. The files of a real run are checked in tests/test_pipeline_e2e.py (check_rollout_files)."""
import gzip
import os

import pytest
import torch

from pipelines.rollout_records import rows_to_write, train_records, validation_records
from roll_gspo.config import ConfigError, load_config
from roll_gspo.distributed.batch import Batch
from roll_gspo.metrics.rollouts import RolloutWriter, read_step, step_files, write_step


def scored_batch(rows=4, trainer_pass=True):
    """Two groups of two responses, scored, with advantages and both log-probs."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)[:rows]
    rollout = torch.full((rows, 3), -1.0)
    batch = Batch({"response_mask": mask, "rollout_log_probs": rollout,
                   "old_log_probs": rollout - 0.5 if trainer_pass else rollout,
                   "advantages": torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [0.5, 0, 0], [-0.5, -0.5, 0]])[:rows],
                   "scores": torch.tensor([1.1, 0.1, 0.0, 1.0])[:rows]})
    batch["prompt_text"] = ["2+2=", "2+2=", "3*3=", "3*3="][:rows]
    batch["prompt_ids"] = [[1, 2, 3]] * rows
    batch["response_text"] = ["<answer>4</answer>", "5", "", "<answer>9</answer>"][:rows]
    batch["response_ids"] = [[4, 5], [6, 7, 8], [9], [4, 5]][:rows]
    batch["finished"] = [True, False, True, True][:rows]
    batch["domain"] = ["arith"] * rows
    batch["ground_truth"] = ["4", "4", "9", {"answer": 9}][:rows]
    batch["reward_correct"] = [1.0, 0.0, None, True][:rows]  # workers send floats
    batch["reward_status"] = ["ok"] * rows
    batch["reward_metrics"] = [{"correct": 1.0, "format": 0.1}, {"correct": 0.0, "format": 0.1}, None,
                               {"correct": 1.0}][:rows]
    batch["weight_version"] = [6, 6, 5, 5][:rows]
    return batch


def test_train_records_carry_what_a_reader_needs():
    records = train_records(scored_batch(), step=7, limit=-1, group_size=2)
    first, second = records[0], records[1]
    assert (first["prompt"], first["response"], first["answer"], first["task"]) == ("2+2=", "<answer>4</answer>", "4",
                                                                                   "arith")
    assert (first["finish_reason"], second["finish_reason"]) == ("stop", "length")
    assert (first["prompt_tokens"], first["response_tokens"]) == (3, 2)
    assert first["reward"] == pytest.approx(1.1) and first["reward_parts"] == {"correct": 1.0, "format": 0.1}
    assert first["correct"] is True and second["correct"] is False and records[2]["correct"] is None
    assert first["advantage"] == pytest.approx(1.0) and second["advantage"] == pytest.approx(-1.0)
    assert first["logprob_gap"] == pytest.approx(-0.5)
    assert [r["group"] for r in records] == [0, 0, 1, 1]
    assert [(r["weight_version"], r["staleness"]) for r in records] == [(6, 0), (6, 0), (5, 1), (5, 1)]
    assert records[3]["ground_truth"] == '{"answer": 9}'


def test_the_training_ranks_ratio_and_clipped_share_join_their_rows():
    records = train_records(scored_batch(), 3, -1, 2, ratios={0: (1.02, 1.0), 2: (0.999, 0.0)})
    assert [(r["ratio"], r["clipped"]) for r in records] == [(1.02, 1.0), (None, None), (0.999, 0.0), (None, None)]


def test_response_ratios_are_gspos_sequence_ratio_and_the_clipped_share():
    """algorithms.response_ratios: exp of the mean log-ratio; clipped: the sequence ratio outside
    the band (seq), or the share of tokens outside it (token); an empty response ratio 1, clipped 0."""
    import math

    from roll_gspo.algorithms import response_ratios

    old = torch.zeros(3, 4)
    new = torch.tensor([[0.1, 0.1, 0.0, 9.0], [0.0, 0.0, 0.0, 0.0], [0.5, -0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    ratio, clipped = response_ratios(new, old, mask, importance_sampling="seq", clip_low=0.01, clip_high=0.01)
    assert ratio.tolist() == pytest.approx([math.exp(0.1), 1.0, 1.0]) and clipped.tolist() == [1.0, 0.0, 0.0]
    ratio, clipped = response_ratios(new, old, mask, importance_sampling="token", clip_low=0.2, clip_high=0.2)
    assert clipped.tolist() == pytest.approx([0.0, 0.0, 0.5])  # row 2: e^0.5 and e^-0.5 outside [0.8, 1.2]


def test_no_gap_where_the_old_log_probs_are_the_engines():
    assert {r["logprob_gap"] for r in train_records(scored_batch(trainer_pass=False), 1, -1, 2)} == {None}


def test_where_the_old_log_probs_are_the_engines_the_training_pass_gives_each_row_its_gap():
    """The drift alarm's per-token |trainer - engine| of the first training pass (rows 0 and 3 here;
    a micro-batch padded to 2 tokens for row 3) are the rows' gaps, over their response tokens."""
    gaps = {0: torch.tensor([0.2, 0.4, 9.0]), 3: torch.tensor([0.1, 0.3])}
    records = train_records(scored_batch(trainer_pass=False), 1, -1, 2, trainer_gaps=gaps)
    assert [r["logprob_gap"] for r in records] == [pytest.approx(0.3), None, None, pytest.approx(0.2)]


def test_the_sample_bound_takes_whole_groups_first():
    assert list(rows_to_write(10, 4)) == [0, 1, 2, 3] and list(rows_to_write(10, -1)) == list(range(10))
    assert list(rows_to_write(10, 0)) == [] and list(rows_to_write(3, 64)) == [0, 1, 2]
    assert [r["index"] for r in train_records(scored_batch(), 1, 2, 2)] == [0, 1]


def test_validation_records_hold_every_prompt():
    records = validation_records(scored_batch(), step=10)
    assert len(records) == 4 and records[3]["answer"] == "9" and records[3]["correct"] is True
    assert [r["correct"] for r in records] == [True, False, None, True]


def test_files_replace_a_step_written_before_and_read_back(tmp_path):
    folder = str(tmp_path / "rollouts")
    write_step(folder, 3, [{"a": 1}])
    write_step(folder, 12, [{"a": 2}])
    path, size = write_step(folder, 3, [{"a": 3}, {"a": 4}])  # the step again, after a resume
    assert [s for s, _ in step_files(folder)] == [3, 12] and size == os.path.getsize(path)
    assert read_step(path) == [{"a": 3}, {"a": 4}]
    assert sorted(os.listdir(folder)) == ["step_000003.jsonl.gz", "step_000012.jsonl.gz"]  # no temporary left
    with gzip.open(path, "rt") as f:
        assert f.readline().strip() == '{"a": 3}'


def test_the_same_records_give_the_same_bytes_in_any_process_at_any_time(tmp_path, monkeypatch):
    """A resumed run's step files (and `rollouts/*_bytes`) equal an uninterrupted run's: no pid (in the
    temporary name) and no time in the gzip header. The pid's digit count once moved a size by a byte."""
    import time

    records = [{"prompt": "2+2", "response": "4", "reward": 1.0}]
    monkeypatch.setattr(os, "getpid", lambda: 7)
    first, first_size = write_step(str(tmp_path / "a"), 1, records)
    monkeypatch.setattr(os, "getpid", lambda: 1234567)
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)
    second, second_size = write_step(str(tmp_path / "b"), 1, records)
    assert first_size == second_size and open(first, "rb").read() == open(second, "rb").read()


def test_the_writer_reports_bytes_and_samples_and_writes_nothing_when_off(tmp_path):
    writer = RolloutWriter(None, str(tmp_path / "val"))
    assert writer.write("train", 1, [{"a": 1}]) == {}
    metrics = writer.write("val", 1, [{"a": 1}])
    assert metrics["rollouts/val_samples"] == 1.0 and metrics["rollouts/val_bytes"] > 0


def test_keys_load_with_roll_and_verl_names():
    cfg = load_config("example_gspo.yaml", ["rollout_data_dir=/tmp/r"])
    assert (cfg.rollout_dump_dir, cfg.validation_data_dir) == ("/tmp/r", "/tmp/r/val")
    assert load_config("example_gspo.yaml").rollout_dump_dir.endswith("example_gspo/rollouts")
    with pytest.raises(ConfigError, match="rollout_dump_samples"):
        load_config("example_gspo.yaml", ["rollout_dump_samples=-2"])
