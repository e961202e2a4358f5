"""How one rank's rows are split into micro-batches (one forward pass each).

Rows are right-padded prompt+response sequences (`roll_gspo.models.causal_lm.build_sequences`): the
input-layout tensors (``INPUT_KEYS``, ``(B, L, ...)``) hold a row's real tokens first and padding
after, the response-layout ones (``(B, T)``: response_mask, advantages, log-probs, ...) its
response tokens first. A micro-batch therefore only needs the first ``width`` input columns (its
longest row) and the first ``response_width`` response columns: `take` cuts them, so padding costs
no FLOPs beyond the micro-batch's own longest row.

Two ways to choose the rows:

* `fixed_micro_batches`: consecutive rows, ``size`` at a time (per_device_train_batch_size,
  infer_batch_size);
* `token_budget_micro_batches` (ROLL's ``use_dynamic_batching_in_*``): rows sorted by length and
  packed greedily so that rows x padded width <= ``max_tokens``, with the padded width rounded up
  to a multiple of ``round_to`` (``sequence_length_round_in_*``). Short rows share a micro-batch,
  long ones get their own, and rows of similar length sit together, so little padding is left.

Neither changes a loss or a gradient: the trainer's loss normalisers are those of the whole
mini-batch (see `roll_gspo.algorithms.losses.aggregate_loss`), so the sum over micro-batches is
the same whatever the split. Ranks may end up with different micro-batch counts; callers run
padding passes so every rank makes as many passes as the busiest (collectives under ZeRO).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from roll_gspo.distributed.batch import Batch

# Tensors laid out along the input sequence (prompt + response, right-padded).
INPUT_KEYS = ("input_ids", "attention_mask", "routed_experts")


@dataclass(frozen=True)
class MicroBatch:
    """Rows (positions in the rank's batch) of one forward pass, and the input columns it needs."""

    rows: Tuple[int, ...]
    width: int

    def padded_tokens(self) -> int:
        return len(self.rows) * self.width


def sequence_lengths(batch: Batch) -> List[int]:
    """Real (unpadded) prompt+response tokens per row."""
    return batch["attention_mask"].sum(-1).tolist() if len(batch) else []


def _min_width(batch: Batch) -> int:
    # Two columns at least: a pass scores position p-1 -> token p (see response_token_log_probs).
    return min(2, batch["input_ids"].shape[1]) if len(batch) else 0


def fixed_micro_batches(batch: Batch, size: int) -> List[MicroBatch]:
    """Consecutive rows, `size` per micro-batch, each cut to its own longest row."""
    lengths = sequence_lengths(batch)
    return [MicroBatch(tuple(range(start, min(start + size, len(lengths)))),
                       max(max(lengths[start:start + size]), _min_width(batch)))
            for start in range(0, len(lengths), size)]


def role_micro_batches(batch: Batch, role, phase: str) -> List[MicroBatch]:
    """A role's split of `batch` for `phase` "train" (per_device_train_batch_size rows) or
    "infer" (infer_batch_size rows), or by token budget with the role's
    `use_dynamic_batching_in_<phase>`."""
    if getattr(role, f"use_dynamic_batching_in_{phase}"):
        key = f"max_tokens_per_microbatch_in_{phase}"
        return token_budget_micro_batches(batch, getattr(role, key), getattr(role, f"sequence_length_round_in_{phase}"),
                                          key=key)
    size = role.training_args.per_device_train_batch_size if phase == "train" else role.infer_batch_size
    return fixed_micro_batches(batch, size)


def ppo_mini_batches(batch: Batch, role, ppo_epochs: int,
                     generator: torch.Generator) -> List[Tuple[Batch, List[MicroBatch]]]:
    """ppo_epochs shuffles of `batch` (order drawn from `generator`, which the caller seeds from
    the optimizer step so a resumed run draws the same), each cut into mini-batches of
    per_device_train_batch_size x gradient_accumulation_steps rows, each with its micro-batches."""
    args = role.training_args
    per_rank_mini = args.per_device_train_batch_size * args.gradient_accumulation_steps
    mini_batches = []
    for _ in range(ppo_epochs):
        order = torch.randperm(len(batch), generator=generator).tolist()
        for start in range(0, len(batch), per_rank_mini):
            mini = batch.select(order[start:start + per_rank_mini])
            mini_batches.append((mini, role_micro_batches(mini, role, "train")))
    return mini_batches


def token_budget_micro_batches(batch: Batch, max_tokens: int, round_to: int = 1,
                               key: str = "max_tokens_per_microbatch") -> List[MicroBatch]:
    """Rows sorted by length (ties in row order), packed greedily: a row joins the current
    micro-batch while (rows + 1) x padded width <= `max_tokens`, the padded width being the
    longest row rounded up to a multiple of `round_to` (at most the batch's width). A row longer
    than the budget on its own is an error naming `key`."""
    if max_tokens < 1 or round_to < 1:
        raise ValueError(f"{key} and its length rounding must be >= 1, got {max_tokens} and {round_to}")
    lengths = sequence_lengths(batch)
    full_width = batch["input_ids"].shape[1] if len(batch) else 0

    def padded(length: int) -> int:
        return max(min(-(-length // round_to) * round_to, full_width), _min_width(batch))

    plans: List[MicroBatch] = []
    rows: List[int] = []
    width = 0
    for row in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        need = padded(lengths[row])
        if need > max_tokens:
            raise ValueError(f"{key} = {max_tokens} is smaller than one sequence of {lengths[row]} tokens "
                             f"(padded to {need}); raise it to at least prompt_length + response_length")
        if rows and (len(rows) + 1) * max(width, need) > max_tokens:
            plans.append(MicroBatch(tuple(rows), width))
            rows, width = [], 0
        rows.append(row)
        width = max(width, need)
    if rows:
        plans.append(MicroBatch(tuple(rows), width))
    return plans


def take(batch: Batch, micro: MicroBatch) -> Batch:
    """The micro-batch's rows with input-layout tensors cut to `micro.width` columns and
    response-layout ones (``(B, T, ...)``, T the response_mask width) to its longest response."""
    part = batch.select(micro.rows)
    response_width = batch["response_mask"].shape[1]
    cut = int(part["response_mask"].sum(-1).max()) if len(part) else 0
    for key, tensor in list(part.tensors.items()):
        if key in INPUT_KEYS:
            part.tensors[key] = tensor[:, :micro.width]
        elif tensor.dim() >= 2 and tensor.shape[1] == response_width:
            part.tensors[key] = tensor[:, :max(cut, 1)]
    return part


def scatter_rows(parts: Sequence[torch.Tensor], plans: Sequence[MicroBatch], size: int,
                 width: int) -> torch.Tensor:
    """Per-micro-batch results ``(rows, w_i, ...)`` put back in batch order as ``(size, width,
    ...)``, zero-padded past each part's width."""
    if not parts:
        return torch.zeros(size, width)
    out = parts[0].new_zeros((size, width, *parts[0].shape[2:]))
    for part, micro in zip(parts, plans):
        out[list(micro.rows), :part.shape[1]] = part
    return out
