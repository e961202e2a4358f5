"""`lora_sync: adapter` with the engine loop (the rollout endpoint, agentic
continuous batching). vLLM cannot swap the adapter under a live request, so a swap that met one
failed (`RuntimeError ... requests in flight`). The swap now drains the loop: the requests in flight
finish under the old adapter (their tokens keep its version), requests submitted meanwhile wait and
run under the new one. Pure Python over the engine contract: an engine that refuses, as vLLM's does."""
import threading
import time

from roll_gspo.strategies.engine import RequestTable, Sampling, TabledEngine
from roll_gspo.strategies.engine_loop import EngineLoop, LoopedEngine


class AdapterEngine(TabledEngine):
    """A request samples `length` tokens, one per step (the step sleeps a little, as a model would);
    `load_adapter` refuses while any request is unfinished, as VllmStrategy does."""

    def __init__(self, length=20):
        self.requests, self.weight_version, self.length, self.swaps = RequestTable(), 0, length, 0

    def submit(self, request_id, prompt_ids, sampling, seed=None, group=None):
        self.requests.add(request_id, self.weight_version)

    def step(self):
        time.sleep(0.002)
        done = []
        for rid in self.requests.unfinished():
            self.requests.extend(rid, [5], [-0.1], self.weight_version)
            if len(self.requests.outputs[rid].token_ids) >= self.length:
                self.requests.finish(rid, "length")
                done.append(rid)
        return done

    def abort(self, request_ids):
        return self.requests.abort(request_ids)

    def load_adapter(self, named_tensors, config, version=None):
        live = self.requests.unfinished()
        if live:
            raise RuntimeError(f"vLLM load_adapter with {len(live)} requests in flight")
        self.swaps += 1
        self.weight_version = version


def test_an_adapter_swap_drains_the_loop_instead_of_failing():
    engine = AdapterEngine()
    loop = EngineLoop(engine)
    looped = LoopedEngine(loop)
    try:
        sampling = Sampling(max_new_tokens=20, temperature=1.0)
        first = loop.submit("before", [1, 2], sampling)
        while loop.steps < 3:
            time.sleep(0.001)
        swap = threading.Thread(target=looped.load_adapter, args=([], {}, 1))
        swap.start()
        time.sleep(0.01)
        second = loop.submit("during", [1, 2], sampling)  # queued behind the drain
        swap.join(10)
        assert not swap.is_alive() and engine.swaps == 1
        before, during = first.result(timeout=10), second.result(timeout=10)
        assert before.weight_versions == [0] * 20  # finished under the old adapter
        assert during.weight_versions == [1] * 20  # admitted after the swap
    finally:
        loop.close()


def test_close_during_a_drain_resolves_the_queued_requests():
    engine = AdapterEngine(length=10 ** 6)  # never finishes by itself
    loop = EngineLoop(engine)
    sampling = Sampling(max_new_tokens=10 ** 6, temperature=1.0)
    running = loop.submit("running", [1], sampling)
    while loop.steps < 2:
        time.sleep(0.001)

    def drain():
        with loop.drained():
            pass

    draining = threading.Thread(target=drain, daemon=True)  # waits on `running`, which never ends
    draining.start()
    time.sleep(0.01)
    queued = loop.submit("queued", [1], sampling)
    loop.close()
    draining.join(10)
    assert not draining.is_alive()
    assert running.result(timeout=10).finish_reason == "abort"
    assert queued.result(timeout=10).finish_reason == "abort"
