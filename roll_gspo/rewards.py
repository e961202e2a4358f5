"""Reward functions: pure Python, no Ray, safe on arbitrary model output.

A reward function has the signature ``fn(prompt, response, ground_truth, **kwargs) -> float``.
"""
from __future__ import annotations

import functools
import logging
import math
import numbers
import re
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from roll_gspo.utils.imports import import_callable

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

    Falls back to the last number in the text when math-verify extracts nothing. Never raises.
    """
    try:
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
    # (e.g. under score_many_with_timeout) the caller's timeout has to do.
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


def load_reward_fn(path: str) -> Callable[..., Any]:
    """The reward function named ``"pkg.mod:fn"`` or ``"pkg.mod.fn"``; errors name the path."""
    return import_callable(path)


def _to_score(value: Any) -> float:
    """A finite float, or ValueError/TypeError; strings are rejected (not silently parsed)."""
    if isinstance(value, numbers.Real):
        score = float(value)
    elif hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy / torch scalars
        score = value.item()
        if not isinstance(score, numbers.Real):
            raise TypeError(f"reward is {type(value).__name__} holding {score!r}, not a number")
        score = float(score)
    else:
        raise TypeError(f"reward is {type(value).__name__} ({value!r:.80}), not a number")
    if not math.isfinite(score):
        raise ValueError(f"reward is not finite ({score})")
    return score


def _checked_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict) -> Tuple[float, str, str]:
    """``(score, "ok", "")``, or ``(0.0, "error", why)`` when fn raises or returns a non-number."""
    try:
        return _to_score(fn(*args, **kwargs)), "ok", ""
    except (Exception, SystemExit) as e:  # noqa: BLE001 - report anything the reward raises
        return 0.0, "error", f"{type(e).__name__}: {e}"


def score_many_with_timeout(fn: Callable[..., Any], calls: Sequence[Sequence[Any]], timeout_s: Optional[float],
                            kwargs: Optional[dict] = None) -> List[Tuple[float, str, str]]:
    """``fn(*args, **kwargs)`` for each ``args`` in ``calls``, each call limited to ``timeout_s``:
    a list of ``(score, "ok"|"error"|"timeout", message)``.

    Errors and non-numeric or non-finite results score 0.0 with status "error"; a call that overruns
    scores 0.0 with "timeout". All calls run in order in one daemon thread (a thread per call costs
    a scheduler hand-off each, which on a busy machine is most of a cheap reward's time); a hung
    call is abandoned there (Python threads cannot be killed, and a daemon one cannot block
    interpreter exit) and a fresh thread goes on with the next. ``timeout_s`` None or <= 0: no
    limit, calls run in the caller's thread.
    """
    kwargs = kwargs or {}
    if timeout_s is None or timeout_s <= 0:
        return [_checked_call(fn, args, kwargs) for args in calls]
    results: List[Optional[Tuple[float, str, str]]] = [None] * len(calls)
    lock = threading.Lock()
    # The call now running: its index, when it started, and which thread owns the results.
    current = {"index": 0, "started": time.monotonic(), "owner": 0}

    def run_from(first: int, owner: int) -> None:
        for index in range(first, len(calls)):
            with lock:
                if current["owner"] != owner:
                    return
                current["index"], current["started"] = index, time.monotonic()
            outcome = _checked_call(fn, calls[index], kwargs)
            with lock:
                if current["owner"] != owner:  # abandoned after a timeout: its result is void
                    return
                results[index] = outcome

    def start(first: int, owner: int) -> threading.Thread:
        thread = threading.Thread(target=run_from, args=(first, owner), name="reward-fn", daemon=True)
        thread.start()
        return thread

    thread = start(0, 0)
    while True:
        with lock:
            index, started = current["index"], current["started"]
        thread.join(max(timeout_s - (time.monotonic() - started), 0.0) + 1e-3)
        if not thread.is_alive():
            break
        with lock:
            overran = (current["index"], current["started"]) == (index, started) and results[index] is None \
                and time.monotonic() - started >= timeout_s
            if overran:
                results[index] = (0.0, "timeout", f"reward function exceeded {timeout_s:g}s")
                current["owner"] += 1
        if overran:
            if index + 1 == len(calls):
                break
            thread = start(index + 1, current["owner"])
    # A thread that ended without a result for its call (e.g. SystemExit inside it).
    return [r if r is not None else (0.0, "error", "reward function did not return") for r in results]


def score_with_timeout(fn: Callable[..., Any], args: Sequence[Any], timeout_s: Optional[float],
                       kwargs: Optional[dict] = None) -> Tuple[float, str, str]:
    """One call of :func:`score_many_with_timeout`."""
    return score_many_with_timeout(fn, [args], timeout_s, kwargs)[0]
