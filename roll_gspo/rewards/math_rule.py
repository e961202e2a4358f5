"""Math and string-match rewards: pure Python, no Ray, safe on arbitrary model output."""
from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_INTEGER = re.compile(r"-?\d+")


def strip_think(text: str) -> str:
    """Drop reasoning so numbers inside it are not taken for the answer.

    Closed ``<think>...</think>`` blocks are removed; text before a lone ``</think>`` (templates
    that open the block in the prompt) is dropped; an unclosed ``<think>`` means the answer was
    never written, so everything after it goes.
    """
    text = _THINK_BLOCK.sub(" ", text)
    low = text.lower()
    if "</think>" in low:
        text = text[low.rindex("</think>") + len("</think>"):]
        low = text.lower()
    if "<think>" in low:
        text = text[:low.index("<think>")]
    return text


def opens_think(prompt: str) -> bool:
    """True when the prompt ends inside an open ``<think>`` block (R1-style templates put the
    ``<think>`` in the prompt, so the response starts mid-reasoning)."""
    low = str(prompt or "").lower()
    return low.rfind("<think>") > low.rfind("</think>")


def unfinished_think(prompt: str, response: str) -> bool:
    """The response stopped inside its reasoning: an unclosed ``<think>`` of its own, or a
    ``<think>`` opened by the prompt that the response never closes. Nothing after it is an
    answer."""
    low = str(response or "").lower()
    if low.rfind("<think>") > low.rfind("</think>"):
        return True
    return opens_think(prompt) and "</think>" not in low


def _last_number(text: str) -> Optional[str]:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str, in_main_thread: bool):
    """A group's G responses share one ground truth: parse it once (60-70% of a call's time)."""
    from math_verify import parse

    kwargs = {} if in_main_thread else {"parsing_timeout": None}
    return parse(ground_truth, **kwargs) or parse(f"${ground_truth}$", **kwargs)


def math_verify_reward(prompt: str, response: str, ground_truth: Any, **kwargs) -> float:
    """1.0 if math-verify judges the response's final answer equal to ``ground_truth``, else 0.0.

    Falls back to the last number in the text when math-verify extracts nothing. A response that
    stops inside its reasoning (see :func:`unfinished_think`) scores 0. Never raises.
    """
    try:
        if unfinished_think(prompt, response):
            return 0.0
        return _verify_answer(strip_think(str(response or "")), str(ground_truth).strip(),
                              threading.current_thread() is threading.main_thread())
    except Exception as e:  # garbage in, 0 out; the run must go on
        logger.debug("math_verify_reward failed: %s", e)
        return 0.0


@functools.lru_cache(maxsize=65536)
def _verify_answer(answer: str, gt: str, in_main_thread: bool) -> float:
    """Score one (answer, ground truth) pair; cached, since a group's G samples often repeat."""
    import sympy
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only works in the main thread; elsewhere
    # the caller's timeout has to do (a RewardProcess child runs calls in its main thread).
    p_kw = {} if in_main_thread else {"parsing_timeout": None}
    v_kw = {} if in_main_thread else {"timeout_seconds": None}
    gold = _parse_gold(gt, in_main_thread)
    pred = parse(answer, **p_kw)
    if not pred:
        num = _last_number(answer)
        if num is not None and _INTEGER.fullmatch(num):
            # Built directly: math-verify would send it through sympy's string parser (~0.8 ms).
            pred = [sympy.Integer(int(num)), str(int(num))]
        else:
            pred = parse(num, **p_kw) if num is not None else []
    if not pred:
        return 0.0
    if not gold:  # unparseable reference: fall back to comparing strings
        return 1.0 if str(pred[-1]).strip() == gt else 0.0
    if isinstance(gold[0], sympy.Integer) and isinstance(pred[0], sympy.Integer):
        # What verify concludes for two integers, without its ~0.3 ms of sympy machinery (most
        # of a step's reward time on integer-answer tasks).
        return 1.0 if gold[0] == pred[0] else 0.0
    return 1.0 if verify(gold, pred, **v_kw) else 0.0


def regex_match_reward(prompt: str, response: str, ground_truth: Any, *,
                       pattern: Optional[str] = None, **kwargs) -> float:
    """Exact match after strip, or with ``pattern``: its group(1) (or whole match) vs the truth."""
    text = "" if response is None else str(response)
    truth = str(ground_truth).strip()
    if pattern is None:
        return 1.0 if text.strip() == truth else 0.0
    m = re.search(pattern, text)
    if m is None:
        return 0.0
    got = m.group(1) if m.re.groups >= 1 else m.group(0)
    return 1.0 if got is not None and got.strip() == truth else 0.0
