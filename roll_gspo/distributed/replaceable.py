"""A role whose ranks are replaced when they die or hang (rollout ranks; the rules are
`roll_gspo.distributed.fault_tolerance`'s).

`ReplaceableCluster` is a `Cluster` that remembers every call it sends (rank, method, arguments)
until the call's result is gathered. While `gather` waits, it probes the ranks it waits for
(`health`, in a concurrency group of its own, so a busy rank answers) and judges them with a
`HangWatch`. A rank whose call fails because its process died, or that is found hung (then killed),
is replaced: its actor is started again with the same options (its own placement bundle, its
environment), set up, handed to the `on_replaced` hooks (the trainer's current weights, the request
pool's held groups), and every call of it still being waited for is sent again to the new actor,
the same arguments (prompts with their per-request seeds): its results are what the dead rank's
would have been. Calls sent before a replacement and gathered later are sent again too. Beyond
`max_restarts` replacements of a rank the run stops as a plain `Cluster` stops it, the reason and
the rank's log file named (`RestartsExhaustedError`).

Calls awaited on their own (`submit`: the agentic pipeline's turns, one call each, awaited as the
episodes' env steps return) get the same care from a watcher thread of the cluster's: it probes the
ranks that hold such calls, replaces one that died or hangs, and sends its calls again; each call's
future gets the result of the call's last sending. A replacement holds the cluster's lock, so that
no call is sent to a rank that is not set up yet.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray

from roll_gspo.distributed.cluster import Cluster, RankUnresponsive, RestartsExhaustedError
from roll_gspo.distributed.fault_tolerance import HangWatch, RestartBudget, probe_interval_s

logger = logging.getLogger("roll_gspo.cluster")
GONE_TIMEOUT_S = 60.0  # how long a killed rank's actor may take to be gone before it is started again

# A hook run after a rank was replaced, before its calls are sent again: (rank, new actor) -> what it
# did, for the console line ("" for nothing to say).
ReplacedHook = Callable[[int, Any], str]


class ReplaceableCluster(Cluster):
    """A `Cluster` of independent ranks that are replaced, not mourned (see the module)."""

    def __init__(self, *args, budget: RestartBudget, hang_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.budget = budget
        self.hang_timeout_s = hang_timeout_s
        self.on_replaced: List[ReplacedHook] = []
        self.incarnation = [0] * self.world_size  # replacements of each rank so far
        # Every call not yet gathered: ref -> (rank, incarnation it was sent to, method, args, kwargs).
        self._calls: Dict[Any, Tuple[int, int, str, tuple, dict]] = {}
        # `submit`: each call not yet answered -> its future; the refs whose rank died, for the watcher.
        self._lock = threading.RLock()  # held by a replacement and by every submit
        self._submitted: Dict[Any, Future] = {}
        self._lost: "queue.Queue[Tuple[Any, BaseException]]" = queue.Queue()
        self._watcher: Optional[threading.Thread] = None
        self._stopped: Optional[BaseException] = None  # why the watcher stopped every rank

    # -- sending calls (remembered, to be sent again) -------------------------------------------------
    def call_async(self, rank: int, method: str, *args, **kwargs):
        """`method(*args, **kwargs)` on `rank`; its ref, to `gather`."""
        ref = getattr(self.workers[rank], method).remote(*args, **kwargs)
        self._calls[ref] = (rank, self.incarnation[rank], method, args, kwargs)
        return ref

    def execute_all_async(self, method: str, *args, **kwargs) -> List[Any]:
        return [self.call_async(rank, method, *args, **kwargs) for rank in range(self.world_size)]

    def dispatch_async(self, method: str, batch, skip_empty: bool = False, **kwargs) -> List[Any]:
        shards = batch.chunk(self.world_size)
        return [self.call_async(rank, method, shard, **kwargs) for rank, shard in enumerate(shards)
                if len(shard) or not skip_empty]

    # -- calls awaited on their own (the watcher thread) -----------------------------------------------
    def submit(self, rank: int, method: str, *args, **kwargs) -> "Future[Any]":
        """`method(*args, **kwargs)` on `rank`, its result in a future awaited on its own; a rank that
        dies or hangs meanwhile is replaced and the call sent again (the module docstring)."""
        future: Future = Future()
        with self._lock:  # not during a replacement: the call goes to a rank that is set up
            if self._stopped is not None:  # the reason, not an index error on the stopped ranks
                future.set_exception(self._stopped)
                return future
            self._send_submitted(future, rank, method, args, kwargs)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, daemon=True, name=f"roll-gspo-watch-{self.name}")
                self._watcher.start()
        return future

    def _send_submitted(self, future: Future, rank: int, method: str, args: tuple, kwargs: dict) -> None:
        ref = self.call_async(rank, method, *args, **kwargs)
        self._submitted[ref] = future
        ref.future().add_done_callback(lambda done: self._answered(ref, done))

    def _answered(self, ref: Any, done: Future) -> None:
        """A submitted call's answer (on Ray's thread): its result or error to its future; a dead
        rank's call to the watcher, which replaces the rank and sends the call again."""
        exc = done.exception()
        if isinstance(exc, ray.exceptions.RayActorError) and not isinstance(exc, ray.exceptions.RayTaskError):
            self._lost.put((ref, exc))
            return
        future = self._submitted.pop(ref, None)  # None: sent again meanwhile (its rank was found hung)
        if future is None:
            return
        self._calls.pop(ref, None)
        if exc is not None:  # raised in the rank, or a worker it called died: the caller stops the run
            future.set_exception(exc)
        else:
            future.set_result(done.result())

    def _watch(self) -> None:
        """The watcher: replaces the ranks whose submitted calls failed because they died, and
        every probe interval probes the ranks that hold submitted calls (hung ones are replaced);
        their calls are sent again. A replacement that fails (the budget spent, the new process
        raised) fails every submitted call with its error."""
        watches: Dict[int, HangWatch] = {}
        probes: Dict[int, Any] = {}
        interval = probe_interval_s(self.hang_timeout_s)
        while self.workers:  # until the cluster is shut down
            try:
                ref, cause = self._lost.get(timeout=interval)
            except queue.Empty:
                ref = None
            try:
                if ref is not None and ref in self._submitted:  # not sent again already
                    rank, incarnation, *_ = self._calls[ref]
                    with self._lock:
                        if incarnation == self.incarnation[rank]:
                            self.replace(rank, cause)
                        watches.pop(rank, None)
                        probes.pop(rank, None)
                        self._submit_again(rank)
                held = {self._calls[r][0] for r in list(self._submitted) if r in self._calls}
                for rank in set(watches) - held:  # no call waits for it: not judged
                    watches.pop(rank)
                    probes.pop(rank, None)
                if held and ref is None:
                    with self._lock:
                        self._probe(held, watches, probes, self._submit_again)
            except BaseException as exc:  # noqa: BLE001 - the callers' futures raise it
                self._stopped = exc
                for r in list(self._submitted):
                    future = self._submitted.pop(r, None)
                    self._calls.pop(r, None)
                    if future is not None:
                        future.set_exception(exc)

    def _submit_again(self, rank: int) -> None:
        """Every submitted call of `rank` not yet answered and sent to an earlier actor goes to its
        current one (the same arguments)."""
        for ref in list(self._submitted):
            call = self._calls.get(ref)
            if call is None or call[0] != rank or call[1] == self.incarnation[rank]:
                continue
            future = self._submitted.pop(ref, None)
            if future is None:  # answered meanwhile
                continue
            self._calls.pop(ref, None)
            self._send_submitted(future, rank, *call[2:])

    # -- waiting, probing, replacing ------------------------------------------------------------------
    def gather(self, refs: List[Any]) -> List[Any]:
        """Results of calls sent by this cluster, in order; a rank that died or hangs meanwhile is
        replaced and its calls sent again (any other failure stops every rank, as `Cluster.gather`)."""
        refs = list(refs)
        if any(ref not in self._calls for ref in refs):  # sent around call_async: nothing to send again
            return super().gather(refs)
        results: List[Any] = [None] * len(refs)
        pending = set(range(len(refs)))
        watches: Dict[int, HangWatch] = {}
        probes: Dict[int, Any] = {}
        interval = probe_interval_s(self.hang_timeout_s)
        while pending:
            index_of = {refs[i]: i for i in pending}
            ready, _ = ray.wait(list(index_of), num_returns=1, timeout=interval)
            if not ready:
                self._probe({self._calls[refs[i]][0] for i in pending}, watches, probes,
                            lambda rank: self._send_again(rank, refs, pending))
                continue
            index = index_of[ready[0]]
            try:
                results[index] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                if isinstance(exc, ray.exceptions.RayTaskError):  # alive; a worker it called died
                    self.fail(self._calls[refs[index]][0], exc)
                self._replace_for(refs, index, pending, exc, watches, probes)
                continue
            except Exception as exc:
                self.fail(self._calls[refs[index]][0], exc)
            pending.discard(index)
            self._calls.pop(refs[index], None)
        return results

    def recover(self, unresponsive: Sequence[int] = ()) -> List[int]:
        """Probe every rank (one answer within the hang deadline); replace those that died or do not
        answer, and at once those of `unresponsive` (found so by the caller's own probes, e.g. the
        weight sender's). Returns the ranks replaced (after a failed weight sync: which rank broke it)."""
        probes = {rank: worker.health.remote() for rank, worker in enumerate(self.workers)}
        replaced = []
        for rank, probe in probes.items():
            if rank in unresponsive:
                self._kill_hung(rank)
                self.replace(rank, RankUnresponsive(
                    f"did not answer a health probe within fault_tolerance.hang_timeout_s = {self.hang_timeout_s:g} s "
                    f"while it loaded a weight bucket"))
                replaced.append(rank)
                continue
            try:
                ray.get(probe, timeout=self.hang_timeout_s)
                continue
            except ray.exceptions.GetTimeoutError:
                reason: BaseException = RankUnresponsive(
                    f"did not answer a health probe within fault_tolerance.hang_timeout_s = {self.hang_timeout_s:g} s")
                self._kill_hung(rank)
            except ray.exceptions.RayActorError as exc:
                reason = exc
            self.replace(rank, reason)
            replaced.append(rank)
        return replaced

    def replace(self, rank: int, cause: BaseException) -> None:
        """Start `rank` again in its placement bundle, set it up and run the `on_replaced` hooks; one
        console line. Beyond the budget: every rank stopped, `RestartsExhaustedError` raised."""
        with self._lock:  # no call is sent to the rank meanwhile (`submit`)
            self._replace(rank, cause)

    def _replace(self, rank: int, cause: BaseException) -> None:
        if not self.budget.allows(self.name, rank):
            message = self.death_message(rank, cause, self.budget.exhausted_sentence(self.name, rank))
            self.shutdown()
            raise RestartsExhaustedError(message) from cause
        line, output = self.death_line(rank, cause), self.output_of(rank)
        start = time.monotonic()
        ray.kill(self.workers[rank], no_restart=True)
        self._wait_gone(rank)
        worker = self._start_rank(rank)
        self.workers[rank] = worker
        self._whereabouts[rank] = worker.whereabouts.remote()
        self.incarnation[rank] += 1
        count = self.budget.record(self.name, rank)
        try:
            ray.get(worker.setup.remote())
            notes = [note for note in (hook(rank, worker) for hook in self.on_replaced) if note]
        except ray.exceptions.RayActorError as exc:  # the new process died too: its own failure counts
            self.replace(rank, exc)
            return
        except Exception as exc:
            self.fail(rank, exc)
        logger.warning("%s; replaced in its placement bundle (restart %d of %d for this rank, %.1f s)%s%s",
                       line, count, self.budget.max_restarts, time.monotonic() - start,
                       "".join(f"; {note}" for note in notes), f". Its output: {output}" if output else "")

    def _replace_for(self, refs: List[Any], index: int, pending: set, cause: BaseException,
                     watches: Dict[int, HangWatch], probes: Dict[int, Any]) -> None:
        """refs[index] failed because its rank's actor is gone: replace the rank unless that was done
        already (the call was sent to an earlier actor), then send its pending calls again."""
        rank, incarnation, *_ = self._calls[refs[index]]
        if incarnation == self.incarnation[rank]:
            self.replace(rank, cause)
        watches.pop(rank, None)
        probes.pop(rank, None)
        self._send_again(rank, refs, pending)

    def _send_again(self, rank: int, refs: List[Any], pending: set) -> None:
        """Every pending call of `rank` sent to an earlier actor goes to its current one."""
        for i in sorted(pending):
            call_rank, incarnation, method, args, kwargs = self._calls[refs[i]]
            if call_rank == rank and incarnation != self.incarnation[rank]:
                self._calls.pop(refs[i])
                refs[i] = self.call_async(rank, method, *args, **kwargs)

    def _probe(self, ranks, watches: Dict[int, HangWatch], probes: Dict[int, Any],
               send_again: Callable[[int], None]) -> None:
        """Probe the ranks waited for; a hung one is killed, replaced, and its calls sent again
        (`send_again(rank)`)."""
        now = time.monotonic()
        for rank in sorted(ranks):
            watch = watches.setdefault(rank, HangWatch(self.hang_timeout_s, started=now, progress_at=now))
            probe = probes.get(rank)
            if probe is not None:
                done, _ = ray.wait([probe], timeout=0)
                if done:
                    probes.pop(rank)
                    try:
                        steps, in_flight = ray.get(probe)
                    except ray.exceptions.RayActorError:
                        continue  # died: its call fails too, and is handled there
                    watch.answered(now, steps, in_flight)
            if rank not in probes:
                probes[rank] = self.workers[rank].health.remote()
                watch.probe_sent(now)
            why = watch.verdict(now)
            if why is None:
                continue
            self._kill_hung(rank)
            self.replace(rank, RankUnresponsive(f"stopped answering: it {why}"))
            watches.pop(rank, None)
            probes.pop(rank, None)
            send_again(rank)

    def _kill_hung(self, rank: int) -> None:
        """Kill a rank found hung. Ray's kill asks the process to exit first, which a frozen process
        (SIGSTOP, a native hang) does not: on this node it gets SIGKILL at once (its pid is known
        alive, and checked to be a Ray worker)."""
        import psutil

        from roll_gspo.distributed.cluster import node_address

        node, pid = self.where(rank)
        ray.kill(self.workers[rank], no_restart=True)
        if node != node_address() or pid == "unknown":
            return
        try:
            process = psutil.Process(int(pid))
            if process.name().startswith("ray::"):
                process.kill()
        except psutil.Error:  # gone already
            pass

    def _wait_gone(self, rank: int) -> None:
        """Until the killed actor's name is free (its process ended, its bundle's resources back)."""
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(self.actor_name(rank))
            except ValueError:
                return
            time.sleep(0.1)
        raise RestartsExhaustedError(f"role {self.name} rank {rank}: its killed actor was still alive after "
                                     f"{GONE_TIMEOUT_S:.0f} s; it cannot be replaced")

