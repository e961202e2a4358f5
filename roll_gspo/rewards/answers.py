"""Reading a model's final answer out of its reply: pure functions on strings.

Two questions are kept apart. `has_answer_format` asks whether the reply wrote the rewarded format
(one `<answer>...</answer>`); `extract_answer` reads the answer whether or not it did (the tagged
answer if present, else `\\boxed{}`, else an "answer is X" phrase, else the last number, else the
last line), so accuracy measured with it does not rise when only the format is learned.
"""
from __future__ import annotations

import re
from typing import List, Optional

from roll_gspo.rewards.math_rule import strip_think

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "The answer is 42", "Final answer: 42", "answer = 42": the rest of that line.
_PHRASE = re.compile(r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE)
# A number: sign, thousands separators, decimals, a simple fraction.
_NUMBER = re.compile(r"(?<![\w.])[-+\u2212]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d])|"
                     r"(?<![\w.])[-+\u2212]?\d+(?:\.\d+)?(?:/\d+)?(?![\d])")
_MARKUP = re.compile(r"\*\*|__|`+|^#+\s*|\\\(|\\\)|\\\[|\\\]")
_LATEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")


def tagged_answer(text: str) -> Optional[str]:
    """The content of the last closed `<answer>...</answer>` in `text` (stripped), or None."""
    found = _TAGGED.findall(str(text or ""))
    return found[-1].strip() if found else None


def has_answer_format(text: str) -> bool:
    """The rewarded format: the reply (reasoning removed) holds exactly one closed
    `<answer>...</answer>` with something in it."""
    found = _TAGGED.findall(strip_think(str(text or "")))
    return len(found) == 1 and bool(found[0].strip())


def boxed_answer(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces balanced; None
    when there is none or its braces never close (a reply cut mid-answer)."""
    text = str(text or "")
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start:i - 1].strip()
    return None


def numbers(text: str) -> List[str]:
    """Every number in `text`, in order, normalised: `1,234` -> `1234`, the minus sign `−` -> `-`,
    a leading `+` dropped, `12.0`/`12.` kept as written but without a trailing dot."""
    out = []
    for m in _NUMBER.finditer(str(text or "")):
        s = m.group(0).replace(",", "").replace("\u2212", "-").lstrip("+")
        out.append(s)
    return out


def last_number(text: str) -> Optional[str]:
    """The last number in `text` (see `numbers`), or None."""
    found = numbers(text)
    return found[-1] if found else None


def clean_answer(text: str) -> str:
    """An answer without its dressing: markdown emphasis and code marks, LaTeX delimiters and
    `\\text{}` wrappers, surrounding `$`, quotes, and a trailing full stop. `**42**.` -> `42`."""
    s = str(text or "").strip()
    boxed = boxed_answer(s)
    if boxed is not None and s.startswith(("\\boxed", "$\\boxed", "\\fbox")):
        s = boxed
    s = _LATEX_WRAPPERS.sub(r"\1", s)
    s = _MARKUP.sub("", s).strip()
    previous = None
    while s != previous:  # `$12$.` and `"yes".`: peel the layers in any order
        previous = s
        s = s.rstrip(".!;,").strip().strip("$").strip()
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'":
            s = s[1:-1].strip()
    return s


def extract_answer(text: str) -> str:
    """The reply's final answer as a string ('' when it holds nothing), not needing any format:

    1. the last closed `<answer>...</answer>` (the rewarded format), cleaned;
    2. else the last `\\boxed{...}`;
    3. else the last "answer is X" / "Final answer: X" phrase: its first number (after the last `=`,
       so "is 3 + 4 = 7" gives 7; trailing words dropped) when it has one, else its text;
    4. else the last number in the reply;
    5. else the reply's last non-empty line.
    Reasoning in `<think>` blocks is dropped first (`strip_think`); an unclosed `<think>` leaves ''.
    """
    body = strip_think(str(text or ""))
    tagged = tagged_answer(body)
    if tagged is not None:
        return clean_answer(tagged)
    boxed = boxed_answer(body)
    if boxed is not None:
        return clean_answer(boxed)
    phrases = _PHRASE.findall(_MARKUP.sub("", body))
    if phrases:
        phrase = clean_answer(phrases[-1])
        number = numbers(phrase.rpartition("=")[2])  # "is 3 + 4 = 7": the result
        return number[0] if number else phrase
    number = last_number(body)
    if number is not None:
        return number
    lines = [line for line in body.splitlines() if line.strip()]
    return clean_answer(lines[-1]) if lines else ""
