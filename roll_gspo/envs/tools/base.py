"""What a tool is (GEM's BaseTool and its call tuple), and what every tool shares."""
from __future__ import annotations

import re
from typing import NamedTuple

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
