"""The tensors a step's batch carries to the training-side ranks, declared once: who makes each
one and which ranks read it. The views sent to the ranks (`trainer_view`, `critic_view`) are
derived from here, so a field a rank reads and nobody declared fails a test, not a run.

Shapes: B responses (or turn samples), L = prompt + response positions, T = response positions,
K experts chosen per token. Meta lists (texts, ids, domains, verdicts) stay with the driver and
the reward workers and are not declared here.
"""
from __future__ import annotations

import dataclasses
from typing import FrozenSet, Tuple

from roll_gspo.distributed.batch import Batch


@dataclasses.dataclass(frozen=True)
class BatchField:
    """One tensor of a batch: its name, shape, what makes it, which ranks read it."""
    name: str
    shape: str
    made_by: str
    read_by: FrozenSet[str]  # "trainer" (actor_train and reference passes), "critic", "worker" (made there),
    # "driver" (read by the driver only, e.g. the advantages: never sent to a rank)


def _field(name: str, shape: str, made_by: str, *read_by: str) -> BatchField:
    return BatchField(name, shape, made_by, frozenset(read_by))


FIELDS: Tuple[BatchField, ...] = (
    _field("input_ids", "(B, L) long", "the driver's sequence layout", "trainer", "critic"),
    _field("row_index", "(B,) long", "the driver: each row's place in the step's batch (per-response figures "
           "the trainer sends back, e.g. the rollout files' ratio)", "trainer"),
    _field("attention_mask", "(B, L)", "the driver's sequence layout", "trainer", "critic"),
    _field("prompt_lengths", "(B,) long", "the driver's sequence layout", "trainer", "critic"),
    _field("response_mask", "(B, T)", "the driver's sequence layout", "trainer", "critic"),
    _field("loss_mask", "(B, T)", "agentic samples (generated ids only) or per-response weights", "trainer"),
    _field("rollout_log_probs", "(B, T)", "the rollout engine", "trainer"),
    _field("token_lags", "(B, T)", "the loop with async_generation_ratio k >= 2: trainer version - token's version",
           "trainer"),
    _field("old_log_probs", "(B, T)", "the trainer's pass, or the rollout engine's", "trainer"),
    _field("ref_log_probs", "(B, T)", "the reference's pass (a KL term)", "trainer"),
    _field("teacher_log_probs", "(B, T)", "the teacher's pass (use_opd); several teachers: their weighted mean",
           "driver"),
    _field("teacher_kl_coef", "(B,)", "the teacher passes (use_opd): each row's summed teacher weight (0: none "
                                     "scored it)", "driver"),
    _field("routed_experts", "(B, L, layers, K) long", "the old-policy pass of an MoE model", "trainer"),
    _field("advantages", "(B, T)", "the source's advantage estimate", "trainer"),
    _field("values", "(B, T)", "the critic's pass (PPO)", "critic"),
    _field("returns", "(B, T)", "GAE (PPO)", "critic"),
    _field("rollout_is_weights", "(B, T)", "train_infer_correction, on each training rank", "worker"),
    _field("rollout_is_keep", "(B, T) bool", "train_infer_correction's rejection, on each training rank", "worker"),
)


# What a training rank's train_step result carries beside its float metrics: {row_index: (ratio,
# clipped)} of the responses it trained (the driver pops it before merging metrics).
RESPONSE_RATIOS = "response_ratios"


def tensors_read_by(reader: str) -> Tuple[str, ...]:
    """The names of the fields `reader` reads, in declaration order."""
    return tuple(f.name for f in FIELDS if reader in f.read_by)


TRAINER_TENSORS = tensors_read_by("trainer")
CRITIC_TENSORS = tensors_read_by("critic")


def view(batch: Batch, names: Tuple[str, ...]) -> Batch:
    """Only the tensors named (less to serialise to the ranks)."""
    return Batch({k: v for k, v in batch.tensors.items() if k in names})
