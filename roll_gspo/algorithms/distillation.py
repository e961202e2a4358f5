"""On-policy distillation (OPD): a frozen teacher scores the tokens the student sampled, and the
per-token reverse KL of the student from the teacher becomes a dense reward.

On a sampled token y_t ~ pi_student, log pi_student(y_t) - log pi_teacher(y_t) is a one-sample
estimate of KL(pi_student || pi_teacher) at position t (reverse KL: mode-seeking, and it needs the
teacher's log-prob of the sampled token only, not its whole distribution). Its negative, times
`opd_kl_coef`, is added to every token's advantage (ROLL's `use_opd` adds it to the token-level
reward; with ROLL's pure-OPD settings, gamma 0 and no baseline, that is the advantage itself). The
student's log-prob is the old policy's (the one that sampled, no gradient), so the term is a
reward, not a loss: the policy loss carries its gradient.

Self-distillation (OPSD; prime-rl's `opsd`, the SDFT paper): the teacher is the student's own model,
given privileged context the student does not see: `opsd_hint` writes the row's reference answer
into a template, and `privileged_prompts` puts its token ids before the prompt the student sampled
from, so the teacher scores the same response tokens knowing the answer.
"""
from __future__ import annotations

import string
from typing import Dict, List, Sequence, Tuple

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


def opsd_hint(template: str, demonstration: str) -> str:
    """The privileged context of one row: `template` with its ``{demonstration}`` field replaced by
    the row's reference answer. ValueError when the template has no ``{demonstration}`` field, any
    other field, or braces that do not format (a literal brace is written ``{{`` / ``}}``)."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"it does not format ({exc}); write a literal brace as {{{{ or }}}}") from None
    if "demonstration" not in fields:
        raise ValueError("it has no {demonstration} field, so the teacher would see no reference answer")
    others = sorted({name for name in fields if name != "demonstration"})
    if others:
        raise ValueError(f"it names fields other than {{demonstration}}: {others}")
    return template.format(demonstration=demonstration)


def privileged_prompts(prompt_ids: Sequence[Sequence[int]], hint_ids: Sequence[Sequence[int]]) -> List[List[int]]:
    """Each row's teacher prompt: its hint's token ids, then the prompt's ids unchanged (B rows each).
    The response ids follow both prompts alike, so the teacher's log-prob of response token t is of
    the same token as the student's, with the hint in its context."""
    if len(prompt_ids) != len(hint_ids):
        raise ValueError(f"privileged_prompts: {len(prompt_ids)} prompts but {len(hint_ids)} hints")
    return [list(hint) + list(prompt) for prompt, hint in zip(prompt_ids, hint_ids)]
