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

Several teachers (ROLL's multi-teacher form): each scores the rows routed to it (`routed_rows`), and
a row's term is the sum over its teachers of coef_i * (student - teacher_i). That equals
W * (student - T) with W = sum_i coef_i and T = sum_i coef_i * teacher_i / W (`combine_teachers`), so
one teacher log-prob and one weight per row carry any number of teachers.
"""
from __future__ import annotations

import string
from typing import AbstractSet, Dict, List, Mapping, Sequence, Tuple, Union

import torch


def opd_advantages(advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   response_mask: torch.Tensor, kl_coef: Union[float, torch.Tensor]
                   ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """advantages_t - kl_coef * (student_logp_t - teacher_logp_t) on the response's tokens.

    advantages, student_log_probs (the old policy's), teacher_log_probs, response_mask: ``(B, T)``
    (mask 1 on generated tokens); kl_coef: one float, or ``(B,)`` per row (several teachers:
    `combine_teachers`; 0 on a row no teacher scored). Returns the ``(B, T)`` advantages (0 off the
    mask, where the log-probs are padding) and metrics over the rows with a weight > 0:
    ``opd/reverse_kl`` the token mean of the reverse KL, ``opd/reverse_kl_seq_max`` the largest
    response mean, ``opd/teacher_logp`` and ``opd/student_logp`` the token means of both log-probs,
    ``opd/advantage_mean`` the token mean of the term added, ``opd/rows_scored`` the share of rows a
    teacher scored.
    """
    if not (advantages.shape == student_log_probs.shape == teacher_log_probs.shape == response_mask.shape):
        raise ValueError(f"opd_advantages: shapes differ: advantages {tuple(advantages.shape)}, student "
                         f"{tuple(student_log_probs.shape)}, teacher {tuple(teacher_log_probs.shape)}, mask "
                         f"{tuple(response_mask.shape)}")
    coef = torch.as_tensor(kl_coef, dtype=advantages.dtype, device=advantages.device)
    if coef.dim() == 0:
        coef = coef.expand(advantages.shape[0])
    if coef.shape != advantages.shape[:1]:
        raise ValueError(f"opd_advantages: kl_coef has shape {tuple(coef.shape)}, expected ({advantages.shape[0]},)")
    if bool((coef < 0).any()):
        raise ValueError(f"opd_advantages: kl_coef = {float(coef.min())} must be >= 0")
    mask = response_mask.bool() & (coef > 0)[:, None]
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    reverse_kl = torch.where(mask, (student_log_probs - teacher_log_probs).to(advantages.dtype), zero)
    term = -coef[:, None] * reverse_kl
    out = torch.where(response_mask.bool(), advantages + term, zero)
    tokens = mask.sum().clamp(min=1)
    lengths = mask.sum(-1).clamp(min=1)
    metrics = {
        "opd/reverse_kl": float(reverse_kl.sum() / tokens),
        "opd/reverse_kl_seq_max": float((reverse_kl.sum(-1) / lengths).max()) if len(lengths) else 0.0,
        "opd/rows_scored": float((coef > 0).float().mean()) if len(coef) else 0.0,
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


def routed_rows(tag_included: Sequence[str], domains: Sequence[str],
                domain_tags: Mapping[str, AbstractSet[str]]) -> torch.Tensor:
    """``(B,)`` bool: the rows a teacher scores. Empty `tag_included`: every row; else a row whose
    reward domain, or one of that domain's tags (`domain_tags`: its reward block's `tag_included`), is
    listed (ROLL's multi-teacher routing, which matches the tags; the domain's own name counts too)."""
    if not tag_included:
        return torch.ones(len(domains), dtype=torch.bool)
    wanted = set(tag_included)
    return torch.tensor([bool(({domain} | set(domain_tags.get(domain, ()))) & wanted) for domain in domains],
                        dtype=torch.bool)


def combine_teachers(scored: Mapping[str, Tuple[torch.Tensor, torch.Tensor]], coefs: Mapping[str, float],
                     batch_shape: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Several teachers' log-probs as one teacher log-prob and one weight per row.

    scored: teacher -> (``(B, T)`` log-probs, ``(B,)`` bool rows it scored; its other rows are
    ignored); coefs: teacher -> its weight (>= 0). Returns ``(B, T)`` T = sum_i c_i t_i / W and
    ``(B,)`` W = sum_i c_i over the teachers of each row (0 and W = 0 on a row none scored), so
    W * (s - T) = sum_i c_i * (s - t_i) for any student log-prob s. A row one teacher scored gets that
    teacher's log-probs exactly (no c * t / c rounding: one teacher runs as it always did)."""
    total = torch.zeros(batch_shape, dtype=torch.float32)
    alone = torch.zeros(batch_shape, dtype=torch.float32)
    weight = torch.zeros(batch_shape[0], dtype=torch.float32)
    count = torch.zeros(batch_shape[0], dtype=torch.long)
    for name, (log_probs, rows) in scored.items():
        c = rows.float() * float(coefs[name])
        own = torch.where(rows[:, None], log_probs.float(), torch.zeros(()))
        total, alone = total + c[:, None] * own, alone + own
        weight, count = weight + c, count + rows.long()
    mixed = torch.where(weight[:, None] > 0, total / weight.clamp(min=1e-12)[:, None], torch.zeros(()))
    return torch.where((count == 1)[:, None], alone, mixed), weight
