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
from typing import Any, Callable, Optional, Sequence, Tuple

from roll_gspo.utils.imports import import_callable

logger = logging.getLogger(__name__)

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only works in the main thread; elsewhere
    # (e.g. under score_with_timeout) the caller's timeout has to do.
    p_kw = {} if in_main_thread else {"parsing_timeout": None}
    v_kw = {} if in_main_thread else {"timeout_seconds": None}
    gold = _parse_gold(gt, in_main_thread)
    pred = parse(answer, **p_kw)
    if not pred:
        num = _last_number(answer)
        pred = parse(num, **p_kw) if num is not None else []
    if not pred:
        return 0.0
    if not gold:  # unparseable reference: fall back to comparing strings
        return 1.0 if str(pred[-1]).strip() == gt else 0.0
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


def score_with_timeout(fn: Callable[..., Any], args: Sequence[Any], timeout_s: Optional[float],
                       kwargs: Optional[dict] = None) -> Tuple[float, str, str]:
    """Call ``fn(*args, **kwargs)`` with a time limit: ``(score, "ok"|"error"|"timeout", message)``.

    Errors and non-numeric or non-finite results score 0.0 with status "error"; overruns score 0.0
    with "timeout". The call runs in a daemon thread: a hung call is abandoned (Python threads
    cannot be killed) and cannot block interpreter exit. ``timeout_s`` None or <= 0: no limit.
    """
    kwargs = kwargs or {}
    box: dict = {}

    def _run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - report anything the reward raises
            box["error"] = e

    if timeout_s is None or timeout_s <= 0:
        _run()
    else:
        worker = threading.Thread(target=_run, name="reward-fn", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            return 0.0, "timeout", f"reward function exceeded {timeout_s:g}s"
    if "error" in box:
        e = box["error"]
        return 0.0, "error", f"{type(e).__name__}: {e}"
    if "value" not in box:  # e.g. SystemExit inside the worker thread
        return 0.0, "error", "reward function did not return"
    try:
        return _to_score(box["value"]), "ok", ""
    except (TypeError, ValueError) as e:
        return 0.0, "error", str(e)
