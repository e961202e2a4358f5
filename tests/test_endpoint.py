"""The OpenAI-compatible rollout endpoint (roll_gspo.serving): the real
`openai` client against a real server on 127.0.0.1 in front of vLLM (tiny model, engine loop).
Token capture: the ids an episode's trajectory holds are those the engine was sent and sampled,
history sent back as text reuses them, an edited history opens a counted segment; bad input gets
a 4xx, a client gone mid-request a counted failure, and the server goes on."""
import asyncio
import gc
import json
import time

import httpx
import openai
import pytest

from roll_gspo.agentic.trajectory import trajectory_tensors
from roll_gspo.strategies.engine import Sampling

from tests.test_rollout_engine import role_for

SEQ = 256
CAP = 24


@pytest.fixture(scope="module")
def served(tiny_model):
    from transformers import AutoTokenizer

    from roll_gspo.serving.backends import LoopBackend
    from roll_gspo.serving.server import RolloutServer
    from roll_gspo.strategies.engine_loop import EngineLoop
    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    gc.collect()  # an earlier module's in-process engine destroyed now, not under this one (test_engine_loop)
    engine = VllmStrategy(role_for(tiny_model), max_model_len=SEQ, seed=0)
    loop = EngineLoop(engine)
    server = RolloutServer([LoopBackend(loop)], AutoTokenizer.from_pretrained(tiny_model), model_name="tiny",
                           sampling=Sampling(max_new_tokens=CAP, temperature=1.0), sequence_length=SEQ,
                           template="chatml", model_aliases=(str(tiny_model),))
    address = server.start()
    yield server, loop, address
    server.stop()
    loop.close()
    del server, loop, engine
    gc.collect()  # the loop's thread and the server hold the engine in a cycle: destroyed here, not later


def client(address, **kw):
    return openai.OpenAI(base_url=address, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def test_models_and_a_multi_turn_episode_reuse_the_recorded_ids(served):
    """Three turns, the history sent back as text each time: one segment whose ids are exactly
    the prompts the engine was sent and the ids it sampled; masks as the agentic path's."""
    server, loop, address = served
    c = client(address)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    messages = [{"role": "system", "content": "play"}, {"role": "user", "content": "go"}]
    sent, sampled = [], []
    episode = "ep-three-turns"
    for turn in range(3):
        resp = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=turn,
                                         extra_headers={"X-Episode-Id": episode})
        assert resp.episode_id == episode and resp.usage.completion_tokens <= 12
        sent.append(resp.prompt_token_ids)
        sampled.append(resp.choices[0].token_ids)
        messages += [{"role": "assistant", "content": resp.choices[0].message.content},
                     {"role": "user", "content": f"turn {turn}"}]
    record = server.take_episode(episode)
    assert (record.requests, record.reused_turns, record.mismatches, len(record.segments)) == (3, 2, 0, 1)
    (t,) = record.trajectories(reward=1.0)
    # Each request's prompt is the previous context plus the appended messages, never re-tokenised.
    assert sent[0] == t.prompt_ids
    assert sent[1][:len(sent[0]) + len(sampled[0])] == sent[0] + sampled[0]
    assert sent[2][:len(sent[1]) + len(sampled[1])] == sent[1] + sampled[1]
    assert t.context_ids() == sent[2] + sampled[2]
    assert [i for i, m in zip(t.response_ids, t.agent_mask) if m] == sampled[0] + sampled[1] + sampled[2]
    assert t.step_rewards == [0.0, 0.0, 1.0] and t.reward == 1.0
    tensors = trajectory_tensors([t], pad_token_id=0)
    assert int(tensors["loss_mask"].sum()) == sum(map(len, sampled))
    assert all(lp < 0 or lp == 0.0 for lp in t.log_probs)
    assert len(t.token_weight_versions) == sum(map(len, sampled))
    # The trainer scores these ids as the engine did: fp32 gap of the recorded log-probs <= 1e-4.
    import torch

    from roll_gspo.models.causal_lm import load_causal_lm, response_token_log_probs

    model = load_causal_lm(server.stitcher.tokenizer.name_or_path).eval()
    with torch.no_grad():
        trainer, _ = response_token_log_probs(model, tensors["input_ids"], tensors["attention_mask"],
                                              tensors["prompt_lengths"], tensors["response_mask"].shape[1])
    mask = tensors["loss_mask"].bool()
    gap = (trainer[mask] - tensors["rollout_log_probs"][mask]).abs().max().item()
    print(f"endpoint vs trainer fp32 log-prob gap: {gap:.2e}")
    assert gap <= 1e-4, gap


def test_verifiers_session_header_keys_the_episode(served):
    """verifiers sends its trace id as X-Session-ID on every turn: without X-Episode-Id that is the
    episode (two turns, one record, the second reusing the first's ids); X-Episode-Id wins."""
    server, loop, address = served
    c = client(address)
    messages = [{"role": "user", "content": "go"}]
    for turn in range(2):
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                      extra_headers={"X-Session-ID": "trace-1"})
        assert r.episode_id == "trace-1"
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "on"}]
    record = server.take_episode("trace-1")
    assert (record.requests, record.reused_turns, record.mismatches) == (2, 1, 0)
    r = c.chat.completions.create(model="tiny", messages=messages[:1], max_tokens=2,
                                  extra_headers={"X-Session-ID": "trace-2", "X-Episode-Id": "mine"})
    assert r.episode_id == "mine" and server.take_episode("trace-2") is None and server.take_episode("mine")


def test_edited_history_opens_a_counted_segment(served):
    server, _, address = served
    c = client(address)
    first = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], user="ep-edit",
                                      max_tokens=6)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": (first.choices[0].message.content or "") + " (edited)"},
               {"role": "user", "content": "and?"}]
    second = c.chat.completions.create(model="tiny", messages=history, user="ep-edit", max_tokens=6)
    record = server.take_episode("ep-edit")
    assert (record.mismatches, record.reused_turns, len(record.segments)) == (1, 0, 2)
    assert record.segments[1].trajectory.prompt_ids == second.prompt_token_ids  # rendered afresh, not spliced
    assert len(record.trajectories(reward=0.5)) == 2


def test_completions_continue_on_text_and_stream(served):
    server, _, address = served
    c = client(address)
    a = c.completions.create(model="tiny", prompt="1+2=", max_tokens=5, user="ep-cmpl", logprobs=1)
    assert len(a.choices[0].logprobs.token_logprobs) == len(a.choices[0].token_ids)
    b = c.completions.create(model="tiny", prompt="1+2=" + a.choices[0].text + "\n3+4=", max_tokens=5,
                             user="ep-cmpl")
    record = server.take_episode("ep-cmpl")
    assert (record.reused_turns, record.mismatches) == (1, 0)
    (t,) = record.trajectories(reward=0.0)
    assert [i for i, m in zip(t.response_ids, t.agent_mask) if m] == a.choices[0].token_ids + b.choices[0].token_ids
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "s"}], max_tokens=4,
                                            stream=True, user="ep-stream"))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert server.take_episode("ep-stream").requests == 1


def test_tools_render_and_parse_with_vllms_hermes_parser(served):
    """Tools go into the prompt; the assistant's tool call and the tool's answer sent back are
    the history; vLLM's hermes parser reads a call in the model's text."""
    server, _, address = served
    c = client(address)
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    messages = [{"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    prompt = server.render(messages, tools)
    assert "<tools>" in prompt and '"name": "add"' in prompt and "<|im_start|>tool\n2<|im_end|>" in prompt
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in prompt
    # The tiny model's 256 positions do not hold the tool instructions: refused as too long, not cut.
    with pytest.raises(openai.BadRequestError, match="sequence_length"):
        c.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=4, user="ep-tools")
    server.take_episode("ep-tools")

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    request = ChatCompletionRequest(model="tiny", messages=messages, tools=tools)
    parser = ToolParserManager.get_tool_parser("hermes")(server.tokenizer, request.tools)
    info = parser.extract_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>', request)
    assert info.tools_called and info.tool_calls[0].function.name == "add"


def test_concurrent_episodes_share_engine_steps(served):
    server, loop, address = served

    async def episode(ac, i):
        r = await ac.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"q{i}"}],
                                             max_tokens=16, user=f"ep-c{i}")
        return len(r.choices[0].token_ids)

    async def main():
        ac = openai.AsyncOpenAI(base_url=address, api_key="x", max_retries=0)
        return await asyncio.gather(*(episode(ac, i) for i in range(8)))

    steps = loop.steps
    tokens = asyncio.run(main())
    assert loop.steps - steps < sum(tokens)  # several episodes per engine step
    for i in range(8):
        assert server.take_episode(f"ep-c{i}").requests == 1


def test_bad_input_gets_4xx_and_the_server_goes_on(served):
    server, loop, address = served
    c = client(address)
    url = address + "/chat/completions"
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(url, json=[1, 2]).status_code == 400
    assert httpx.post(url, json={"model": "tiny", "messages": "nope"}).status_code == 400
    huge = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * server.max_request_bytes}]})
    assert httpx.post(url, content=huge, headers={"content-type": "application/json"}).status_code == 413
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="sequence_length"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * SEQ}])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
    big = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10_000,
                                    user="ep-cap")
    assert big.usage.completion_tokens <= CAP  # bounded by the run's max_new_tokens
    server.take_episode("ep-cap")
    # A client that gives up mid-request (the engine held at a step boundary meanwhile, so the
    # turn cannot finish first): aborted on the engine, counted as its episode's failure.
    before = server.counters["client_disconnects"]
    with loop.paused():
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": "slow"}],
                                  "user": "ep-gone", "max_tokens": CAP}, timeout=0.3)
        deadline = time.monotonic() + 10
        while server.counters["client_disconnects"] == before and time.monotonic() < deadline:
            time.sleep(0.02)
    record = server.take_episode("ep-gone")
    assert server.counters["client_disconnects"] == before + 1
    assert record.failures == 1 and record.requests == 0 and record.errors == ["client disconnected"]
    assert c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ok"}], max_tokens=3)
    assert loop.in_flight() == 0


def test_another_address_needs_a_token_and_the_token_is_checked(tiny_model, served):
    from transformers import AutoTokenizer

    from roll_gspo.serving.backends import LoopBackend
    from roll_gspo.serving.server import RolloutServer

    _, loop, _ = served
    tok = AutoTokenizer.from_pretrained(tiny_model)
    kwargs = dict(model_name="tiny", sampling=Sampling(max_new_tokens=4), sequence_length=SEQ, template="chatml")
    with pytest.raises(ValueError, match="token"):
        RolloutServer([LoopBackend(loop)], tok, host="0.0.0.0", **kwargs)
    guarded = RolloutServer([LoopBackend(loop)], tok, token="s3cret", **kwargs)
    address = guarded.start()
    try:
        with pytest.raises(openai.AuthenticationError):
            client(address, api_key="wrong").models.list()
        assert client(address, api_key="s3cret").models.list().data[0].id == "tiny"
    finally:
        guarded.stop()


def test_an_agent_written_against_the_openai_client_plays_groups_of_episodes(served):
    """`async def agent(client, task) -> float` (the openai client only): 2 tasks x group 2 at once;
    each episode's trajectory holds exactly the ids its responses carried; an agent that raises
    and one that hangs are counted failures with the failure reward; the endpoint goes on."""
    from roll_gspo.serving.agents import agent_metrics, run_agent

    server, loop, address = served
    seen = {}

    async def agent(client, task):
        messages = [{"role": "user", "content": task}]
        ids = []
        for _ in range(2):
            r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
            ids += r.choices[0].token_ids
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "again"}]
        seen[r.episode_id] = ids
        if task == "boom":
            raise RuntimeError("agent bug")
        if task == "hang":
            await asyncio.sleep(30)
        return float(len(ids))

    episodes = asyncio.run(run_agent(agent, ["2+2", "3*3"], server, group_size=2, timeout_s=20))
    assert [e.task_index for e in episodes] == [0, 0, 1, 1]
    for e in episodes:
        (t,) = e.trajectories
        assert [i for i, m in zip(t.response_ids, t.agent_mask) if m] == seen[e.episode_id]
        assert t.reward == e.reward == float(len(seen[e.episode_id])) and t.spec.group_id == f"task{e.task_index}"
    failed = asyncio.run(run_agent(agent, ["boom", "hang"], server, timeout_s=2.0, failure_reward=-1.0))
    assert [(e.reward, e.timed_out, e.error is not None) for e in failed] == [(-1.0, False, True), (-1.0, True, True)]
    metrics = agent_metrics(episodes + failed)
    assert (metrics["agent/errors"], metrics["agent/timeouts"], metrics["agent/samples"]) == (1.0, 1.0, 6.0)
    assert loop.in_flight() == 0 and not {e.episode_id for e in episodes + failed} & set(server.store.episodes)
