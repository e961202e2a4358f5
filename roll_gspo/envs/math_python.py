"""Math word problems answered in ``\\boxed{...}``, for agents that may compute with a tool first.

ROLL's `roll_math` (GEM's MathEnv): one problem per episode, the episode ends on the first turn
that gives an answer, reward 1 if it is right. The Python tool (or a calculator) is not part of
the env: `tools.wrap_with_tools` wraps it (``tool_wrapper`` in YAML), and tool calls never reach
this class.

Problems come from, in order:

* ``dataset_path`` (or ROLL's ``dataset_name`` when it names a local file): a JSONL file (or a
  JSON list) of rows with a question and an answer (``question_key``, default ``question``, else
  ``problem``; ``answer_key``, default ``answer``); a folder holding ``<split>.jsonl``. No model
  hub here, so a hub name (``axon-rl/GSM-8k``) is an error naming the file to give instead.
* otherwise generated arithmetic, offline and seeded: ``num_operands`` integers in
  [1, ``max_operand``] joined by ``operators`` (from ``+-*``), e.g. ``What is 12*7+5?``.

The row of an episode: ``mode: train`` draws one from the seed (``seed`` in env_config is added
to the reset seed), ``mode: val`` walks the rows in order (reset seed modulo the row count),
ROLL's sample / traversal modes.

Answer: the content of the last ``\\boxed{...}`` (braces balanced), or the last group of the
last match of ``answer_pattern``. It is right when it equals the reference as a number (integers,
decimals, fractions, thousands separators) or, failing that, by math-verify
(`roll_gspo.rewards.math_rule`). A turn with no answer costs ``format_penalty``
(``action_is_valid`` False); after ``max_steps`` such turns the episode is truncated (ROLL ends at
the first one: ``max_steps: 1``, the default).
"""
from __future__ import annotations

import json
import os
import re
import threading
from fractions import Fraction
from typing import Any, Dict, List, Optional, Tuple

from roll_gspo.envs.base import Env, as_float, compile_action_pattern, episode_rng, extract_action, positive_int
from roll_gspo.envs.tools.calculator import evaluate_arithmetic

GENERATED_OPERATORS = "+-*"
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:/\d+)?$")
_DATASETS: Dict[Tuple[str, float], List[dict]] = {}
_DATASETS_LOCK = threading.Lock()


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` in `text`, nested braces included; None if none."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for i in range(start + len("\\boxed"), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{"):i].strip()
        start = text.rfind("\\boxed{", 0, start)  # unclosed: try an earlier one
    return None


def _as_number(text: str) -> Optional[Fraction]:
    cleaned = text.strip().strip("$").replace(",", "").replace(" ", "")
    if cleaned.endswith(".") and cleaned[:-1].replace("-", "").isdigit():
        cleaned = cleaned[:-1]
    if not _NUMBER.match(cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str, reference: Any) -> bool:
    """Whether the model's `answer` equals `reference`: as numbers when both parse, else by
    math-verify (imported only then)."""
    reference = str(reference).strip()
    got, want = _as_number(answer), _as_number(last_boxed(reference) or reference)
    if got is not None and want is not None:
        return got == want
    if answer.strip() == reference:
        return True
    from roll_gspo.rewards.math_rule import math_verify_reward

    return math_verify_reward("", "\\boxed{%s}" % answer, reference) > 0.5


def resolve_dataset(dataset_path: Optional[str], dataset_name: Optional[str], split: str) -> Optional[str]:
    """The local file of the problems, None for generated ones; ValueError naming the key when
    the given path is not a readable file."""
    given = dataset_path or dataset_name
    if not given:
        return None
    key = "dataset_path" if dataset_path else "dataset_name"
    path = os.path.expanduser(str(given))
    if os.path.isdir(path):
        path = os.path.join(path, f"{split}.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{key} {given!r}: no such file (give a local JSONL file of {{question, answer}} rows, "
                         f"or a folder with {split}.jsonl; there is no model/dataset hub here)")
    return path


def load_rows(path: str) -> List[dict]:
    """The rows of a JSONL file or a JSON list, cached per file and modification time (many env
    objects share one dataset)."""
    key = (path, os.path.getmtime(path))
    with _DATASETS_LOCK:
        if key in _DATASETS:
            return _DATASETS[key]
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        rows = json.loads(text)
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON line: {exc}") from None
    if not rows or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{path}: expected a non-empty list of JSON objects")
    with _DATASETS_LOCK:
        _DATASETS[key] = rows
    return rows


class MathPythonEnv(Env):
    """One math problem per episode; see the module docstring."""

    def __init__(self, dataset_path: Optional[str] = None, dataset_name: Optional[str] = None, split: str = "train",
                 question_key: Optional[str] = None, answer_key: str = "answer", mode: str = "train", seed: int = 0,
                 answer_pattern: Optional[str] = None, max_steps: int = 1, format_penalty: float = 0.0,
                 num_operands: int = 2, max_operand: int = 20, operators: str = GENERATED_OPERATORS,
                 env_instruction: Optional[str] = None):
        super().__init__()
        self.path = resolve_dataset(dataset_path, dataset_name, split)
        self.question_key, self.answer_key = question_key, answer_key
        if mode not in ("train", "val"):
            raise ValueError(f"mode {mode!r}: valid are 'train' (draw by seed) and 'val' (in order)")
        self.mode = mode
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self.answer_pattern = answer_pattern
        self._pattern = compile_action_pattern(answer_pattern, "answer_pattern") if answer_pattern else None
        self.max_steps = positive_int(max_steps, "max_steps")
        self.format_penalty = as_float(format_penalty, "format_penalty")
        self.num_operands = positive_int(num_operands, "num_operands", 2)
        self.max_operand = positive_int(max_operand, "max_operand")
        if not isinstance(operators, str) or not operators or set(operators) - set(GENERATED_OPERATORS):
            raise ValueError(f"operators must be a non-empty string of {GENERATED_OPERATORS!r}, got {operators!r}")
        self.operators = operators
        self.env_instruction = env_instruction
        self.question, self.answer = "", ""
        self.turn = 0
        self.done = True

    def _row(self, seed: Optional[int]) -> Tuple[str, str]:
        rows = load_rows(self.path)  # type: ignore[arg-type]
        if self.mode == "val" and seed is not None:
            row = rows[(seed + self.seed) % len(rows)]
        else:
            row = rows[episode_rng(None if seed is None else seed + self.seed).randrange(len(rows))]
        question_key = self.question_key or ("question" if "question" in row else "problem")
        missing = [k for k in (question_key, self.answer_key) if k not in row]
        if missing:
            raise ValueError(f"{self.path}: a row lacks {missing} (has {sorted(row)}); set question_key/answer_key")
        return str(row[question_key]), str(row[self.answer_key])

    def _generated(self, seed: Optional[int]) -> Tuple[str, str]:
        rng = episode_rng(None if seed is None else seed + self.seed)
        parts = [str(rng.randint(1, self.max_operand))]
        for _ in range(self.num_operands - 1):
            parts += [rng.choice(self.operators), str(rng.randint(1, self.max_operand))]
        expression = "".join(parts)
        value = evaluate_arithmetic(expression)
        return f"What is {expression}?", str(int(value))

    def reset(self, seed: Optional[int] = None) -> Tuple[str, dict]:
        self.question, self.answer = self._row(seed) if self.path else self._generated(seed)
        self.turn, self.done = 0, False
        return self.question, {"env_instruction": self.instructions()}

    def extract_answer(self, text: str) -> Optional[str]:
        text = "" if text is None else str(text)
        if self._pattern is None:
            return last_boxed(text)
        return extract_action(text, self._pattern, last_match=True)

    def step(self, action: str) -> Tuple[str, float, bool, bool, dict]:
        if self.done:
            raise RuntimeError("MathPythonEnv.step after the episode ended: call reset() first")
        self.turn += 1
        answer = self.extract_answer(action)
        info: Dict[str, Any] = {"action_is_valid": answer is not None}
        if answer is None:
            truncated = self.turn >= self.max_steps
            info["metrics"] = {"action_is_valid": 0.0}
            if truncated:
                self.done = True
                info["success"] = False
                info["metrics"]["success"] = 0.0
            return "No \\boxed{} answer found.", self.format_penalty, False, truncated, info
        correct = answers_match(answer, self.answer)
        self.done = True
        info["success"] = correct
        info["metrics"] = {"action_is_valid": 1.0, "success": float(correct)}
        return ("Correct." if correct else "Wrong."), float(correct), True, False, info

    def instructions(self) -> str:
        if self.env_instruction is not None:
            return self.env_instruction
        return "Solve the problem. Put the final answer in \\boxed{}, e.g. \\boxed{42}."

    def sample_random_action(self) -> str:
        return "\\boxed{0}"
