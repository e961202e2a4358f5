"""`function`: a type-hinted Python function as a tool. Its JSON schema comes from the type hints,
its description from the docstring; calls are hermes-style ``<tool_call>{"name", "arguments"}</tool_call>``
and run in a forked child killed at the timeout (or a thread, `isolation: thread`)."""
from __future__ import annotations

import collections.abc
import inspect
import json
import os
import re
import select
import signal
import threading
import time
import typing
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from roll_gspo.envs.tools.base import (DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_TIMEOUT_S, NOT_A_CALL, TOOL_CALL, Tool,
                                       ToolCall, truncate_text)

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
