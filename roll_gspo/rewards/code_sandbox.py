"""The code reward: the response's code (its last fenced block after any reasoning) run against
the row's tests in the code sandbox (`roll_gspo.sandbox`, which has the details of the isolation
and of the verdicts), and the score of the verdicts.
"""
from __future__ import annotations

import re
from typing import Any, List, Sequence, Tuple

from roll_gspo.rewards.math_rule import strip_think
# Re-exported: the code reward's callers build a sandbox and read its results through this module.
from roll_gspo.sandbox.code_sandbox import ProgramResult, Sandbox, parse_tests, run_program_tests

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)

__all__ = ["ProgramResult", "Sandbox", "code_outcome", "extract_code", "parse_tests", "run_tests"]


def extract_code(response: str) -> str:
    """The last fenced code block of the answer (after any reasoning), else the answer itself."""
    text = strip_think(str(response or ""))
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks else text


def run_tests(sandbox: Sandbox, response: str, ground_truth: Any, *, stop_on_failure: bool = False
              ) -> List[ProgramResult]:
    """The response's code as one program per test case; the verdict of each (``skipped`` for those
    not run after a failure when ``stop_on_failure``: enough for a hard reward)."""
    return run_program_tests(sandbox, extract_code(response), ground_truth, stop_on_failure=stop_on_failure)


def code_outcome(results: Sequence[ProgramResult], reward_type: str = "hard") -> Tuple[float, str, str]:
    """``(score, status, message)``: score the pass fraction (soft) or all-passed (hard); status
    ``timeout`` when a program overran, ``error`` when one was stopped by a limit or a blocked
    action (memory, processes, network, writing outside its folder) or killed, else ``ok``."""
    passed = sum(r.verdict == "passed" for r in results)
    fraction = passed / len(results) if results else 0.0
    score = fraction if reward_type == "soft" else float(passed == len(results) and bool(results))
    verdicts = [r.verdict for r in results]
    status = "timeout" if "timeout" in verdicts else "error" if {"blocked", "killed"} & set(verdicts) else "ok"
    counts = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
    worst = next((r.detail for r in results if r.verdict != "passed" and r.detail), "")
    return score, status, f"{passed}/{len(results)} tests passed {counts}" + (f"; {worst[-200:]}" if worst else "")
