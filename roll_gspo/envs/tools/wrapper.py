"""`ToolEnvWrapper`: an env whose agent may call tools (GEM's ToolEnvWrapper; see the package
docstring for how a turn is offered to the tools)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from roll_gspo.envs.base import Env
from roll_gspo.envs.tools.base import Tool, ToolCall
from roll_gspo.envs.tools.function import unclaimed_call_error

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
