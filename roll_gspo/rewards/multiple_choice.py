"""Multiple-choice answers (CrossThinkQA-style rows whose ground truth is an option letter)."""
from __future__ import annotations

import re
from typing import Any, Optional, Tuple

from roll_gspo.rewards.math_rule import strip_think

# Formats tried in order of how explicit they are; within one format the last occurrence wins
# (a model restating the question's options before answering must not be scored on those).
_BOXED = re.compile(r"\\boxed\s*\{\s*(?:\\text\s*\{\s*)?\(?\s*([A-Za-z])\s*\)?\s*\}?\s*\}")
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:：]?\s*\**\s*\(?\s*([A-Za-z])\s*\)?(?![A-Za-z])", re.IGNORECASE)
_PAREN = re.compile(r"\(\s*([A-Za-z])\s*\)")
_BARE = re.compile(r"^\s*\(?([A-Za-z])\)?[.:]?\s*$")


def extract_choice(response: str) -> Tuple[Optional[str], bool]:
    """``(letter, strict)``: the chosen option as an upper-case letter, or None; ``strict`` is
    True when it came from ``\\boxed{X}`` (the format the prompt asks for).

    Accepted, in this order: ``\\boxed{B}`` (also ``\\boxed{(b)}``, ``\\boxed{\\text{B}}``),
    ``Answer: B`` / ``the answer is (B)``, a lone ``(B)``, a response that is just ``B``.
    Case and whitespace are ignored. Reasoning inside ``<think>...</think>`` is not looked at.
    """
    text = strip_think(str(response or ""))
    for pattern, strict in ((_BOXED, True), (_ANSWER, False), (_PAREN, False), (_BARE, False)):
        found = pattern.findall(text)
        if found:
            return found[-1].upper(), strict
    return None, False


def multiple_choice_reward(prompt: str, response: str, ground_truth: Any, *, reward_type: str = "hard",
                           **kwargs) -> float:
    """``hard``: 1 when the chosen letter equals the ground truth's, else 0. ``soft``: 1 for the
    right letter in ``\\boxed{}``, 0.5 for the right letter in a looser format, 0 otherwise."""
    truth = str(ground_truth).strip().strip("()").strip().upper()[:1]
    choice, strict = extract_choice(response)
    if choice is None or choice != truth:
        return 0.0
    if reward_type == "soft" and not strict:
        return 0.5
    return 1.0
