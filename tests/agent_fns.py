"""Agents the end-to-end tests name by import path (`tests.agent_fns:...`): written only against the
`openai` client, as a user writes one. `SEEN` keeps, per episode id, what the endpoint returned
(the engine's sampled ids and log-probs), for the tests to compare with the trained batch."""
from collections import defaultdict

SEEN = defaultdict(list)  # episode id -> [(token_ids, log-probs)] per request, in order


async def two_turn_digits(client, task) -> float:
    """Two chat turns; reward: the fraction of digits in what the model wrote."""
    messages = [{"role": "user", "content": task["question"]}]
    text = ""
    for _ in range(2):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5, logprobs=True)
        choice = r.choices[0]
        SEEN[r.episode_id].append((list(choice.token_ids), [c.logprob for c in choice.logprobs.content]))
        text += choice.message.content or ""
        messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "go on"}]
    return sum(c.isdigit() for c in text) / max(len(text), 1)


async def raises_sometimes(client, task) -> float:
    """Fails its episode (after one request) on odd task numbers."""
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["question"]}],
                                             max_tokens=4)
    if task["n"] % 2:
        raise RuntimeError("a broken agent")
    return float(len(r.choices[0].message.content or ""))


def not_async(client, task) -> float:
    return 0.0
