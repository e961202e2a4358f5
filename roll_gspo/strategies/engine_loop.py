"""Continuous batching in a rollout rank: a background thread that steps a `RolloutEngine` while
requests are live, so requests join and leave the running batch one by one instead of in waves.

Other threads submit requests (`EngineLoop.submit` returns a `concurrent.futures.Future` of the
request's `RequestOutput`) and abort them; only the loop thread touches the engine, and it
applies what was submitted or aborted at an engine-step boundary. `paused()` stops the loop at
the next step boundary and gives the caller the engine alone (a weight update, `score`, `sleep`):
live requests stay in the engine and wait, never fail, and go on after the pause (their later
tokens stamped with the new weight version).

`LoopedEngine` is the engine as the rank's other code sees it while a loop runs: requests go
through the loop (so the batch calls' requests, `generate_groups`, share the running batch with
the endpoint's), everything else runs with the loop paused; a weight-update session holds the
pause from `begin_weight_update` to `finish_weight_update`, so no step runs on half-loaded weights.

Pure Python over the contract (roll_gspo.strategies.engine): vLLM and hf_infer alike.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from roll_gspo.strategies.engine import RequestHandle, RequestOutput, RolloutEngine, Sampling

logger = logging.getLogger("roll_gspo.engine_loop")


class EngineLoop:
    """Steps `engine` in a daemon thread while it has requests; see the module docstring."""

    def __init__(self, engine: RolloutEngine, name: str = "roll-gspo-engine-loop"):
        self.engine = engine
        self._cond = threading.Condition()
        self._submits: List[Tuple[str, List[int], Sampling, Optional[int], Optional[str], Future]] = []
        self._aborts: List[str] = []
        self._futures: Dict[str, Future] = {}  # submitted to the engine, not yet resolved
        self._pause_requests = 0
        self._drain_requests = 0  # drained(): step what is live, admit nothing, park once it is done
        self._paused = False  # the loop thread is parked at a step boundary for a pause
        self._closed = False
        # Figures: engine steps, seconds inside `engine.step` (busy), seconds since start.
        self.steps = 0
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self.failures = 0  # requests failed by an engine error
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- other threads --------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling, seed: Optional[int] = None,
               group: Optional[str] = None) -> "Future[RequestOutput]":
        """Queue a request; it joins the engine at the next step boundary. The future resolves with
        its finished (or aborted) output, or the engine's exception."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            if request_id in self._futures or any(s[0] == request_id for s in self._submits):
                raise ValueError(f"request id {request_id!r} is already in use")
            self._submits.append((request_id, list(prompt_ids), sampling, seed, group, future))
            self._cond.notify_all()
        return future

    def abort(self, request_ids: Sequence[str]) -> None:
        """End these requests at the next step boundary; their futures resolve with what they had
        (finish_reason "abort"). Unknown or finished ids are skipped."""
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[RolloutEngine]:
        """Stop the loop at the next engine-step boundary and hold it there; yields the engine,
        which the caller has alone until the block ends. Nests; callable from several threads
        (each waits for the boundary; they then share the pause, so serialise engine calls
        yourself where two may pause at once: a Ray actor's default group does)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("the engine loop cannot pause itself")
        with self._cond:
            self._pause_requests += 1
            self._cond.notify_all()
            while not self._paused and self._thread.is_alive():
                self._cond.wait()
        try:
            yield self.engine
        finally:
            with self._cond:
                self._pause_requests -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def drained(self) -> Iterator[RolloutEngine]:
        """`paused()`, but only once the requests in flight have finished: the loop keeps stepping
        them and admits no new one (those queue and join after the block). For what cannot run
        beside a live request at all, e.g. swapping the adapter they sample with."""
        with self._cond:
            self._drain_requests += 1
            self._cond.notify_all()
        try:
            with self.paused() as engine:
                yield engine
        finally:
            with self._cond:
                self._drain_requests -= 1
                self._cond.notify_all()

    def pause(self) -> None:
        """`paused()` entered without a block: until `resume`."""
        self._held = self.paused()
        self._held.__enter__()

    def resume(self) -> None:
        held, self._held = getattr(self, "_held", None), None
        if held is None:
            raise RuntimeError("resume without pause")
        held.__exit__(None, None, None)

    def in_flight(self) -> int:
        """Requests submitted and not yet resolved."""
        with self._cond:
            return len(self._futures) + len(self._submits)

    def busy_fraction(self) -> float:
        """Share of the loop's lifetime spent inside engine steps."""
        return self.busy_s / max(time.perf_counter() - self.started, 1e-9)

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort what is live (futures resolve with partial outputs) and stop the thread."""
        with self._cond:
            self._aborts.extend(self._futures)
            self._aborts.extend(s[0] for s in self._submits)
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # -- the loop thread ------------------------------------------------------------------------------
    def _parks(self) -> bool:
        """At a step boundary: park for a pause (a drain parks once nothing is in flight)."""
        return bool(self._pause_requests) and (not self._drain_requests or not self._futures)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._parks() or (not self._closed and not self._aborts and not self._futures
                                        and (not self._submits or self._drain_requests)):
                    if self._parks():
                        self._paused = True
                        self._cond.notify_all()
                    self._cond.wait()
                self._paused = False
                if self._drain_requests and not self._closed:  # new requests wait for the drain's block to end
                    submits = []
                else:
                    submits, self._submits = self._submits, []
                aborts, self._aborts = self._aborts, []
                closing = self._closed
            for request_id, prompt, sampling, seed, group, future in submits:
                if request_id in aborts:  # aborted before it reached the engine
                    _resolve(future, RequestOutput(request_id, finish_reason="abort",
                                                   submitted_version=self.engine.weight_version))
                    continue
                try:
                    self.engine.submit(request_id, prompt, sampling, seed, group=group)
                except BaseException as exc:  # a refused request fails alone
                    _resolve(future, error=exc)
                    continue
                with self._cond:
                    self._futures[request_id] = future
            if aborts:
                self._abort_now(aborts)
            if closing:
                self._abort_now(list(self._futures))
                with self._cond:
                    self._paused = True
                    self._cond.notify_all()
                return
            if self._futures:
                self._step()

    def _abort_now(self, request_ids: List[str]) -> None:
        known = [rid for rid in dict.fromkeys(request_ids) if rid in self._futures]
        if not known:
            return
        outputs = self.engine.abort(known)
        with self._cond:
            for out in outputs:
                _resolve(self._futures.pop(out.request_id), out)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            self.engine.step()
        except BaseException as exc:  # the engine failed: its requests fail, the loop goes on
            logger.exception("engine step failed; failing its %d requests", len(self._futures))
            with self._cond:
                futures, self._futures = self._futures, {}
            with contextlib.suppress(BaseException):
                self.engine.abort(list(futures))
            self.failures += len(futures)
            for future in futures.values():
                _resolve(future, error=exc)
            return
        finally:
            self.busy_s += time.perf_counter() - start
            self.steps += 1
        # Finished: everything tracked that the engine no longer runs (a step another thread ran
        # through `wait` while paused may have finished some, so `step`'s return is not enough).
        live = set(self.engine.unfinished())
        done = [rid for rid in self._futures if rid not in live]
        if done:
            outputs = self.engine.wait(done)
            with self._cond:
                for out in outputs:
                    _resolve(self._futures.pop(out.request_id), out)


def _resolve(future: Future, output: Optional[RequestOutput] = None, error: Optional[BaseException] = None) -> None:
    """Set a future's outcome unless its waiter cancelled it (an asyncio caller that went away)."""
    from concurrent.futures import InvalidStateError

    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(output)


class LoopedEngine:
    """The rank's engine while an `EngineLoop` drives it (see the module docstring): requests via
    the loop, any other call with the loop paused, a weight-update session paused throughout."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.engine = loop.engine
        self._futures: Dict[str, Future] = {}
        self._session = None

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling, seed: Optional[int] = None,
               group: Optional[str] = None) -> RequestHandle:
        self._futures[request_id] = self.loop.submit(request_id, prompt_ids, sampling, seed, group)
        return RequestHandle(self, request_id)  # type: ignore[arg-type]

    def wait(self, request_ids: Sequence[str]) -> List[RequestOutput]:
        return [self._futures.pop(rid).result() for rid in request_ids]

    def abort(self, request_ids: Sequence[str]) -> List[RequestOutput]:
        ids = [rid for rid in request_ids if rid in self._futures]
        self.loop.abort(ids)
        return [self._futures.pop(rid).result() for rid in ids]

    def unfinished(self) -> List[str]:
        return [rid for rid, future in self._futures.items() if not future.done()]

    def step(self) -> List[str]:
        raise RuntimeError("the engine loop steps this engine; wait for requests instead")

    def begin_weight_update(self) -> None:
        if self._session is None:
            self._session = self.loop.paused()
            self._session.__enter__()
        self.engine.begin_weight_update()

    def finish_weight_update(self, version: Optional[int] = None) -> None:
        try:
            self.engine.finish_weight_update(version)
        finally:
            session, self._session = self._session, None
            if session is not None:
                session.__exit__(None, None, None)

    def load_adapter(self, *args, **kwargs) -> None:
        """The adapter swap, once the requests sampling with the old adapter have finished (their
        tokens keep the old version); requests submitted meanwhile run with the new one."""
        with self.loop.drained() as engine:
            engine.load_adapter(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if not callable(attr):
            return attr

        def paused_call(*args, **kwargs):
            if self._session is not None:  # inside a weight-update session: paused already
                return attr(*args, **kwargs)
            with self.loop.paused():
                return attr(*args, **kwargs)

        return paused_call
