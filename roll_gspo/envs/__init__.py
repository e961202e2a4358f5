"""Environments and tools for the agentic pipeline (``pipeline: agentic``).

An environment speaks GEM's text protocol (`base.Env`: ``reset(seed) -> (observation, info)``,
``step(action_text) -> (observation, reward, terminated, truncated, info)``); `registry` builds
one from ``custom_envs.<tag>.env_type`` / ``env_config`` and checks a declaration for
``--dry-run``; `tools` wraps an env with tools the agent may call (a Python tool running in the
project's code sandbox, type-hinted Python functions). The built-in envs (FrozenLake, Sokoban,
GuessTheNumber, math) are offline, procedural and deterministic per reset seed, with compact
ASCII observations the built-in character-level model can read.

This package imports only `roll_gspo.utils`, `roll_gspo.sandbox` (the python tool's code sandbox)
and `roll_gspo.rewards` (math answer checking); the trajectory loop and the pipeline live above it.
"""
from roll_gspo.envs.base import Env, is_env_like
from roll_gspo.envs.registry import ENV_TYPES, env_problems, make_env
from roll_gspo.envs.tools import (FunctionTool, PythonCodeTool, Tool, ToolCall, ToolEnvWrapper, build_tools,
                                  calculator, tool_problems, wrap_with_tools, wrapper_problems)

__all__ = ["ENV_TYPES", "Env", "FunctionTool", "PythonCodeTool", "Tool", "ToolCall", "ToolEnvWrapper", "build_tools",
           "calculator", "env_problems", "is_env_like", "make_env", "tool_problems", "wrap_with_tools",
           "wrapper_problems"]
