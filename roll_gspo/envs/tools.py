"""Tools an agent may call during an episode, and the wrapper that offers them (GEM's ToolEnvWrapper).

A tool reads the model's turn text and, when it finds a call of itself there, runs it::

    tool.instruction_string() -> str            # how to call it; shown once at reset
    tool.execute_action(text) -> ToolCall       # (parsed, error, observation, parsed_action)

GEM's tuple order, so GEM/ROLL tools plug in. `ToolEnvWrapper` offers each turn's text to its
tools in order; the first tool that finds a call of itself handles the turn: the step is not
terminal, its observation is the tool's output, ``info["use_tool"]`` is True (and
``info["tool_error"]`` when the call failed), and the shaping rewards apply. Text that no tool
claims, and every turn after ``max_tool_uses`` calls, goes to the wrapped env. Unlike GEM's
wrapper, a later tool never overwrites an earlier tool's failed call (GEM then steps the env with
the text, losing the error), a tool that raises gives an error observation instead of ending the
episode, and attributes of the env are read through, never copied once (GEM's copies go stale).

Built-in tools (`build_tools` / ROLL's ``tool_configs``):

* ``python_code`` -> `PythonCodeTool`: code in ``<python>...</python>``, ``<code>...</code>`` or
  a fenced python block runs in the project's code sandbox (`roll_gspo.rewards.code_sandbox`:
  no network, read-only system, private size-capped /tmp, CPU, memory and process limits, killed
  at the timeout). ROLL's ``sandbox_type: none`` (no sandbox) is not offered: it means the
  default sandbox here.
* ``function`` -> `FunctionTool`: a type-hinted Python function named by ``function:
  pkg.module:func`` (verl's function tool, TRL's ``tools=``), called with hermes-style
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Its JSON schema comes from the
  type hints, its description from the docstring. Each call runs in a forked child process that is
  killed at ``timeout`` (``isolation: thread`` runs it in a thread instead, for functions that need
  the parent's state; a hung thread cannot be killed and is abandoned).
* ``calculator`` -> `FunctionTool` of `calculator`: exact arithmetic on a parsed expression (no
  ``eval``).
* a class path (``pkg.module:MyTool``): the user's tool, constructed with ``tool_args``.
"""
from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import os
import re
import select
import signal
import threading
import time
import typing
import collections.abc
from collections.abc import Mapping as MappingABC
from fractions import Fraction
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from roll_gspo.envs.base import Env
from roll_gspo.utils.imports import import_object

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_OUTPUT_CHARS = 1000
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolCall(NamedTuple):
    """What a tool made of a turn's text (GEM's tuple order)."""

    parsed: bool          # the text holds a call of this tool: the tool handles this turn
    error: bool           # the call failed: malformed, bad arguments, raised, timed out, non-zero exit
    observation: str      # what the agent sees next (the output, or the error)
    parsed_action: str    # the text up to the end of the call


NOT_A_CALL = ToolCall(False, False, "", "")


class Tool:
    """Base class of the tools (GEM's BaseTool): subclasses set `tool_type` and `name` and
    implement `instruction_string` and `execute_action`."""

    tool_type = "base"
    name = "base"

    def instruction_string(self) -> str:
        raise NotImplementedError

    def execute_action(self, action: str) -> ToolCall:
        raise NotImplementedError


def truncate_text(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    if limit <= 0 or len(text) <= limit:
        return text
    note = f"...[{len(text) - limit} more characters]"
    return text[:max(0, limit - len(note))] + note


# -- arithmetic (the calculator, and the math env's generated answers) --------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_MAGNITUDE = 10 ** 100
_MAX_EXPONENT = 1000
_MAX_EXPRESSION_CHARS = 500


def evaluate_arithmetic(expression: str) -> Union[Fraction, float]:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``, parentheses.
    Integers and decimals are exact (Fraction); ValueError for anything else (names, calls,
    attributes), a division by zero, or numbers beyond 1e100 / exponents beyond 1000 (so no
    expression can exhaust memory or time)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expected an arithmetic expression")
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> Union[Fraction, float]:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            if not abs(node.value) <= _MAX_MAGNITUDE:  # also refuses inf and nan
                raise ValueError("number too large")
            return Fraction(node.value) if isinstance(node.value, int) else Fraction(repr(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            if isinstance(node.op, ast.Pow):
                if not (isinstance(right, Fraction) and right.denominator == 1) or abs(right) > _MAX_EXPONENT:
                    raise ValueError(f"exponent must be an integer of at most {_MAX_EXPONENT}")
                if left == 0 and right < 0:
                    raise ValueError("division by zero")
                if abs(left) > 1 and abs(right) * math.log10(abs(float(left))) > 100:
                    raise ValueError("result too large")
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, Fraction) and (abs(result.numerator) > _MAX_MAGNITUDE or
                                                 result.denominator > _MAX_MAGNITUDE):
                raise ValueError("result too large")
            return result
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, found {type(node).__name__}")

    return value(tree)


def format_number(number: Union[Fraction, float]) -> str:
    """An integer as is, another rational as a decimal to 12 significant digits."""
    if isinstance(number, Fraction) and number.denominator == 1:
        return str(number.numerator)
    text = format(float(number), ".12g")
    return text


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "12*(7+5)/3".

    Args:
        expression: numbers with + - * / // % ** and parentheses.
    """
    return format_number(evaluate_arithmetic(expression))


# -- python code in the sandbox -----------------------------------------------------------------
SANDBOX_TYPES = ("auto", "bwrap", "rlimits", "none")
DEFAULT_CODE_PATTERNS = (r"<python>(.*?)</python>", r"<code>(.*?)</code>", r"```[ \t]*python[^\n]*\n(.*?)```")
_SANDBOXES: Dict[tuple, Any] = {}
_SANDBOXES_LOCK = threading.Lock()


def _sandbox(kind: str, timeout_s: float, memory_mb: int, site_packages: bool):
    """One sandbox per setting and process (building one runs a probe program)."""
    from roll_gspo.rewards.code_sandbox import Sandbox

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


# -- python functions ---------------------------------------------------------------------------
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               tuple: "array", type(None): "null"}
_ISOLATIONS = ("process", "thread")


def _json_schema(hint: Any, where: str) -> Dict[str, Any]:
    """The JSON schema of a type hint; ValueError naming `where` for one it cannot express."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if hint is Any:
        return {}
    if origin is Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _json_schema(options[0], where)
        return {"anyOf": [_json_schema(a, where) for a in options]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Set):
        schema: Dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            schema["items"] = _json_schema(args[0], where)
        return schema
    if origin in (dict, collections.abc.Mapping):
        return {"type": "object"}
    raise ValueError(f"{where}: type hint {hint!r} has no JSON schema (use str, int, float, bool, list, dict, "
                     f"Optional, Literal)")


def _docstring_parts(doc: str) -> Tuple[str, Dict[str, str]]:
    """(description, {argument: description}) from a docstring with an ``Args:`` section."""
    doc = inspect.cleandoc(doc or "")
    description, _, rest = doc.partition("\nArgs:")
    arguments: Dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        match = re.match(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
        if match:
            current = match.group(1)
            arguments[current] = match.group(2).strip()
        elif current and line.strip() and not re.match(r"^\S", line):
            arguments[current] += " " + line.strip()
        elif re.match(r"^\S", line):
            current = None  # another section (Returns:, Raises:)
    return " ".join(description.split()), arguments


def function_schema(fn: Callable[..., Any], name: Optional[str] = None,
                    description: Optional[str] = None) -> Dict[str, Any]:
    """The OpenAI / hermes tool schema of a type-hinted function: ``{"type": "function",
    "function": {"name", "description", "parameters"}}``; ValueError naming the function and the
    parameter when a parameter has no type hint (or one without a JSON schema), or is *args/**kwargs."""
    label = getattr(fn, "__qualname__", repr(fn))
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as exc:
        raise ValueError(f"function {label}: cannot read its signature or type hints: {exc}") from None
    doc_description, doc_arguments = _docstring_parts(fn.__doc__ or "")
    properties, required = {}, []
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ValueError(f"function {label}: *{parameter.name} cannot be described to the model; "
                             f"name every parameter")
        if parameter.name not in hints:
            raise ValueError(f"function {label}: parameter {parameter.name!r} has no type hint (the tool's JSON "
                             f"schema comes from the hints)")
        schema = _json_schema(hints[parameter.name], f"function {label}, parameter {parameter.name!r}")
        if parameter.name in doc_arguments:
            schema["description"] = doc_arguments[parameter.name]
        properties[parameter.name] = schema
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    return {"type": "function",
            "function": {"name": name or fn.__name__, "description": description or doc_description,
                         "parameters": {"type": "object", "properties": properties, "required": required}}}


def _type_ok(value: Any, schema: Dict[str, Any]) -> bool:
    kind = schema.get("type")
    if "anyOf" in schema:
        return any(_type_ok(value, option) for option in schema["anyOf"])
    if "enum" in schema:
        return value in schema["enum"]
    checks = {"string": lambda v: isinstance(v, str),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "array": lambda v: isinstance(v, list),
              "object": lambda v: isinstance(v, dict), "null": lambda v: v is None}
    return kind is None or checks[kind](value)


def _type_label(schema: Dict[str, Any]) -> str:
    if "anyOf" in schema:
        return " or ".join(_type_label(option) for option in schema["anyOf"])
    if "enum" in schema:
        return "one of " + json.dumps(schema["enum"])
    kind = str(schema.get("type", "value"))
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _result_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


# Held from creating a call's pipe until the parent has closed its write end: a child forked for
# a concurrent call must not inherit that end, or this call's reader would wait for the other
# child's exit before seeing its own end of file.
_FORK_LOCK = threading.Lock()


def _call_in_child(fn: Callable[..., Any], arguments: Dict[str, Any], timeout: float) -> Tuple[bool, str]:
    """fn(**arguments) in a forked child, killed at `timeout`: (ok, text)."""
    with _FORK_LOCK:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: call, send one JSON message, leave without running the parent's exit code
            try:
                os.close(read_fd)
                try:
                    message = {"ok": _result_text(fn(**arguments))}
                except BaseException as exc:  # noqa: BLE001 - everything becomes the tool's error message
                    message = {"error": f"{type(exc).__name__}: {exc}"}
                data = json.dumps(message).encode("utf-8", "replace")
                view = memoryview(data)
                while view:
                    view = view[os.write(write_fd, view):]
            finally:
                os._exit(0)
        os.close(write_fd)
    chunks, deadline, finished = [], time.monotonic() + timeout, False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if ready:
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    finished = True
                    break
                chunks.append(chunk)
    finally:
        os.close(read_fd)
        if not finished:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(pid, 0)
    if not finished:
        return False, f"TimeoutError: the call ran longer than {timeout:g}s and was killed"
    try:
        message = json.loads(b"".join(chunks).decode("utf-8", "replace"))
    except ValueError:
        return False, "Error: the call ended without a result (the process died)"
    return ("ok" in message), message.get("ok", message.get("error", ""))


def _call_in_thread(fn: Callable[..., Any], arguments: Dict[str, Any], timeout: float) -> Tuple[bool, str]:
    """fn(**arguments) in a daemon thread; given up (not killed: threads cannot be) at `timeout`."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["ok"] = _result_text(fn(**arguments))
        except BaseException as exc:  # noqa: BLE001
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, f"TimeoutError: the call ran longer than {timeout:g}s (abandoned)"
    return ("ok" in box), box.get("ok", box.get("error", ""))


class FunctionTool(Tool):
    """A type-hinted Python function as a tool, called hermes-style::

        <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>

    A call with bad JSON, or the wrong or missing arguments, gives an error observation saying
    what is wrong; a call that raises gives ``"<Error>: <message>"``; one that runs past
    ``timeout`` is killed (``isolation: process``: a forked child per call, the default where
    ``os.fork`` exists) or abandoned (``isolation: thread``); each of these sets ``error``.
    A well-formed call of another tool's name is not this tool's (the wrapper reports a name no
    tool has). The result is shown as text (JSON for non-strings), cut to ``max_output_chars``.
    """

    tool_type = "function"

    def __init__(self, fn: Callable[..., Any], timeout: float = DEFAULT_TIMEOUT_S, name: Optional[str] = None,
                 description: Optional[str] = None, isolation: str = "process",
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS, tool_instruction: Optional[str] = None):
        if not callable(fn):
            raise ValueError(f"function tool: {fn!r} is not callable")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"function tool timeout must be a positive number of seconds, got {timeout!r}")
        if isolation not in _ISOLATIONS:
            raise ValueError(f"function tool isolation {isolation!r}: valid are {list(_ISOLATIONS)}")
        self.fn = fn
        self.schema = function_schema(fn, name, description)
        # Parameters that take null: Optional hints and None defaults.
        hints = typing.get_type_hints(fn)
        self.nullable = {p.name for p in inspect.signature(fn).parameters.values()
                         if p.default is None or type(None) in typing.get_args(hints.get(p.name))}
        self.name = self.schema["function"]["name"]
        self.timeout = float(timeout)
        self.isolation = isolation if hasattr(os, "fork") else "thread"
        self.max_output_chars = int(max_output_chars)
        self.tool_instruction = tool_instruction

    def instruction_string(self) -> str:
        if self.tool_instruction is not None:
            return self.tool_instruction
        return (f"Tool {self.name}: {self.schema['function']['description']} Call it as <tool_call>"
                f'{{"name": "{self.name}", "arguments": {{...}}}}</tool_call> with arguments '
                f"{json.dumps(self.schema['function']['parameters'])}.")

    def _error(self, message: str, parsed_action: str) -> ToolCall:
        return ToolCall(True, True, truncate_text(f"Error: {message}", self.max_output_chars), parsed_action)

    def execute_action(self, action: str) -> ToolCall:
        text = "" if action is None else str(action)
        match = TOOL_CALL.search(text)
        if match is None:
            return NOT_A_CALL
        parsed_action = text[:match.end()]
        try:
            call = json.loads(match.group(1))
        except ValueError as exc:
            return self._error(f"the tool call is not valid JSON ({exc}); write "
                               f'<tool_call>{{"name": "{self.name}", "arguments": {{...}}}}</tool_call>', parsed_action)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return self._error('the tool call must be a JSON object with "name" and "arguments"', parsed_action)
        if call["name"] != self.name:
            return NOT_A_CALL
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                return self._error(f"{self.name}: arguments are not a JSON object", parsed_action)
        if not isinstance(arguments, dict):
            return self._error(f"{self.name}: arguments must be a JSON object", parsed_action)
        problem = self.argument_problem(arguments)
        if problem:
            return self._error(problem, parsed_action)
        run = _call_in_child if self.isolation == "process" else _call_in_thread
        ok, output = run(self.fn, arguments, self.timeout)
        return ToolCall(True, not ok, truncate_text(output, self.max_output_chars), parsed_action)

    def argument_problem(self, arguments: Dict[str, Any]) -> Optional[str]:
        """What is wrong with the call's arguments (unknown, missing, wrong JSON type), or None."""
        parameters = self.schema["function"]["parameters"]
        properties, required = parameters["properties"], parameters["required"]
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"{self.name}: unknown argument(s) {unknown}; it takes {sorted(properties)}"
        missing = [name for name in required if name not in arguments]
        if missing:
            return f"{self.name}: missing argument(s) {missing}"
        for name, value in arguments.items():
            if value is None and name in self.nullable:
                continue
            if not _type_ok(value, properties[name]):
                return f"{self.name}: argument {name!r} must be {_type_label(properties[name])}, got {json.dumps(value)}"
        return None


def unclaimed_call_error(action: str, tools: Sequence[Tool]) -> Optional[ToolCall]:
    """An error call for a well-formed ``<tool_call>`` naming a function no tool has (when there
    are function tools); None otherwise."""
    names = [tool.name for tool in tools if isinstance(tool, FunctionTool)]
    match = TOOL_CALL.search("" if action is None else str(action))
    if not names or match is None:
        return None
    try:
        name = json.loads(match.group(1)).get("name")
    except (ValueError, AttributeError):
        return None
    return ToolCall(True, True, f"Error: no tool named {name!r}; available: {', '.join(names)}",
                    str(action)[:match.end()])


# -- the wrapper --------------------------------------------------------------------------------
INSTRUCTION_TARGETS = ("observation", "env_instruction", "none")


class ToolEnvWrapper(Env):
    """An env whose agent may call `tools` (GEM's ToolEnvWrapper; see the module docstring).

    Rewards of a tool step: ``tool_reward`` for any call, plus ``tool_success_reward`` when it
    succeeded or ``tool_execute_error_reward`` when it failed. After ``max_tool_uses`` calls in an
    episode (None: no limit) the text goes to the env, and the last allowed call's observation
    says so. ``tool_instruction_target``: where the tools' instructions go at reset, appended to
    the first observation (GEM), to ``info["env_instruction"]``, or nowhere (``none``: a template
    or the model already knows them). Step info carries ``use_tool``, ``tool_error``,
    ``tool_name`` and, in ``metrics``, ``tool_use_counter`` / ``tool_success_counter`` (ROLL's).
    """

    def __init__(self, env: Any, tools: Sequence[Tool], tool_reward: float = 0.0, tool_success_reward: float = 0.0,
                 tool_execute_error_reward: float = 0.0, max_tool_uses: Optional[int] = 10,
                 tool_instruction_target: str = "observation"):
        super().__init__()
        if max_tool_uses is not None and (isinstance(max_tool_uses, bool) or not isinstance(max_tool_uses, int)
                                          or max_tool_uses < 0):
            raise ValueError(f"max_tool_uses must be an integer >= 0 or null, got {max_tool_uses!r}")
        if tool_instruction_target not in INSTRUCTION_TARGETS:
            raise ValueError(f"tool_instruction_target {tool_instruction_target!r}: valid are "
                             f"{list(INSTRUCTION_TARGETS)}")
        for key, value in (("tool_reward", tool_reward), ("tool_success_reward", tool_success_reward),
                           ("tool_execute_error_reward", tool_execute_error_reward)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{key} must be a number, got {value!r}")
        self.env = env
        self.tools = list(tools)
        self.tool_reward = float(tool_reward)
        self.tool_success_reward = float(tool_success_reward)
        self.tool_execute_error_reward = float(tool_execute_error_reward)
        self.max_tool_uses = max_tool_uses
        self.tool_instruction_target = tool_instruction_target
        self.tool_use_counter = 0
        self.tool_success_counter = 0

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the wrapper lacks: read the env's current value.
        if name.startswith("_") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    @property
    def unwrapped(self) -> Any:
        return getattr(self.env, "unwrapped", self.env)

    def tool_instructions(self) -> str:
        texts = [text for text in (tool.instruction_string() for tool in self.tools) if text]
        return "\n".join(texts)

    def reset(self, seed: Optional[int] = None) -> Tuple[str, dict]:
        self.tool_use_counter = 0
        self.tool_success_counter = 0
        observation, info = self.env.reset(seed=seed)
        info = dict(info or {})
        instructions = self.tool_instructions()
        if instructions and self.tool_instruction_target == "observation":
            observation = f"{observation}\n{instructions}"
        elif instructions and self.tool_instruction_target == "env_instruction":
            before = info.get("env_instruction") or ""
            info["env_instruction"] = f"{before}\n{instructions}" if before else instructions
        info["use_tool"] = False
        return observation, info

    def _counters(self) -> Dict[str, float]:
        return {"tool_use_counter": float(self.tool_use_counter), "tool_success_counter": float(self.tool_success_counter)}

    def step(self, action: str) -> Tuple[str, float, bool, bool, dict]:
        if self.max_tool_uses is None or self.tool_use_counter < self.max_tool_uses:
            handled = self._offer(action)
            if handled is not None:
                tool, call = handled
                self.tool_use_counter += 1
                reward = self.tool_reward
                if call.error:
                    reward += self.tool_execute_error_reward
                else:
                    self.tool_success_counter += 1
                    reward += self.tool_success_reward
                observation = call.observation
                if self.max_tool_uses is not None and self.tool_use_counter >= self.max_tool_uses:
                    observation += "\nNo tool calls left: give the final answer."
                info = {"use_tool": True, "tool_error": bool(call.error), "tool_name": _tool_name(tool),
                        "tool_type": getattr(tool, "tool_type", "tool"), "parsed_action": call.parsed_action,
                        "metrics": {**self._counters(), "tool_error": float(call.error)}}
                return observation, reward, False, False, info
        observation, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info or {})
        info["use_tool"] = False
        info["metrics"] = {**self._counters(), **dict(info.get("metrics") or {})}
        return observation, reward, terminated, truncated, info

    def _offer(self, action: str) -> Optional[Tuple[Tool, ToolCall]]:
        """The first tool that finds a call of itself in `action`, with what it made of it."""
        for tool in self.tools:
            try:
                call = tool.execute_action(action)
            except Exception as exc:  # a tool's bug must not end the episode
                return tool, ToolCall(True, True, f"Error: tool {_tool_name(tool)} failed: {type(exc).__name__}: "
                                                  f"{exc}", str(action))
            if call[0]:
                return tool, ToolCall(*call)
        unclaimed = unclaimed_call_error(action, self.tools)
        if unclaimed is not None:
            return _UnknownTool(), unclaimed
        return None

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def _tool_name(tool: Any) -> str:
    """A tool's name (GEM's tools have only a `tool_type`)."""
    return str(getattr(tool, "name", None) or getattr(tool, "tool_type", None) or type(tool).__name__)


class _UnknownTool(Tool):
    tool_type = "function"
    name = "unknown"


# -- YAML: tool_configs / tool_wrapper ----------------------------------------------------------
TOOL_IDS = {"python_code": "roll_gspo.envs.tools:PythonCodeTool",
            "function": "roll_gspo.envs.tools:FunctionTool",
            "calculator": "roll_gspo.envs.tools:calculator"}
WRAPPER_KEYS = ("wrapper_args", "tool_configs")


def _tool_factory(tool_id: str) -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """(the constructor to build with tool_args, the callable whose signature checks them)."""
    if tool_id == "python_code":
        return PythonCodeTool, PythonCodeTool.__init__
    if tool_id == "function":
        def build_function(function: Any, **kwargs: Any) -> FunctionTool:
            fn = import_object(function) if isinstance(function, str) else function
            return FunctionTool(fn, **kwargs)
        return build_function, _function_signature
    if tool_id == "calculator":
        return (lambda **kwargs: FunctionTool(calculator, **kwargs)), FunctionTool.__init__
    cls = import_object(tool_id)  # a user's tool class
    if not (callable(getattr(cls, "execute_action", None)) and callable(getattr(cls, "instruction_string", None))):
        raise ValueError(f"tool {tool_id!r} is not a tool class (it needs execute_action and instruction_string)")
    return cls, cls.__init__


def _function_signature(self: Any, function: str, timeout: float = DEFAULT_TIMEOUT_S, name: Optional[str] = None,
                        description: Optional[str] = None, isolation: str = "process",
                        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS, tool_instruction: Optional[str] = None):
    """The tool_args of ``tool_id: function`` (signature only)."""


def _entry(config: Any, index: int) -> Tuple[str, Dict[str, Any]]:
    where = f"tool_configs[{index}]"
    if not isinstance(config, MappingABC):
        raise ValueError(f"{where} must be a mapping {{tool_id, tool_args}}, got {config!r}")
    unknown = sorted(set(config) - {"tool_id", "tool_args"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: tool_id, tool_args")
    tool_id = config.get("tool_id")
    if not isinstance(tool_id, str) or not tool_id:
        raise ValueError(f"{where}.tool_id is missing (valid: {', '.join(TOOL_IDS)} or a class path "
                         f"'pkg.module:MyTool')")
    args = config.get("tool_args") or {}
    if not isinstance(args, MappingABC):
        raise ValueError(f"{where}.tool_args must be a mapping, got {args!r}")
    return tool_id, dict(args)


def _unknown_args(check: Callable[..., Any], args: Dict[str, Any]) -> Tuple[List[str], List[str], List[str]]:
    """(unknown keys, missing required keys, accepted keys) of `args` against `check`'s signature."""
    parameters = [p for p in inspect.signature(check).parameters.values() if p.name != "self"]
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return [], [], []
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in parameters if p.default is p.empty and p.kind != p.VAR_POSITIONAL]
    if check is FunctionTool.__init__:  # `fn` is given by the tool id, not by tool_args
        accepted, required = [a for a in accepted if a != "fn"], [r for r in required if r != "fn"]
    return sorted(set(args) - set(accepted)), [r for r in required if r not in args], accepted


def build_tools(tool_configs: Sequence[Dict[str, Any]]) -> List[Tool]:
    """The tools of ROLL's ``tool_configs`` (``[{tool_id, tool_args}, ...]``); ValueError naming
    the entry and key that is wrong (`tool_problems` lists them all)."""
    tools = []
    for index, config in enumerate(tool_configs or []):
        tool_id, args = _entry(config, index)
        if tool_id not in TOOL_IDS and ":" not in tool_id and "." not in tool_id:
            raise ValueError(f"tool_configs[{index}].tool_id {tool_id!r} is unknown; valid: {', '.join(TOOL_IDS)} "
                             f"or a class path 'pkg.module:MyTool'")
        factory, check = _tool_factory(tool_id)
        unknown, missing, accepted = _unknown_args(check, args)
        if unknown or missing:
            raise ValueError(f"tool_configs[{index}] ({tool_id}): " +
                             (f"unknown tool_args {unknown}; " if unknown else "") +
                             (f"missing tool_args {missing}; " if missing else "") + f"accepted: {accepted}")
        try:
            tools.append(factory(**args))
        except (ValueError, TypeError, ImportError) as exc:
            raise ValueError(f"tool_configs[{index}] ({tool_id}): {exc}") from None
    return tools


def tool_problems(tool_configs: Any) -> List[str]:
    """What is wrong with ``tool_configs``, one message per entry at fault (for ``--dry-run``):
    unknown tool ids, unknown or missing tool_args, a function that does not import or lacks type
    hints, bad values. Builds the tools (cheap: the sandbox starts on the first call)."""
    if tool_configs is None:
        return []
    if isinstance(tool_configs, (str, bytes, MappingABC)) or not hasattr(tool_configs, "__iter__"):
        return [f"tool_configs must be a list of {{tool_id, tool_args}}, got {tool_configs!r}"]
    problems = []
    for index, config in enumerate(tool_configs):
        try:
            build_tools([config])
        except (ValueError, TypeError, ImportError) as exc:
            problems.append(str(exc).replace("tool_configs[0]", f"tool_configs[{index}]"))
    return problems


def wrapper_problems(tool_wrapper: Any) -> List[str]:
    """What is wrong with ROLL's ``tool_wrapper: {wrapper_args, tool_configs}`` (`tool_problems`
    plus the wrapper's own arguments)."""
    if tool_wrapper is None:
        return []
    if not isinstance(tool_wrapper, MappingABC):
        return [f"tool_wrapper must be a mapping {{wrapper_args, tool_configs}}, got {tool_wrapper!r}"]
    problems = []
    unknown = sorted(set(tool_wrapper) - set(WRAPPER_KEYS))
    if unknown:
        problems.append(f"tool_wrapper: unknown key(s) {unknown}; valid: {', '.join(WRAPPER_KEYS)}")
    args = tool_wrapper.get("wrapper_args") or {}
    if not isinstance(args, MappingABC):
        problems.append(f"tool_wrapper.wrapper_args must be a mapping, got {args!r}")
    else:
        args = dict(args)
        bad, _, accepted = _unknown_args(ToolEnvWrapper.__init__, {"env": None, "tools": [], **args})
        if bad:
            problems.append(f"tool_wrapper.wrapper_args: unknown key(s) {bad}; accepted: "
                            f"{[a for a in accepted if a not in ('env', 'tools')]}")
        else:
            try:
                ToolEnvWrapper(None, [], **args)
            except (ValueError, TypeError) as exc:
                problems.append(f"tool_wrapper.wrapper_args: {exc}")
    if not tool_wrapper.get("tool_configs"):
        problems.append("tool_wrapper.tool_configs is empty: declare at least one tool")
    problems += tool_problems(tool_wrapper.get("tool_configs"))
    return problems


def wrap_with_tools(env: Any, tool_wrapper: Optional[Dict[str, Any]]) -> Any:
    """`env` wrapped with ROLL's ``tool_wrapper: {wrapper_args: {...}, tool_configs: [...]}``;
    `env` itself when `tool_wrapper` is empty. ValueError with every problem found."""
    if not tool_wrapper:
        return env
    problems = wrapper_problems(tool_wrapper)
    if problems:
        raise ValueError("; ".join(problems))
    return ToolEnvWrapper(env, build_tools(list(tool_wrapper.get("tool_configs") or [])),
                          **dict(tool_wrapper.get("wrapper_args") or {}))
