"""On-policy distillation (OPD): a frozen teacher scores the tokens the student sampled, and the
per-token reverse KL of the student from the teacher becomes a dense reward.

On a sampled token y_t ~ pi_student, log pi_student(y_t) - log pi_teacher(y_t) is a one-sample
estimate of KL(pi_student || pi_teacher) at position t (reverse KL: mode-seeking, and it needs the
teacher's log-prob of the sampled token only, not its whole distribution). Its negative, times
`opd_kl_coef`, is added to every token's advantage (ROLL's `use_opd` adds it to the token-level
reward; with ROLL's pure-OPD settings, gamma 0 and no baseline, that is the advantage itself). The
student's log-prob is the old policy's (the one that sampled, no gradient), so the term is a
reward, not a loss: the policy loss carries its gradient.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch


def opd_advantages(advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   response_mask: torch.Tensor, kl_coef: float) -> Tuple[torch.Tensor, Dict[str, float]]:
    """advantages_t - kl_coef * (student_logp_t - teacher_logp_t) on the response's tokens.

    advantages, student_log_probs (the old policy's), teacher_log_probs, response_mask: ``(B, T)``
    (mask 1 on generated tokens). Returns the ``(B, T)`` advantages (0 off the mask, where the
    log-probs are padding) and metrics: ``opd/reverse_kl`` the token mean of the reverse KL,
    ``opd/reverse_kl_seq_max`` the largest response mean, ``opd/teacher_logp`` and
    ``opd/student_logp`` the token means of both log-probs, ``opd/advantage_mean`` the token mean of
    the term added.
    """
    if not (advantages.shape == student_log_probs.shape == teacher_log_probs.shape == response_mask.shape):
        raise ValueError(f"opd_advantages: shapes differ: advantages {tuple(advantages.shape)}, student "
                         f"{tuple(student_log_probs.shape)}, teacher {tuple(teacher_log_probs.shape)}, mask "
                         f"{tuple(response_mask.shape)}")
    if kl_coef < 0:
        raise ValueError(f"opd_advantages: kl_coef = {kl_coef} must be >= 0")
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    reverse_kl = torch.where(mask, (student_log_probs - teacher_log_probs).to(advantages.dtype), zero)
    term = -kl_coef * reverse_kl
    out = torch.where(mask, advantages + term, zero)
    tokens = mask.sum().clamp(min=1)
    lengths = mask.sum(-1).clamp(min=1)
    metrics = {
        "opd/reverse_kl": float(reverse_kl.sum() / tokens),
        "opd/reverse_kl_seq_max": float((reverse_kl.sum(-1) / lengths).max()) if len(lengths) else 0.0,
        "opd/teacher_logp": float(torch.where(mask, teacher_log_probs, zero).sum() / tokens),
        "opd/student_logp": float(torch.where(mask, student_log_probs, zero).sum() / tokens),
        "opd/advantage_mean": float(term.sum() / tokens),
    }
    return out, metrics
