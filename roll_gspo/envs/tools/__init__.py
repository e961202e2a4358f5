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
  a fenced python block runs in the project's code sandbox (`roll_gspo.sandbox`:
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

One module per concern: `base` (the `Tool` class and its `ToolCall`), `calculator`, `python_code`,
`function` (JSON schema from type hints, hermes calls, fork isolation), `wrapper` and `registry`
(the YAML's tool ids, building and checking them). A YAML names tools by `roll_gspo.envs.tools:<name>`,
so every public name stays importable from here.
"""
from roll_gspo.envs.tools.base import (DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_TIMEOUT_S, NOT_A_CALL, TOOL_CALL, Tool,
                                       ToolCall, truncate_text)
from roll_gspo.envs.tools.calculator import calculator, evaluate_arithmetic, format_number
from roll_gspo.envs.tools.function import FunctionTool, function_schema, unclaimed_call_error
from roll_gspo.envs.tools.python_code import DEFAULT_CODE_PATTERNS, SANDBOX_TYPES, PythonCodeTool
from roll_gspo.envs.tools.registry import (TOOL_IDS, WRAPPER_KEYS, build_tools, tool_problems, wrap_with_tools,
                                           wrapper_problems)
from roll_gspo.envs.tools.wrapper import INSTRUCTION_TARGETS, ToolEnvWrapper

__all__ = ["DEFAULT_CODE_PATTERNS", "DEFAULT_MAX_OUTPUT_CHARS", "DEFAULT_TIMEOUT_S", "FunctionTool",
           "INSTRUCTION_TARGETS", "NOT_A_CALL", "PythonCodeTool", "SANDBOX_TYPES", "TOOL_CALL", "TOOL_IDS", "Tool",
           "ToolCall", "ToolEnvWrapper", "WRAPPER_KEYS", "build_tools", "calculator", "evaluate_arithmetic",
           "format_number", "function_schema", "tool_problems", "truncate_text", "unclaimed_call_error",
           "wrap_with_tools", "wrapper_problems"]
