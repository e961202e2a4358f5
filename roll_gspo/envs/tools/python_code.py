"""`python_code`: a turn's code block run in the project's code sandbox (`roll_gspo.sandbox`)."""
from __future__ import annotations

import re
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

from roll_gspo.envs.tools.base import (DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_TIMEOUT_S, NOT_A_CALL, Tool, ToolCall,
                                       truncate_text)

SANDBOX_TYPES = ("auto", "bwrap", "rlimits", "none")
DEFAULT_CODE_PATTERNS = (r"<python>(.*?)</python>", r"<code>(.*?)</code>", r"```[ \t]*python[^\n]*\n(.*?)```")
_SANDBOXES: Dict[tuple, Any] = {}
_SANDBOXES_LOCK = threading.Lock()


def _sandbox(kind: str, timeout_s: float, memory_mb: int, site_packages: bool):
    """One sandbox per setting and process (building one runs a probe program)."""
    from roll_gspo.sandbox.code_sandbox import Sandbox

    key = (kind, timeout_s, memory_mb, site_packages)
    with _SANDBOXES_LOCK:
        if key not in _SANDBOXES:
            _SANDBOXES[key] = Sandbox(kind, timeout_s=timeout_s, memory_mb=memory_mb, site_packages=site_packages)
        return _SANDBOXES[key]


class PythonCodeTool(Tool):
    """Runs the first code block of a turn in the project's sandbox and returns what it printed.

    ``sandbox_type``: ``auto`` (bubblewrap when it works here, else rlimits + namespaces),
    ``bwrap``, ``rlimits``; ROLL's ``none`` means ``auto`` (code never runs unsandboxed here).
    ``site_packages``: let the code import the environment's third-party packages (numpy,
    sympy); off, only the standard library, and the interpreter starts faster.
    The observation is ``result_prefix`` + stdout (+ the error's last lines on failure), cut to
    ``max_output_chars``. A failure (an exception, a limit, the timeout) sets ``error``. The code
    gets ``timeout`` seconds of CPU and is killed after ``timeout`` + 1 s of wall time (the
    sandbox's grace for starting the interpreter).
    """

    tool_type = "python_code"
    name = "python"

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S, sandbox_type: str = "auto",
                 keep_error_last_line: bool = False, tool_instruction: Optional[str] = None,
                 patterns: Optional[Sequence[str]] = None, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
                 memory_mb: int = 512, site_packages: bool = False, result_prefix: str = "Code execution result: "):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"python_code timeout must be a positive number of seconds, got {timeout!r}")
        if sandbox_type not in SANDBOX_TYPES:
            raise ValueError(f"python_code sandbox_type {sandbox_type!r}: valid are {list(SANDBOX_TYPES)}")
        self.timeout = float(timeout)
        self.sandbox_kind = "auto" if sandbox_type == "none" else sandbox_type
        self.keep_error_last_line = bool(keep_error_last_line)
        self.patterns = []
        for pattern in (patterns or DEFAULT_CODE_PATTERNS):
            try:
                compiled = re.compile(pattern, re.DOTALL)
            except (re.error, TypeError) as exc:
                raise ValueError(f"python_code patterns: {pattern!r} is not a valid regular expression: {exc}") from None
            if compiled.groups < 1:
                raise ValueError(f"python_code patterns: {pattern!r} has no group for the code")
            self.patterns.append(compiled)
        self.max_output_chars = int(max_output_chars)
        self.memory_mb = int(memory_mb)
        self.site_packages = bool(site_packages)
        self.result_prefix = result_prefix
        self.tool_instruction = tool_instruction

    def instruction_string(self) -> str:
        if self.tool_instruction is not None:
            return self.tool_instruction
        return ("You may run Python code: write it in <python>...</python> (or a ```python block) and print "
                "what you need; its output comes back. Give the final answer in \\boxed{}.")

    def parse(self, action: str) -> Optional[Tuple[str, str]]:
        """(code, text up to the end of the block) of the block that ends first, or None."""
        best = None
        for pattern in self.patterns:
            match = pattern.search(action)
            if match and (best is None or match.end() < best.end()):
                best = match
        if best is None:
            return None
        return (best.group(1) or "").strip("\n"), action[:best.end()]

    def execute_action(self, action: str) -> ToolCall:
        found = self.parse("" if action is None else str(action))
        if found is None:
            return NOT_A_CALL
        code, parsed_action = found
        result = _sandbox(self.sandbox_kind, self.timeout, self.memory_mb, self.site_packages).run(code, kind="input")
        output = result.stdout
        error = result.verdict != "passed"
        if result.verdict == "timeout":
            detail = f"TimeoutError: the code ran longer than {self.timeout:g}s and was killed"
        elif result.verdict == "blocked":
            detail = _last_lines(result.detail) + "\n(blocked by the sandbox: no network, no writes outside /tmp, " \
                                                  "limited memory and processes)"
        else:
            detail = _last_lines(result.detail)
        if error and self.keep_error_last_line:
            detail = detail.strip().splitlines()[-1] if detail.strip() else ""
        text = output + (("\n" if output and not output.endswith("\n") else "") + detail if error else "")
        text = text.strip("\n") if text.strip() else "(no output: use print)"
        return ToolCall(True, error, truncate_text(self.result_prefix + text, self.max_output_chars), parsed_action)


def _last_lines(traceback_text: str, lines: int = 3) -> str:
    """The end of a traceback (the harness frames before it mean nothing to the model)."""
    kept = [line for line in (traceback_text or "").strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])
