"""Continuous batching in a rollout rank (roll_gspo.strategies.engine_loop; issue 38 item 1): a
background thread steps the engine while requests are live; requests come from other threads as
futures; a weight update pauses the loop at a step boundary and the requests in flight wait and go
on, their later tokens stamped with the new version. Real engines (vLLM, hf_infer), tiny model."""
import os
import threading
import time

import pytest

from roll_gspo.strategies.engine import Sampling, generate_groups
from roll_gspo.strategies.engine_loop import EngineLoop, LoopedEngine

from tests.test_rollout_engine import PROMPTS, role_for


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    return VllmStrategy(role_for(tiny_model), max_model_len=96, seed=0)


def test_requests_from_many_threads_join_the_running_batch(vllm_engine):
    """Eight threads submit seeded requests at different moments: each gets exactly the tokens
    the same seed gives alone (vLLM seeds per request), and the batch held several at once."""
    sampling = Sampling(max_new_tokens=16, temperature=1.0)
    alone = [generate_groups(vllm_engine, [PROMPTS[i % 4]], sampling, 1, [50 + i])[0][0] for i in range(8)]
    loop = EngineLoop(vllm_engine)
    results = [None] * 8

    def client(i):
        time.sleep(0.01 * i)
        results[i] = loop.submit(f"t{i}", PROMPTS[i % 4], sampling, seed=50 + i).result(timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    for r, a in zip(results, alone):
        assert r.log_probs == pytest.approx(a.log_probs, abs=1e-4)
        assert r.finish_reason in ("stop", "length")
    assert loop.steps < sum(len(r.token_ids) for r in results)  # requests shared engine steps
    assert loop.in_flight() == 0 and not vllm_engine.unfinished()
    loop.close()


def test_a_weight_update_pauses_the_loop_and_requests_wait(vllm_engine, tiny_model):
    """A weight update while requests run: the loop stops at a step boundary (no step during the
    update), the requests survive it and finish, tokens before it version v, after it v + 1."""
    from safetensors.torch import load_file

    weights = list(load_file(os.path.join(tiny_model, "model.safetensors")).items())
    loop = EngineLoop(vllm_engine)
    engine = LoopedEngine(loop)
    version = vllm_engine.weight_version
    sampling = Sampling(max_new_tokens=40, temperature=1.0)
    futures = [loop.submit(f"w{i}", PROMPTS[i], sampling, seed=70 + i) for i in range(3)]
    deadline = time.monotonic() + 60  # bounded: a loop that stops stepping fails the test, never hangs it
    while loop.steps < 3 and vllm_engine.unfinished() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert loop.steps >= 3 or not vllm_engine.unfinished(), f"the loop stopped stepping at {loop.steps} steps"
    engine.begin_weight_update()  # pauses at the next step boundary, held until finish
    steps = loop.steps
    live = vllm_engine.unfinished()
    engine.load_weights(weights)
    time.sleep(0.05)
    assert loop.steps == steps  # nothing stepped on half-loaded weights
    engine.finish_weight_update(version + 1)
    outputs = [f.result(timeout=60) for f in futures]
    assert live, "the update came after every request had finished; nothing was tested"
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    crossed = [o for o in outputs if o.request_id in live]
    for o in crossed:
        versions = o.weight_versions
        assert versions == sorted(versions) and versions[0] == version and versions[-1] == version + 1
    after = generate_groups(engine, [PROMPTS[0]], Sampling(max_new_tokens=4, temperature=1.0), 1, [1])[0][0]
    assert after.weight_versions == [version + 1] * len(after.token_ids)
    loop.close()


def test_abort_and_close_return_partial_outputs(vllm_engine):
    loop = EngineLoop(vllm_engine)
    sampling = Sampling(max_new_tokens=60, temperature=1.0)
    cut = loop.submit("cut", PROMPTS[0], sampling, seed=3)
    while loop.steps < 2:
        time.sleep(0.002)
    loop.abort(["cut"])
    out = cut.result(timeout=30)
    assert out.finish_reason in ("abort", "stop") and len(out.log_probs) == len(out.token_ids)
    left = loop.submit("left", PROMPTS[1], sampling, seed=4)
    loop.close()
    assert left.result(timeout=30).finish_reason in ("abort", "stop", "length")
    assert not vllm_engine.unfinished()
    with pytest.raises(RuntimeError):
        loop.submit("late", PROMPTS[1], sampling)


def test_hf_infer_under_the_loop_and_a_refused_request(tiny_model):
    """hf_infer (a batch per step) through the loop gives the batch call's tokens; a request the
    engine refuses fails alone, the loop goes on."""
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy

    hf = HfInferStrategy(role_for(tiny_model), seed=0)
    sampling = Sampling(max_new_tokens=8, temperature=1.0)
    direct = generate_groups(hf, PROMPTS[:2], sampling, 2, [11, 12])
    loop = EngineLoop(hf)
    looped = generate_groups(LoopedEngine(loop), PROMPTS[:2], sampling, 2, [11, 12])
    assert [[o.token_ids for o in g] for g in looped] == [[o.token_ids for o in g] for g in direct]
    bad = loop.submit("bad", PROMPTS[0], sampling, seed=1)
    with pytest.raises(ValueError):
        loop.submit("bad", PROMPTS[0], sampling, seed=1)  # the id is in use
    assert bad.result(timeout=30).finish_reason in ("stop", "length")
    loop.close()
