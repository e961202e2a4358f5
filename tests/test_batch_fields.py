"""The batch's tensors are declared once (roll_gspo.distributed.batch_fields): the views the driver
sends to the training ranks come from the declaration, and every tensor a rank's worker reads by
name is declared for that rank (else the view would leave it behind and the rank would fail)."""
import ast
from pathlib import Path

import torch

from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.batch_fields import CRITIC_TENSORS, FIELDS, TRAINER_TENSORS, tensors_read_by, view

WORKERS = Path(__file__).resolve().parents[1] / "roll_gspo" / "workers"


def _subscript_keys(path: Path):
    """Every `x["name"]` (a plain lower-case name) in a module."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
            if isinstance(key, str) and key.replace("_", "").isalpha() and key.islower():
                keys.add(key)
    return keys


def test_every_tensor_a_training_rank_reads_is_declared_for_it():
    declared = {f.name for f in FIELDS}
    trainer_side = set(TRAINER_TENSORS) | set(tensors_read_by("worker"))
    for module, readable in (("actor_train.py", trainer_side), ("reference.py", set(TRAINER_TENSORS)),
                             ("critic.py", set(CRITIC_TENSORS))):
        read = _subscript_keys(WORKERS / module) & declared
        assert read or module == "reference.py", module  # the scan finds the reads (reference delegates them)
        assert read <= readable, f"{module} reads {sorted(read - readable)}, not in its view"
    assert {"input_ids", "old_log_probs", "advantages", "loss_mask"} <= _subscript_keys(WORKERS / "actor_train.py")


def test_views_carry_only_the_declared_tensors_in_the_batch_order():
    batch = Batch({"values": torch.zeros(2, 3), "input_ids": torch.zeros(2, 5, dtype=torch.long),
                   "advantages": torch.ones(2, 3), "scores": torch.ones(2)},
                  {"response_text": ["a", "b"]})
    trainer = view(batch, TRAINER_TENSORS)
    assert list(trainer.tensors) == ["input_ids", "advantages"] and not trainer.meta
    assert list(view(batch, CRITIC_TENSORS).tensors) == ["values", "input_ids"]


def test_each_field_is_declared_once_with_a_reader():
    names = [f.name for f in FIELDS]
    assert len(names) == len(set(names))
    assert all(f.read_by <= {"trainer", "critic", "worker", "driver"} and f.read_by for f in FIELDS)
    assert "teacher_log_probs" not in TRAINER_TENSORS  # the driver's OPD advantages read it, no rank does
