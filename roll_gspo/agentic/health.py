"""Warnings, with numbers, for the silent failures agentic users report: tools that are never
called (verl#3257), steps whose trajectories all got one reward (no learning signal), and actions
that mostly do not parse (an action pattern the model never matches; ROLL#302/#303)."""
from __future__ import annotations

import logging
from typing import Dict, List

from roll_gspo.agentic.trajectory import Trajectory

logger = logging.getLogger("roll_gspo.agentic")
NO_TOOL_CALL_STEPS = 3  # steps without a single tool call before warning
INVALID_ACTION_WARN_FRAC = 0.5


class HealthMonitor:
    """Looks at each step's trajectories; returns (and logs) the warnings of that step."""

    def __init__(self, tags_with_tools: List[str]):
        self.tags_with_tools = set(tags_with_tools)
        self.steps_without_tool_call = 0
        self.uniform_steps = 0

    def check(self, step: int, trajectories: List[Trajectory]) -> List[str]:
        warnings = []
        rewards = {round(t.reward, 9) for t in trajectories}
        if len(trajectories) > 1 and len(rewards) == 1:
            self.uniform_steps += 1
            if self.uniform_steps in (1, 5) or self.uniform_steps % 20 == 0:
                warnings.append(f"step {step}: every one of the {len(trajectories)} trajectories got reward "
                                f"{next(iter(rewards)):g} ({self.uniform_steps} such steps so far): advantages are 0, "
                                f"this step teaches nothing; check the env's rewards, the action format, or "
                                f"raise the sampling temperature")
        else:
            self.uniform_steps = 0
        turns = sum(t.turns for t in trajectories)
        invalid = sum(t.invalid_actions for t in trajectories)
        if turns and invalid / turns > INVALID_ACTION_WARN_FRAC:
            warnings.append(f"step {step}: {invalid} of {turns} actions ({invalid / turns:.0%}) were invalid (the "
                            f"env's action_pattern did not match or named no action); check agent_template and "
                            f"action_pattern against what the model writes (val transcripts: render_save_dir)")
        with_tools = [t for t in trajectories if t.spec.tag in self.tags_with_tools]
        if with_tools:
            if sum(t.tool_calls for t in with_tools):
                self.steps_without_tool_call = 0
            else:
                self.steps_without_tool_call += 1
                if self.steps_without_tool_call == NO_TOOL_CALL_STEPS:
                    warnings.append(f"step {step}: no tool call in the last {NO_TOOL_CALL_STEPS} steps "
                                    f"({sum(t.turns for t in with_tools)} turns this step) although tags "
                                    f"{sorted(self.tags_with_tools)} offer tools; check that the tool "
                                    f"instructions reach the model and that its call format parses")
        for message in warnings:
            logger.warning(message)
        return warnings

    def state_dict(self) -> Dict[str, int]:
        """The counters (a checkpoint keeps them: a resumed run warns and logs as an uninterrupted one)."""
        return {"steps_without_tool_call": self.steps_without_tool_call, "uniform_steps": self.uniform_steps}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.steps_without_tool_call = int(state["steps_without_tool_call"])
        self.uniform_steps = int(state["uniform_steps"])

    def metrics(self) -> Dict[str, float]:
        return {"health/steps_without_tool_call": float(self.steps_without_tool_call),
                "health/uniform_reward_steps": float(self.uniform_steps)}
