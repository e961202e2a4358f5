"""A verifiers (0.4, `verifiers.v1`) environment trained by roll_gspo through its rollout endpoint
(examples/example_verifiers.yaml; docs/endpoint.md, "verifiers environments"). Nothing here knows
about the trainer: it is a plain verifiers taskset + env + harness, loaded by id (`vf_arith`, this
folder on PYTHONPATH, or the module installed as a package), and runs as well under `vf-eval`.

The game, two turns: answer a sum; a wrong answer gets one more try ("No. Again:"), worth half. The
rubric (`@vf.reward correct`) reads the trace; the trainer takes `Trace.reward` as the reward.

`InProcessChat` is the harness: one model call per segment, made in this process through the
interception `endpoint` with the rollout's `secret` (verifiers' documented alternative to launching
a program). verifiers' own `null` harness runs the same loop as a uv-provisioned subprocess; use it
(`verifiers_env: {agent: {harness: {id: "null"}}}`) where uv and the network are at hand.
"""
from __future__ import annotations

import json
import os
import re

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

TASKS = os.path.join(os.path.dirname(__file__), "..", "data", "agent_arith_tasks.jsonl")
RETRY = "No. Again:"


def _number(text):
    found = re.search(r"-?\d+", text or "")
    return found.group(0) if found else None


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, trace) -> float:
        """1 for the right sum at once, 0.5 on the second try, else 0."""
        replies = [m.content or "" for m in trace.messages if m.role == "assistant"]
        for attempt, reply in enumerate(replies[:2]):
            if _number(reply) == str(self.data.answer):
                return 1.0 if attempt == 0 else 0.5
        return 0.0


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        with open(TASKS, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    yield SumTask(SumData(prompt=row["question"], answer=row["answer"]))


class InProcessChat(vf.Harness):
    """One chat completion per segment, in this process, through the interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a later turn relaunches on the conversation so far
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        import openai

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8)
        return ProgramResult(0, "", "")


class SumEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime={"type": "subprocess"})


class SumEnv(vf.Env[SumEnvConfig]):
    """The task's prompt opens; a wrong answer gets the env's "No. Again:" and one more turn."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated and _number(first.last_reply) != str(task.data.answer):
                await chat.turn(RETRY)


__all__ = ["SumTaskset", "InProcessChat", "SumEnv"]
