"""pass@k and maj@k over n samples per prompt: pure functions, shared by training validation
(`val/pass@k`) and the evaluation command."""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), the chance
    that k of the n samples, drawn without replacement, hold at least one of the c correct ones.
    Computed as a product (no huge binomials). Needs 1 <= k <= n, 0 <= c <= n."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_correct(answers: Sequence[str], correct: Sequence[bool]) -> bool:
    """maj@k of one prompt: is the most frequent answer (ties: the one seen first; empty answers
    do not vote) a correct one? answers, correct: one per sample, same length."""
    votes = Counter(a for a in answers if a)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a and votes[a] == top)
    return any(ok for a, ok in zip(answers, correct) if a == winner)


def default_ks(n: int) -> List[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def sample_metrics(groups: Sequence[Sequence[bool]], answers: Optional[Sequence[Sequence[str]]] = None,
                   ks: Optional[Sequence[int]] = None) -> Dict[str, float]:
    """`pass@k` (unbiased, averaged over prompts) for each k, and with `answers` `maj@k` (the
    majority vote of each prompt's first k samples) for each k > 1.

    groups: per prompt, its n samples' correctness (n the same for all). answers: per prompt,
    its samples' extracted answers. ks: default `default_ks(n)`; ks above n are skipped."""
    if not groups:
        return {}
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(f"sample_metrics needs the same number of samples per prompt, got {sorted({len(g) for g in groups})}")
    out: Dict[str, float] = {}
    for k in [k for k in (ks or default_ks(n)) if 1 <= k <= n]:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(map(bool, g)), k) for g in groups) / len(groups)
        if answers is not None and k > 1:
            out[f"maj@{k}"] = sum(majority_correct(a[:k], g[:k]) for a, g in zip(answers, groups)) / len(groups)
    return out


def grouped_sample_metrics(domains: Sequence[str], correct: Sequence[Optional[float]], answers: Sequence[str],
                           n: int, ks: Optional[Sequence[int]] = None) -> Dict[str, float]:
    """`sample_metrics` overall and per domain (`<domain>/pass@k`) from flat per-sample lists with
    n consecutive samples per prompt (a rollout's layout). Prompts whose worker has no notion of
    correct (None) are left out. domains, correct, answers: length prompts * n."""
    by_domain: Dict[str, List[int]] = {}
    for p in range(len(domains) // n):
        if all(c is not None for c in correct[p * n:(p + 1) * n]):
            by_domain.setdefault(domains[p * n], []).append(p)

    def metrics(prompts: List[int]) -> Dict[str, float]:
        return sample_metrics([[bool(c) for c in correct[p * n:(p + 1) * n]] for p in prompts],
                              [list(answers[p * n:(p + 1) * n]) for p in prompts], ks)

    out = metrics([p for ps in by_domain.values() for p in ps])
    for domain in sorted(by_domain):
        out.update({f"{domain}/{k}": v for k, v in metrics(by_domain[domain]).items()})
    return out


def reference_answer(ground_truth: str) -> str:
    """The reference answer of a row's ground truth: a task row's JSON `answer`, else the string."""
    import json

    try:
        truth = json.loads(ground_truth)
    except (TypeError, ValueError):
        return str(ground_truth)
    return str(truth.get("answer", ground_truth)) if isinstance(truth, dict) else str(truth)


def answer_spread(domains: Sequence[str], answers: Sequence[str], references: Sequence[str]) -> Dict[str, float]:
    """Per domain, how far accuracy could come from one answer repeated (a policy that collapsed
    onto a task's most common answer rather than solving it):

    - `<domain>/top_answer_share`: the share of replies giving that domain's most common extracted
      answer (1.0: one answer to every prompt; empty answers count as their own);
    - `<domain>/constant_answer_accuracy`: the accuracy of the best constant reply, the share of
      the most common reference answer (exact string match: a task that accepts variants may
      credit a constant a little more).
    domains, answers, references: one per reply."""
    out: Dict[str, float] = {}
    for domain in sorted(set(domains)):
        rows = [i for i, d in enumerate(domains) if d == domain]
        out[f"{domain}/top_answer_share"] = Counter(answers[i] for i in rows).most_common(1)[0][1] / len(rows)
        out[f"{domain}/constant_answer_accuracy"] = Counter(references[i] for i in rows).most_common(1)[0][1] / len(rows)
    return out
