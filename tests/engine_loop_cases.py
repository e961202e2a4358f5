"""Run by tests/test_engine_loop.py in a process of its own. Continuous batching in a rollout rank
(roll_gspo.strategies.engine_loop): a background thread steps the engine while requests are live;
requests come from other threads as futures; a weight update pauses the loop at a step boundary and
the requests in flight wait and go on, their later tokens stamped with the new version. Real engines
(vLLM, hf_infer), tiny model."""
import os
import threading
import time

import pytest

from roll_gspo.strategies.engine import Sampling, generate_groups
from roll_gspo.strategies.engine_loop import EngineLoop, LoopedEngine

from tests.test_rollout_engine import PROMPTS, role_for


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    import gc

    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    # An earlier module's in-process engine, kept alive by a reference cycle (an engine loop's
    # thread, a server), is destroyed by whichever gc pass comes next, and vLLM's shutdown tears
    # down the process's parallel groups: collected now, before this engine sets them up, not in the
    # middle of this module ("pipeline model parallel group is not initialized" in the full suite).
    gc.collect()
    return VllmStrategy(role_for(tiny_model), max_model_len=96, seed=0)


@pytest.fixture
def new_loop():
    """EngineLoop(engine), closed after the test even when it fails (a loop left running on the
    module's engine would step the next test's requests)."""
    made = []
    yield lambda engine: made.append(EngineLoop(engine)) or made[-1]
    for loop in made:
        loop.close()


def long_seeds(engine, prompt, sampling, count, at_least=8):
    """`count` seeds whose response to `prompt` runs `at_least` tokens or more on this engine, as
    it samples here and now (a random model's lengths are whatever the process's kernels give)."""
    found = []
    for seed in range(100, 400):
        out = generate_groups(engine, [prompt], sampling, 1, [seed])[0][0]
        if len(out.token_ids) >= at_least:
            found.append(seed)
            if len(found) == count:
                return found
    raise AssertionError(f"no {count} seeds give {at_least}+ tokens")


class GatedEngine:
    """The engine, with its `hold_at`-th step held until `release` is set (`reached` is set then):
    a test stops the loop after an exact number of steps, however fast they run."""

    def __init__(self, engine, hold_at):
        self.engine, self.hold_at, self.count = engine, hold_at, 0
        self.reached, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        self.count += 1
        if self.count == self.hold_at:
            self.reached.set()
            assert self.release.wait(60)
        return self.engine.step()


def test_requests_from_many_threads_join_the_running_batch(vllm_engine, new_loop):
    """Eight threads submit seeded requests at different moments: each gets exactly the tokens
    the same seed gives alone (vLLM seeds per request), and the batch held several at once."""
    sampling = Sampling(max_new_tokens=16, temperature=1.0)
    alone = [generate_groups(vllm_engine, [PROMPTS[i % 4]], sampling, 1, [50 + i])[0][0] for i in range(8)]
    gated = GatedEngine(vllm_engine, hold_at=2)  # the first request's 2nd step waits for the others
    loop = new_loop(gated)
    results = [None] * 8

    def client(i):
        time.sleep(0.01 * i)
        results[i] = loop.submit(f"t{i}", PROMPTS[i % 4], sampling, seed=50 + i).result(timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert gated.reached.wait(60)
    deadline = time.monotonic() + 60
    while loop.in_flight() < 8 and time.monotonic() < deadline:  # every client has submitted
        time.sleep(0.005)
    gated.release.set()
    for t in threads:
        t.join()
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    for r, a in zip(results, alone):
        assert r.log_probs == pytest.approx(a.log_probs, abs=1e-4)
        assert r.finish_reason in ("stop", "length")
    assert loop.steps < sum(len(r.token_ids) for r in results)  # requests shared engine steps
    assert loop.in_flight() == 0 and not vllm_engine.unfinished()
    loop.close()


def test_a_weight_update_pauses_the_loop_and_requests_wait(vllm_engine, tiny_model, new_loop):
    """A weight update while requests run: the loop stops at a step boundary (no step during the
    update), the requests survive it and finish, tokens before it version v, after it v + 1."""
    from safetensors.torch import load_file

    weights = list(load_file(os.path.join(tiny_model, "model.safetensors")).items())
    sampling = Sampling(max_new_tokens=40, temperature=1.0)
    seeds = long_seeds(vllm_engine, PROMPTS[0], sampling, 3)
    gated = GatedEngine(vllm_engine, hold_at=4)
    loop = new_loop(gated)
    engine = LoopedEngine(loop)
    version = vllm_engine.weight_version
    futures = [loop.submit(f"w{i}", PROMPTS[0], sampling, seed=seed) for i, seed in enumerate(seeds)]
    assert gated.reached.wait(60), "the loop did not reach its 4th step"
    pausing = threading.Thread(target=engine.begin_weight_update)  # pauses at the next step boundary
    pausing.start()
    time.sleep(0.05)
    gated.release.set()  # the 4th step runs; the loop then parks for the update
    pausing.join(60)
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


def test_a_weight_update_with_requests_in_flight_leaves_no_old_kv(vllm_engine, tiny_model, new_loop):
    """A sync with requests in flight must not leave the old weights' KV in use.
    vLLM refuses a plain prefix-cache reset while blocks are held (it returns False), so the running
    request would go on reading old-weights KV. With the reset preempting running requests their KV
    is recomputed: every token sampled after the update has the new policy's log-prob (measured
    before the fix: a 2.8e-2 nats gap; after: ~1e-6)."""
    from safetensors.torch import load_file

    original = list(load_file(os.path.join(tiny_model, "model.safetensors")).items())
    changed = [(name, tensor * 0.8 if tensor.dim() == 2 else tensor) for name, tensor in original]
    sampling = Sampling(max_new_tokens=40, temperature=1.0)
    (seed,) = long_seeds(vllm_engine, PROMPTS[0], sampling, 1, at_least=30)
    gated = GatedEngine(vllm_engine, hold_at=6)
    loop = new_loop(gated)
    engine = LoopedEngine(loop)
    version = vllm_engine.weight_version
    future = loop.submit("kv", PROMPTS[0], sampling, seed=seed)
    assert gated.reached.wait(60)
    pausing = threading.Thread(target=engine.begin_weight_update)
    pausing.start()
    time.sleep(0.05)
    gated.release.set()
    pausing.join(60)
    assert vllm_engine.unfinished(), "the request finished before the update; nothing was tested"
    engine.load_weights(changed)
    engine.finish_weight_update(version + 1)
    out = future.result(timeout=60)
    loop.close()
    try:
        vllm_engine.llm.reset_prefix_cache()  # idle now: the score below reads no cached block
        new_policy = vllm_engine.score([PROMPTS[0]], [out.token_ids])[0]
        after = [i for i, v in enumerate(out.weight_versions) if v == version + 1]
        assert after, "no token was sampled after the update"
        gap = max(abs(out.log_probs[i] - new_policy[i]) for i in after)
        assert gap < 1e-3, f"tokens sampled after the sync read old-weights KV: gap {gap:.2e} nats"
    finally:
        vllm_engine.begin_weight_update()
        vllm_engine.load_weights(original)
        vllm_engine.finish_weight_update(version + 2)


def test_abort_and_close_return_partial_outputs(vllm_engine, new_loop):
    sampling = Sampling(max_new_tokens=60, temperature=1.0)
    (seed,) = long_seeds(vllm_engine, PROMPTS[0], sampling, 1, at_least=20)
    loop = new_loop(vllm_engine)
    cut = loop.submit("cut", PROMPTS[0], sampling, seed=seed)
    deadline = time.monotonic() + 60  # bounded: a loop that stops stepping fails the test, never hangs it
    while loop.steps < 2 and time.monotonic() < deadline:
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


def test_hf_infer_under_the_loop_and_a_refused_request(tiny_model, new_loop):
    """hf_infer (a batch per step) through the loop gives the batch call's tokens; a request the
    engine refuses fails alone, the loop goes on."""
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy

    hf = HfInferStrategy(role_for(tiny_model), seed=0)
    sampling = Sampling(max_new_tokens=8, temperature=1.0)
    direct = generate_groups(hf, PROMPTS[:2], sampling, 2, [11, 12])
    loop = new_loop(hf)
    looped = generate_groups(LoopedEngine(loop), PROMPTS[:2], sampling, 2, [11, 12])
    assert [[o.token_ids for o in g] for g in looped] == [[o.token_ids for o in g] for g in direct]
    bad = loop.submit("bad", PROMPTS[0], sampling, seed=1)
    with pytest.raises(ValueError):
        loop.submit("bad", PROMPTS[0], sampling, seed=1)  # the id is in use
    assert bad.result(timeout=30).finish_reason in ("stop", "length")
    loop.close()
