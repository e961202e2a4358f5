"""The YAML side of the tools: ROLL's ``tool_configs`` / ``tool_wrapper`` built into tools and a
wrapped env, and checked (`tool_problems`, `wrapper_problems`, for ``--dry-run``)."""
from __future__ import annotations

import inspect
from collections.abc import Mapping as MappingABC
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from roll_gspo.envs.tools.base import DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_TIMEOUT_S, Tool
from roll_gspo.envs.tools.calculator import calculator
from roll_gspo.envs.tools.function import FunctionTool
from roll_gspo.envs.tools.python_code import PythonCodeTool
from roll_gspo.envs.tools.wrapper import ToolEnvWrapper
from roll_gspo.utils.imports import import_object

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
