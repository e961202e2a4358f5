"""The rollout endpoint's bounds and guards, against the real app with a
fake rollout rank (no engine, no Ray, no socket: httpx's ASGI transport): a request without an
episode id keeps nothing, the store is bounded (evictions counted), a chunked body is refused at
the limit while it streams, a browser's request (an `Origin`, another `Host`, a `text/plain`
body) is refused, and an answer landing after its episode was taken is counted, never written
into the trajectory already handed to training."""
import asyncio
import copy
import logging

import httpx
import pytest

from roll_gspo.strategies.engine import RequestOutput, Sampling

PORT = 8123
SEQ = 256


class FakeRank:
    """A rollout rank that answers every request with `answer` at once, or when `gate` is set."""

    def __init__(self, answer):
        self.answer = answer
        self.in_flight = 0
        self.gate = None

    async def generate(self, request_id, prompt_ids, sampling, seed):
        if self.gate is not None:
            await self.gate.wait()
        return RequestOutput(request_id, list(self.answer), [-0.5] * len(self.answer), [0] * len(self.answer),
                             "stop")

    async def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def make_server(tokenizer, **kw):
    from roll_gspo.serving.server import RolloutServer

    rank = FakeRank(tokenizer.encode("ok"))
    server = RolloutServer([rank], tokenizer, model_name="tiny", sampling=Sampling(max_new_tokens=8),
                           sequence_length=SEQ, template="chatml", port=PORT, **kw)
    return server, rank


def chat(episode=None, text="hi"):
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    headers = {"X-Episode-Id": episode} if episode else {}
    return body, headers


async def post(server, body=None, headers=None, *, content=None, base=f"http://127.0.0.1:{PORT}"):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url=base) as client:
        if content is not None:
            return await client.post("/v1/chat/completions", content=content, headers=headers or {})
        return await client.post("/v1/chat/completions", json=body, headers=headers or {})


def run(coro):
    return asyncio.run(coro)


# -- item 3: memory ---------------------------------------------------------------------------------------
def test_requests_without_an_episode_id_keep_no_record(tokenizer):
    """Nothing can take the record of a request without an episode id (training takes the ids its
    runner sent): no record, lock or routing entry stays behind, and the request is counted."""
    server, _ = make_server(tokenizer)

    async def many():
        return [await post(server, *chat(text=f"q{i}")) for i in range(40)]

    responses = run(many())
    assert all(r.status_code == 200 for r in responses)
    assert server.store.counters()["episodes"] == 0 and not server.store.episodes
    assert server.metrics()["unrecorded_requests"] == 40
    assert all(r.json()["episode_id"] is None and "x-episode-id" not in r.headers for r in responses)


def test_the_store_is_bounded_the_least_recently_used_idle_record_evicted_and_counted(tokenizer):
    server, _ = make_server(tokenizer, max_episodes=3)

    async def episodes():
        for name in ["a", "b", "c", "a", "d", "e"]:  # "a" used again: "b" then "c" are the oldest
            assert (await post(server, *chat(name))).status_code == 200

    run(episodes())
    assert sorted(server.store.episodes) == ["a", "d", "e"]
    assert server.metrics()["episodes_evicted"] == 2
    assert server.take_episode("b") is None and server.take_episode("a").requests == 2


def test_a_record_in_use_is_not_evicted(tokenizer):
    from roll_gspo.serving.episodes import EpisodeStore

    server, _ = make_server(tokenizer)
    store = EpisodeStore(server.stitcher, server.render, max_episodes=1)
    busy = store.open("busy")  # a request of "busy" is running
    store.release(store.open("idle"))
    assert set(store.episodes) == {"busy", "idle"} and store.counters()["evicted"] == 0
    store.release(busy)
    store.release(store.open("new"))
    assert set(store.episodes) == {"new"} and store.counters()["evicted"] == 2


def test_a_server_nothing_trains_on_keeps_no_records(tokenizer):
    server, _ = make_server(tokenizer, keep_records=False)

    async def turns():
        return [await post(server, *chat("mine", text=f"t{i}")) for i in range(3)]

    responses = run(turns())
    assert [r.json()["episode_id"] for r in responses] == ["mine"] * 3
    assert not server.store.episodes and server.metrics()["unrecorded_requests"] == 3


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(tokenizer):
    """No Content-Length: the body is counted as it arrives and refused at the limit, not read whole."""
    server, _ = make_server(tokenizer, max_request_bytes=4096)
    sent = []

    async def body():
        for _ in range(1024):  # 1 MiB in 1 KiB chunks
            sent.append(1024)
            yield b" " * 1024

    response = run(post(server, content=body(), headers={"content-type": "application/json"}))
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    assert sum(sent) <= 4096 + 2 * 1024, sum(sent)


# -- item 3: a browser ------------------------------------------------------------------------------------
TOKENS = [None, "s3cret-token"]  # refused with or without a token


def guarded(tokenizer, token):
    server, _ = make_server(tokenizer, token=token)
    return server, chat("e")[0], ({"authorization": f"Bearer {token}"} if token else {})


@pytest.mark.parametrize("token", TOKENS)
def test_a_text_plain_post_is_refused(tokenizer, token):
    """A page's cross-origin `text/plain` POST needs no CORS preflight: only JSON is taken."""
    import json

    server, body, auth = guarded(tokenizer, token)
    plain = run(post(server, content=json.dumps(body).encode(), headers={"content-type": "text/plain", **auth}))
    assert plain.status_code == 415 and plain.json()["error"]["type"] == "invalid_request_error"
    assert server.counters["bad_requests"] == 1 and not server.store.episodes


@pytest.mark.parametrize("token", TOKENS)
def test_a_request_with_an_origin_is_refused(tokenizer, token):
    server, body, auth = guarded(tokenizer, token)
    origin = run(post(server, body, {"origin": "http://evil.example", **auth}))
    assert origin.status_code == 403 and "Origin" in origin.json()["error"]["message"]
    assert origin.json()["error"]["type"] == "permission_error"


@pytest.mark.parametrize("token", TOKENS)
def test_a_host_that_is_not_the_bound_address_is_refused(tokenizer, token):
    """A DNS-rebound name (or another port) in `Host`: refused; the loopback names of a loopback bind pass."""
    server, body, auth = guarded(tokenizer, token)
    for base in (f"http://evil.example:{PORT}", "http://127.0.0.1:9", "http://127.0.0.1"):
        rebound = run(post(server, body, auth, base=base))
        assert rebound.status_code == 403 and "Host" in rebound.json()["error"]["message"], base
    for base in (f"http://localhost:{PORT}", f"http://127.0.0.1:{PORT}", f"http://[::1]:{PORT}"):
        assert run(post(server, body, auth, base=base)).status_code == 200, base


def test_host_names_of_a_bind():
    from roll_gspo.serving.server import own_host_names, split_host

    assert split_host("LocalHost:8000") == ("localhost", 8000) and split_host("[::1]:80") == ("::1", 80)
    assert split_host("example.org") == ("example.org", 80) and split_host("a:b") == ("a", -1)
    assert {"localhost", "127.0.0.1", "::1"} <= own_host_names("127.0.0.1")
    assert "127.0.0.1" not in own_host_names("10.1.2.3") and "10.1.2.3" in own_host_names("10.1.2.3")


# -- item 10: a late answer -------------------------------------------------------------------------------
def test_an_answer_landing_after_its_episode_was_taken_is_counted_not_appended(tokenizer, caplog):
    """The agent timed out while its second request ran; the runner took the episode and handed its
    trajectory to training; then the engine's answer lands: counted and logged, the handed-out
    trajectory unchanged."""
    server, rank = make_server(tokenizer)
    first = [{"role": "user", "content": "go"}]

    async def race():
        assert (await post(server, {"model": "tiny", "messages": first}, {"X-Episode-Id": "e"})).status_code == 200
        rank.gate = asyncio.Event()
        history = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        late = asyncio.ensure_future(post(server, {"model": "tiny", "messages": history}, {"X-Episode-Id": "e"}))
        while not rank.in_flight:  # the second request is at the engine
            await asyncio.sleep(0.01)
        (trajectory,) = server.take_episode("e").trajectories(reward=1.0)
        handed = copy.deepcopy(trajectory)
        rank.gate.set()
        response = await late
        return trajectory, handed, response

    with caplog.at_level(logging.WARNING, logger="roll_gspo.serving"):
        trajectory, handed, response = run(race())
    assert response.status_code == 200  # the client is answered; its episode is no longer recorded
    assert (trajectory.response_ids, trajectory.agent_mask, trajectory.log_probs, trajectory.step_rewards) == \
        (handed.response_ids, handed.agent_mask, handed.log_probs, handed.step_rewards)
    assert trajectory.token_weight_versions == handed.token_weight_versions
    assert server.metrics()["episodes_late_turns"] == 1
    assert any("after its record was taken" in r.getMessage() for r in caplog.records)
    assert server.take_episode("e") is None  # the late answer opened no new record
