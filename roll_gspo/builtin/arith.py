"""Synthetic arithmetic tasks: verifiable prompts in five difficulty levels, and SFT rows."""
from __future__ import annotations

import random
from typing import Dict, Iterable, List, Sequence, Tuple

ARITH_LEVELS: Tuple[int, ...] = (1, 2, 3, 4, 5)
ARITH_DOMAIN = "math_rule"
SFT_BIASED_P_CORRECT = 0.35
LEVEL_DESCRIPTIONS = {
    1: "single-digit a+b",
    2: "two-digit + one-digit (either order)",
    3: "two-digit a+b",
    4: "subtraction a-b with a, b < 100 (may be negative)",
    5: "multiplication a*b, one factor 1-9 and the other 1-20",
}


def arith_level_space(level: int) -> List[Tuple[str, str]]:
    """Every (prompt, answer) of a level, in a fixed order. Prompts look like ``12+35=``."""
    pairs: List[Tuple[int, int]]
    if level == 1:
        pairs, op = [(a, b) for a in range(10) for b in range(10)], "+"
    elif level == 2:
        pairs = [(a, b) for a in range(10, 100) for b in range(10)]
        pairs += [(b, a) for a, b in pairs]
        op = "+"
    elif level == 3:
        pairs, op = [(a, b) for a in range(10, 100) for b in range(10, 100)], "+"
    elif level == 4:
        pairs, op = [(a, b) for a in range(100) for b in range(100)], "-"
    elif level == 5:
        pairs = [(a, b) for a in range(1, 10) for b in range(1, 21)]
        pairs = sorted(set(pairs + [(b, a) for a, b in pairs]))
        op = "*"
    else:
        raise ValueError(f"unknown arithmetic level {level!r}; valid: {list(ARITH_LEVELS)}")
    fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}[op]
    return [(f"{a}{op}{b}=", str(fn(a, b))) for a, b in pairs]


def _row(prompt: str, answer: str, level: int) -> dict:
    return {"prompt": prompt, "ground_truth": answer, "domain": ARITH_DOMAIN, "level": level}


def make_arith_samples(n: int, *, seed: int, levels: Sequence[int] = ARITH_LEVELS,
                       exclude: Iterable[str] = ()) -> List[dict]:
    """``n`` arithmetic rows, levels balanced (round-robin), deterministic from ``seed``.

    Each level walks through its shuffled prompt space, reshuffling when exhausted, so a level
    repeats prompts only once all have been used. Prompts in ``exclude`` are never produced.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    levels = list(levels)
    if not levels:
        raise ValueError("levels must not be empty")
    rng = random.Random(seed)
    excluded = set(exclude)
    pools: Dict[int, List[Tuple[str, str]]] = {}
    for lv in sorted(set(levels)):
        pool = [p for p in arith_level_space(lv) if p[0] not in excluded]
        if not pool:
            raise ValueError(f"arithmetic level {lv} has no prompts left after exclusions")
        pools[lv] = pool
    cursors = {lv: len(pool) for lv, pool in pools.items()}  # forces a shuffle on first draw
    rows = []
    for i in range(n):
        lv = levels[i % len(levels)]
        pool = pools[lv]
        if cursors[lv] >= len(pool):
            rng.shuffle(pool)
            cursors[lv] = 0
        prompt, answer = pool[cursors[lv]]
        cursors[lv] += 1
        rows.append(_row(prompt, answer, lv))
    rng.shuffle(rows)
    return rows


def make_arith_splits(*, seed: int = 0, n_train: int = 20000, n_val: int = 256,
                      n_sft: int = 20000, levels: Sequence[int] = ARITH_LEVELS,
                      max_val_fraction: float = 0.25) -> Dict[str, List[dict]]:
    """Train / val / sft rows; val prompts never occur in train or sft.

    Val takes at most ``max_val_fraction`` of each level's prompt space (level 1 has only 100),
    spreading the rest of its quota over the larger levels.
    """
    levels = sorted(set(levels))
    rng = random.Random(f"arith-val-{seed}")
    spaces = {lv: arith_level_space(lv) for lv in levels}
    for lv in levels:
        rng.shuffle(spaces[lv])
    caps = {lv: int(len(spaces[lv]) * max_val_fraction) for lv in levels}
    if sum(caps.values()) < n_val:
        raise ValueError(f"n_val={n_val} too large for levels {levels}")
    quota = {lv: 0 for lv in levels}
    remaining = n_val
    while remaining:
        for lv in levels:
            if remaining and quota[lv] < caps[lv]:
                quota[lv] += 1
                remaining -= 1
    val = [_row(p, a, lv) for lv in levels for p, a in spaces[lv][:quota[lv]]]
    rng.shuffle(val)
    val_prompts = {r["prompt"] for r in val}
    train = make_arith_samples(n_train, seed=seed, levels=levels, exclude=val_prompts)
    sft = make_arith_samples(n_sft, seed=seed + 1, levels=levels, exclude=val_prompts)
    for r in sft:
        r["response"] = r["ground_truth"]  # SFT target: the bare answer, then eos
    return {"train": train, "val": val, "sft": sft, "sft_biased": biased_sft_rows(sft, seed=seed)}


def biased_sft_rows(rows: Sequence[dict], *, seed: int, p_correct: float = SFT_BIASED_P_CORRECT) -> List[dict]:
    """SFT rows whose target is the true answer with probability ``p_correct`` and otherwise
    the answer plus one: a consistent, plausible mistake. A model fitted to them puts most of its
    mass on the wrong answer (greedy decoding is mostly wrong) while still sampling the right one
    often enough for rewards to find it: the warm start RL needs to show it learns."""
    rng = random.Random(f"arith-sft-biased-{seed}")
    out = []
    for r in rows:
        right = rng.random() < p_correct
        out.append({**r, "response": r["ground_truth"] if right else str(int(r["ground_truth"]) + 1)})
    return out
