"""Log-probabilities (and entropies) of sampled tokens from logits, in bounded memory.

Shapes: ``logits`` is ``(B, S, V)``, the model's output over ``S`` kept positions; ``rows`` and
``positions`` are ``(N,)`` indices naming which ``(row, position)`` of it scores each of the
``N`` sampled tokens; ``targets`` ``(N,)`` are the token ids. Results are ``(N,)`` fp32.

``log p(token) = z[token] - logsumexp(z)`` with ``z = logits / temperature`` in fp32, computed a
chunk of rows at a time, in place on the chunk's one fp32 copy, so the only ``V``-wide temporaries
are one chunk's (``CHUNK_ELEMENTS`` values). The naive route (upcast the whole ``(B, S, V)`` to
fp32, divide by the temperature, gather, ``log_softmax``, ``exp`` for the entropy) holds several
full copies at once: ~10 GB per sequence for a 152k vocabulary at 4k tokens. The backward pass
writes the logits' gradient chunk by chunk into one buffer instead of keeping the log-softmax for
autograd.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["CHUNK_ELEMENTS", "sampled_token_log_probs"]

# fp32 values per chunk of V-wide temporaries (2M values = 8 MB; 42 tokens at a 49k vocabulary, 13
# at 152k). Under glibc's 32 MB mmap threshold, so a chunk's buffers are reused from the heap: at
# 16M values (64 MB) every temporary was a fresh mmap and page-faulted in, and the log-prob pass of
# a SmolLM2 micro-batch took 2-3x the CPU time (docs/training_speed.md).
CHUNK_ELEMENTS = 1 << 21


def _chunks(count: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(1, vocab))
    for start in range(0, count, step):
        yield slice(start, min(start + step, count))


def _scaled(logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """``(n, V)`` fp32 ``logits[rows, positions] / temperature`` (a chunk-sized copy)."""
    z = logits[rows, positions].float()  # advanced indexing copies: z is the caller's to change
    return z.div_(temperature) if temperature != 1.0 else z


class _SampledTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, positions, targets, temperature, with_entropy):
        count, vocab = rows.shape[0], logits.shape[-1]
        log_probs = torch.empty(count, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(log_probs)
        entropy = torch.empty(count if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for chunk in _chunks(count, vocab):
            # In place on the chunk's one fp32 copy: z - max, then its exp (no second V-wide copy
            # unless the entropy needs z and exp(z) together).
            z = _scaled(logits, rows[chunk], positions[chunk], temperature)
            peak = z.amax(dim=-1, keepdim=True)
            z.sub_(peak)
            shifted_target = z.gather(-1, targets[chunk, None]).squeeze(-1)
            if with_entropy:  # H = log S - sum(e * z') / S, with z' = z - max, e = exp(z'), S = sum e
                exp = torch.exp(z)
                total = exp.sum(-1)
                weighted = exp.mul_(z).sum(-1)
            else:
                total = z.exp_().sum(-1)
            log_total = total.log()
            lse[chunk] = log_total + peak.squeeze(-1)
            log_probs[chunk] = shifted_target - log_total
            if with_entropy:
                entropy[chunk] = log_total - weighted / total
        ctx.save_for_backward(logits, rows, positions, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy):
        logits, rows, positions, targets, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.zeros_like(logits)
        for chunk in _chunks(rows.shape[0], logits.shape[-1]):
            z = _scaled(logits, rows[chunk], positions[chunk], temperature)
            grad = grad_log_probs[chunk].float()
            # d(z_t - lse)/dz = onehot(t) - softmax(z); then through the division by temperature.
            grad_z = z.sub_(lse[chunk, None]).exp_().mul_(-grad[:, None])
            grad_z.scatter_add_(-1, targets[chunk, None], grad[:, None])
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_logits.index_put_((rows[chunk], positions[chunk]), grad_z.to(logits.dtype), accumulate=True)
        return grad_logits, None, None, None, None, None


def sampled_token_log_probs(logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                            targets: torch.Tensor, temperature: float = 1.0,
                            with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``targets`` under ``softmax(logits[rows, positions] / temperature)``.

    logits: ``(B, S, V)`` (any float dtype; computed in fp32); rows, positions, targets: ``(N,)``
    long. Returns ``(log_probs (N,), entropy (N,) or None)``; the entropy carries no gradient.
    Differentiable w.r.t. ``logits``; a (row, position) named twice gets both gradients.
    """
    if not rows.shape == positions.shape == targets.shape or rows.dim() != 1:
        raise ValueError(f"rows, positions and targets must be one (N,) shape, got {tuple(rows.shape)}, "
                         f"{tuple(positions.shape)}, {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_probs, entropy = _SampledTokenLogProbs.apply(logits, rows, positions, targets, float(temperature),
                                                     with_entropy)
    return log_probs, entropy if with_entropy else None
