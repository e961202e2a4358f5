"""An agent written only against the `openai` client, trained as the environment of an agentic run
(examples/example_agent.yaml; docs/endpoint.md, "Agents as environments").

The run calls `agent(client, task)` for each episode: `client` is an `openai.AsyncOpenAI` whose
base_url is the run's rollout endpoint, bound to this episode; `task` is one row of the task file.
The return value is the episode's reward. Nothing here knows about the trainer: the same function
runs against any OpenAI-compatible server (`python examples/agents/arith_agent.py URL`).

The game: answer a sum; a wrong answer gets one more try with a hint, worth half.
"""
import re

MODEL = "policy"  # rollout_endpoint.model_name


def _number(text):
    found = re.search(r"-?\d+", text or "")
    return found.group(0) if found else None


async def agent(client, task) -> float:
    messages = [{"role": "user", "content": task["question"]}]
    for attempt in range(2):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        answer = reply.choices[0].message.content or ""
        if _number(answer) == str(task["answer"]):
            return 1.0 if attempt == 0 else 0.5
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "No. Again:"}]
    return 0.0


if __name__ == "__main__":  # against any endpoint: python examples/agents/arith_agent.py http://127.0.0.1:PORT/v1
    import asyncio
    import sys

    import openai

    async def main(url):
        client = openai.AsyncOpenAI(base_url=url, api_key="unused")
        print(await agent(client, {"question": "12+34=", "answer": 46}))

    asyncio.run(main(sys.argv[1]))
