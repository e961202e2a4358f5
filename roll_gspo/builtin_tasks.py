"""Built-in code, multiple-choice and mixed-domain tasks (the arithmetic task is in `builtin`).

`code`: write the body of a one-line integer function from its formula; the row's ground truth
holds three assert tests and the `def` line the response completes (HumanEval-style `prefix`),
scored by the code sandbox. `choice`: an arithmetic question with three options, answered by
letter. `mixed`: arithmetic, code and choice rows, each with its `domain`, for multi-domain runs.
"""
from __future__ import annotations

import json
import random
from typing import Dict, List

CODE_DOMAIN = "code_sandbox"
CHOICE_DOMAIN = "multiple_choice"
CODE_PREFIX = "def f(x): return "
# Formula templates over x with one constant a; each is also valid Python.
CODE_FORMS = ("x+{a}", "x*{a}", "{a}-x", "x*x+{a}", "{a}")


def code_row(form: str, a: int) -> dict:
    formula = form.format(a=a)
    fn = eval(f"lambda x: {formula}")  # noqa: S307 - our own fixed templates
    tests = [f"assert f({x}) == {fn(x)}" for x in (0, 1, 2)]
    truth = {"case_type": "assert", "prefix": CODE_PREFIX, "test_cases": [{"assert_code": t} for t in tests]}
    return {"prompt": f"f(x)={formula}\n{CODE_PREFIX}", "ground_truth": json.dumps(truth), "domain": CODE_DOMAIN,
            "solution": formula}


def make_code_rows(n: int, *, seed: int) -> List[dict]:
    rng = random.Random(f"code-{seed}")
    return [code_row(rng.choice(CODE_FORMS), rng.randint(1, 9)) for _ in range(n)]


def choice_row(rng: random.Random) -> dict:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    right = a + b
    options = [right, right + 1, right - 1]
    rng.shuffle(options)
    letters = "ABC"
    text = " ".join(f"({letters[i]}){v}" for i, v in enumerate(options))
    return {"prompt": f"{a}+{b}=? {text} Answer:", "ground_truth": letters[options.index(right)],
            "domain": CHOICE_DOMAIN}


def make_choice_rows(n: int, *, seed: int) -> List[dict]:
    rng = random.Random(f"choice-{seed}")
    return [choice_row(rng) for _ in range(n)]


def _write(folder: str, splits: Dict[str, List[dict]]) -> None:
    import os

    for split, rows in splits.items():
        with open(os.path.join(folder, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")


def write_code_task(folder: str, *, seed: int = 0, n_train: int = 2000, n_val: int = 64) -> None:
    rows = make_code_rows(n_train + n_val, seed=seed)
    _write(folder, {"train": rows[:n_train], "val": rows[n_train:]})


def write_choice_task(folder: str, *, seed: int = 0, n_train: int = 2000, n_val: int = 64) -> None:
    rows = make_choice_rows(n_train + n_val, seed=seed)
    _write(folder, {"train": rows[:n_train], "val": rows[n_train:]})


def write_mixed_task(folder: str, *, seed: int = 0, n_train: int = 3000, n_val: int = 96) -> None:
    """A third each of arithmetic (levels 1-2, domain math_rule), code and choice rows."""
    from roll_gspo.builtin import make_arith_samples

    def mix(n: int, offset: int) -> List[dict]:
        third = n // 3
        arith = make_arith_samples(n - 2 * third, seed=seed + offset, levels=(1, 2))
        rows = arith + make_code_rows(third, seed=seed + offset) + make_choice_rows(third, seed=seed + offset)
        random.Random(f"mixed-{seed}-{offset}").shuffle(rows)
        return rows

    _write(folder, {"train": mix(n_train, 0), "val": mix(n_val, 1)})
