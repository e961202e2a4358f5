"""A small multi-turn verifiers environment made only from verifiers' own classes (for
tests/test_verifiers_env.py): a `Taskset` of tasks, a `Task` whose `@vf.reward` is the rubric, an
`Env` whose `run` plays two turns of one interaction (the task's prompt, then the env's follow-up),
and a `Harness` that runs its chat loop in-process (verifiers' documented alternative to launching a
program: every model call goes through the interception `endpoint` with the rollout's `secret`).
verifiers' own `null` harness would do the same in a uv-provisioned subprocess, which needs the
network.

The ids of the model calls each trace made are kept in `SEEN` (trace id -> [(ids, log-probs)]),
for the test to compare with the trained batch. Loaded by id: `vf_two_turns` (this folder on
sys.path)."""
from __future__ import annotations

from collections import defaultdict

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

SEEN = defaultdict(list)
REWARDS = {}  # trace id -> the rubric's reward
FOLLOW_UP = "Now one more number, please."


class TwoTurnsTask(vf.Task):
    @vf.reward
    async def digits(self, trace) -> float:
        """The rubric: the fraction of digits in what the model wrote over both turns."""
        text = "".join(m.content or "" for m in trace.messages if m.role == "assistant")
        REWARDS[trace.id] = sum(c.isdigit() for c in text) / max(len(text), 1)
        return REWARDS[trace.id]


class TwoTurnsTaskset(vf.Taskset[TwoTurnsTask]):
    def load(self):
        for n in range(6):
            yield TwoTurnsTask(vf.TaskData(prompt=f"{n}+{n + 1}=", system_prompt="Answer with digits."))


class InProcessChat(vf.Harness):
    """One model call per segment, in this process, through the interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
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
            r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=5, logprobs=True)
        choice = r.choices[0]
        SEEN[trace.id].append((list(choice.token_ids), [c.logprob for c in choice.logprobs.content]))
        return ProgramResult(0, "", "")


class TwoTurnsEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TwoTurnsEnv(vf.Env[TwoTurnsEnvConfig]):
    """The task's prompt opens; the env answers the model's reply with a follow-up; two turns."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated:
                await chat.turn(FOLLOW_UP)


__all__ = ["TwoTurnsTaskset", "InProcessChat", "TwoTurnsEnv"]
