"""A role's ranks as Ray actors (ROLL's role -> cluster -> strategy shape, minus the magic).

`Cluster` starts `world_size` actors of one worker class with the role's CPU/GPU reservation,
gives them the torch.distributed rendezvous (rank 0's address and a free port), and offers
`execute_all` (same call on every rank) and `dispatch` (split a Batch over ranks, gather back).
"""
from __future__ import annotations

import logging
import os
import socket
import weakref
from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Tuple

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.fault_tolerance import HangWatch, PhaseDeadline, hung_message, phase_of, probe_interval_s
from roll_gspo.schema.config import PipelineConfig, RoleConfig
from roll_gspo.utils.imports import lighter_imports
from roll_gspo.utils.logging import (LOG_DIR_ENV, capture_output, configure_vllm_logging, keep_logs_in_file,
                                     log_path, setup_logging, trace_to_log_file)

logger = logging.getLogger("roll_gspo.cluster")
PLACEMENT_TIMEOUT_S = float(os.environ.get("ROLL_GSPO_PLACEMENT_TIMEOUT_S", "300"))

# Environment every rank gets: vLLM in-process (no engine subprocess; 4 s start instead of 25),
# no torch.compile of vLLM's sampler on CPU (20 s per fresh process), bounded vLLM KV cache.
DEFAULT_WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def worker_env(cfg: PipelineConfig, role: Optional[RoleConfig] = None) -> Dict[str, str]:
    """The environment a role's workers get: a model role's allocator (`memory_allocator`), then
    the top-level `system_envs`, then the role's own."""
    from roll_gspo.distributed.allocator import allocator_env

    allocator = {}
    if role is not None:
        on_gpu = role.num_gpus_per_worker > 0 or role.device_mapping is not None
        # `auto` depends on the policy's size (PipelineConfig.policy_parameters reads its config.json)
        parameters = cfg.policy_parameters() if cfg.memory_allocator == "auto" else None
        allocator = allocator_env(cfg.memory_allocator, on_gpu, parameters=parameters)
    from roll_gspo.distributed.fault_tolerance import COLLECTIVE_TIMEOUT_ENV

    collective = {COLLECTIVE_TIMEOUT_ENV: f"{cfg.fault_tolerance.collective_timeout_s:g}"} if role is not None else {}
    return {**allocator, **collective, **cfg.system_envs, **(getattr(role, "system_envs", None) or {})}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def node_address() -> str:
    return ray.util.get_node_ip_address()


def init_ray(required_cpus: float, required_gpus: float) -> None:
    """Join a running Ray cluster (RAY_ADDRESS, or a head on this machine) or start a local one.

    A local Ray gets at least as many logical CPUs as the roles reserve, so fractional
    reservations never leave an actor pending forever; a joined cluster that is too small is an
    error naming the shortfall instead of a silent hang.
    """
    if not ray.is_initialized():
        _connect_or_start(required_cpus)
    _check_resources(required_cpus, required_gpus)


def _connect_or_start(required_cpus: float) -> None:
    # Workers set DEFAULT_WORKER_ENV themselves (RankWorker), so a job's own runtime_env (e.g.
    # `ray job submit --working-dir .`) is left as it is. Only RAY_ADDRESS or a head started with
    # `ray start` is joined: address="auto" would also grab any other script's private Ray.
    address = os.environ.get("RAY_ADDRESS") or ray._private.utils.read_ray_address()
    # Ray's own notices (token authentication, "Started a local Ray instance") go where the root
    # logger sends them: the driver's log file, and errors to the console (utils.logging.use_log_dir).
    logging.getLogger("ray").propagate = True
    joined = False
    if address and address != "local":  # RAY_ADDRESS=local: a private Ray even beside a head
        try:
            ray.init(address=address, log_to_driver=True, configure_logging=False)
            joined = True
            logger.info("joined Ray cluster at %s", address)
        except ConnectionError as exc:
            if os.environ.get("RAY_ADDRESS"):
                raise
            logger.warning("no Ray head answers at %s (%s); starting a local Ray", address, exc)
    if not joined:
        from roll_gspo.distributed.reaper import start_reaper

        start_reaper()  # the private Ray's processes end with this driver, however it ends
        num_cpus = max(os.cpu_count() or 1, int(required_cpus + 0.999))
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                 configure_logging=False)
        logger.info("started a local Ray with %d logical CPUs", num_cpus)


def _check_resources(required_cpus: float, required_gpus: float) -> None:
    resources = ray.cluster_resources()
    missing = []
    if resources.get("CPU", 0) + 1e-6 < required_cpus:
        missing.append(f"{required_cpus:g} CPUs requested, cluster has {resources.get('CPU', 0):g}")
    if resources.get("GPU", 0) + 1e-6 < required_gpus:
        missing.append(f"{required_gpus:g} GPUs requested, cluster has {resources.get('GPU', 0):g}")
    if missing:
        raise RuntimeError("the Ray cluster is too small for this config's roles: " + "; ".join(missing)
                           + " (lower the roles' world_size / num_cpus_per_worker / num_gpus_per_worker)")


def _reserve(name: str, world_size: int, num_cpus: float, num_gpus: float):
    """A placement group with one bundle per rank, packed onto as few nodes as possible (ranks
    of a role talk to each other most). Fails with the shortfall named instead of waiting forever."""
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"role {name}: Ray could not reserve {world_size} x {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s "
            f"(available now: {ray.available_resources()}); lower world_size / num_cpus_per_worker / "
            f"num_gpus_per_worker or add nodes") from None
    return group


def _log_dir_env() -> Dict[str, str]:
    return {LOG_DIR_ENV: os.environ[LOG_DIR_ENV]} if os.environ.get(LOG_DIR_ENV) else {}


class WorkerDiedError(RuntimeError):
    """A rank's process died (killed, out of memory, a crash in native code)."""


class WorkerHungError(WorkerDiedError):
    """A rank's process is alive but does not answer (SIGSTOP, a native hang holding the GIL): the
    driver stops the run as for a death (`auto_resume_on_failure` applies)."""


class RankUnresponsive(TimeoutError):
    """Why a live rank was given up on (no answer to a health probe, no engine step): its lines say
    "is unresponsive (not dead)" where a death's say "died"."""


class RestartsExhaustedError(WorkerDiedError):
    """A replaceable rank died once more than `fault_tolerance.max_restarts` allows."""


def describe_dead_actor(text: str) -> str:
    """`role <name> rank <r> (node <ip>, pid <pid>)` from Ray's ActorDiedError text, whose actor
    names are `<role>-<rank>-<driver pid>` (see `Cluster`)."""
    import re

    name = re.search(r"name: (\S+)-(\d+)-\d+", text)
    pid = re.search(r"\bpid: (\d+)", text)
    ip = re.search(r"\bip: (\S+)", text)
    if not name:
        return text.strip().splitlines()[0] if text.strip() else "unknown worker"
    return (f"role {name.group(1)} rank {name.group(2)} (node {ip.group(1) if ip else 'unknown'}, "
            f"pid {pid.group(1) if pid else 'unknown'}) died")


MEMORY_KILL_MARK = "running low on memory"  # in Ray's memory monitor's message (OutOfMemoryError, exit detail)


def is_memory_kill(exc: BaseException) -> bool:
    """Whether `exc` (or the remote error it wraps) says Ray's memory monitor killed a worker."""
    return isinstance(exc, ray.exceptions.OutOfMemoryError) or MEMORY_KILL_MARK in str(exc)


def describe_memory_kill(text: str, ranks: Optional[Dict[int, str]] = None, fallback: str = "a worker") -> str:
    """One line from Ray's memory-monitor message: which rank (by the killed process's pid in
    `ranks`, {pid: "role <name> rank <r>"}; else `fallback`), its resident memory, and the host's.

    Ray's text: "... where the task (actor ID: ..., name=ActorTrainWorker.train_step, pid=4331,
    memory used=10.52GB) was running was 22.41GB / 23.45GB (0.955), which exceeds the memory usage
    threshold of 0.95. Ray killed this worker ..." (fields missing in older Rays are left out)."""
    import re

    def find(pattern: str) -> Optional[str]:
        match = re.search(pattern, text)
        return match.group(1) if match else None

    pid, task = find(r"\bpid=(\d+)"), find(r"\bname=([\w.<>-]+)")
    # Each killed process's pid with its own memory figure: Ray >= 2.56 may kill several workers and
    # lists each ("pid=N, actual memory used=X"); the first pid in the text is the failed call's.
    used_by = {int(p): u for p, u in re.findall(r"\bpid=(\d+), (?:actual )?memory used=([\d.]+\s*[KMGT]?B)", text)}
    used = used_by.get(int(pid)) if pid else None
    host = re.search(r"was running was ([\d.]+\s*[KMGT]?B) / ([\d.]+\s*[KMGT]?B)", text)
    threshold = find(r"memory usage threshold of (\d+(?:\.\d+)?)")
    who = (ranks or {}).get(int(pid)) if pid else None
    who = who or (f"{fallback} ({task}, pid {pid})" if task and pid else fallback)
    held = f" holding {used}" if used else ""
    others = [f"{(ranks or {}).get(other) or f'pid {other}'} ({figure})" for other, figure in used_by.items()
              if str(other) != pid]
    if others:
        held += f"; Ray also killed {', '.join(others)}"
    where = (f" when the host's memory use reached {host.group(1)} of {host.group(2)}"
             + (f" (Ray's threshold: {threshold})" if threshold else "")) if host else ""
    return (f"{who} was killed for memory by Ray{held}{where}. `run_pipeline.py --config ... --dry-run` prints each "
            f"process's estimated peak and the keys that shrink it; the run stops, its last complete checkpoint is "
            f"intact (resume with resume_from_checkpoint=auto)")


def describe_worker_error(exc: BaseException) -> Optional[str]:
    """One line for a Python exception raised in a rank's method (Ray's RayTaskError, which the
    driver receives with the remote traceback in its text; also when the rank that raised was
    called by another rank, e.g. a rollout rank during the trainer's weight sync):
    `role <name> rank <r>: <Type>: <message> (raised in <Class.method>; trace: <log file>)`.
    The rank is the innermost process of the text (its log file `<role>-<rank>-<pid>.log`, or this
    driver's clusters); the rank wrote the whole trace to that file (`RankWorker`). None when
    `exc` is no such error."""
    import glob
    import re

    error, seen = exc, set()
    while error is not None and not isinstance(error, ray.exceptions.RayTaskError) and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    if not isinstance(error, ray.exceptions.RayTaskError) or isinstance(error, ray.exceptions.RayActorError):
        return None
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    # Each process the call passed through heads its part: "ray::Class.method() (pid=N, ip=A, ...)";
    # the last one raised.
    headers = re.findall(r"ray::([\w.]+)\(\)\s*\(pid=(\d+), ip=([^,)\s]+)", text)
    where, pid, node = headers[-1] if headers else ("a worker", None, None)
    cause = getattr(error, "cause", None) or error
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    message = (lines[0].strip() + (" [...]" if len(lines) > 1 else "")) if lines else "(no message)"
    who, trace = f"{where} (pid {pid}, node {node})" if pid else where, None
    folder = os.environ.get(LOG_DIR_ENV)
    files = sorted(glob.glob(os.path.join(folder, f"*-{pid}.log"))) if folder and pid else []
    named = [m for m in (re.fullmatch(r"(.+)-(\d+)-\d+\.log", os.path.basename(f)) for f in files) if m]
    ranks = known_rank_pids() if pid and not named else {}
    if named:  # the log file on this machine (a shared log folder: any node's)
        who, trace = f"role {named[0].group(1)} rank {named[0].group(2)}", os.path.join(folder, named[0].group(0))
    elif pid and int(pid) in ranks:  # a rank of this driver whose log file is on its own node
        who = ranks[int(pid)]
        name, rank = re.fullmatch(r"role (.+) rank (\d+)", who).groups()
        trace = log_path(f"{name}-{rank}", pid)
        trace = f"{trace} on node {node}" if trace else None
    return (f"{who}: {type(cause).__name__}: {message} (raised in {where}"
            + (f"; trace: {trace}" if trace else "") + ")")


_CLUSTERS: "weakref.WeakSet" = weakref.WeakSet()  # this driver's clusters, to name a process by its pid


def known_rank_pids() -> Dict[int, str]:
    """{process id: "role <name> rank <r>"} over every cluster of this driver."""
    pids: Dict[int, str] = {}
    for cluster in list(_CLUSTERS):
        pids.update(cluster.rank_pids())
    return pids


class Cluster:
    """`world_size` Ray actors of `worker_cls`, one per rank of a role.

    Construction only starts the actors; `setup_async()` then builds every rank's engine at once
    (ranks of a torch.distributed group must initialise together), so several roles can load
    their models in parallel.
    """

    def __init__(self, name: str, worker_cls: type, world_size: int, num_cpus: float, num_gpus: float,
                 init_args: tuple = (), init_kwargs: Optional[Dict[str, Any]] = None,
                 env: Optional[Dict[str, str]] = None,
                 rank_options: Optional[List[Dict[str, Any]]] = None, max_restarts: int = 0):
        """`rank_options`: each rank's Ray actor options from a `GpuPlacement` (device_mapping),
        whose placement groups it owns; without them the role reserves its own group of
        `world_size` x {num_cpus, num_gpus} bundles. `max_restarts` > 0: Ray restarts a rank that dies (for stateless roles such as
        rewards) and retries its unfinished calls on the new process, up to that many times."""
        self.name = name
        self.world_size = world_size
        groups = getattr(worker_cls, "ray_concurrency_groups", None)  # calls run beside the default group's
        remote_cls = ray.remote(concurrency_groups=groups)(worker_cls) if groups else ray.remote(worker_cls)
        init_kwargs = init_kwargs or {}
        if rank_options is not None and len(rank_options) != world_size:
            raise ValueError(f"role {name}: {len(rank_options)} placements for world_size {world_size}")
        self.placement_group = None if rank_options is not None else _reserve(name, world_size, num_cpus, num_gpus)
        # `system_envs` and the allocator: set before the actor's process starts (Ray merges these
        # env_vars with a job's own runtime_env).
        env = {k: str(v) for k, v in (env or {}).items()}
        self.workers: List[Any] = []
        # What starts each rank's actor, kept: a replaced rank starts again from it (ReplaceableCluster).
        self._remote_cls, self._init_args, self._init_kwargs = remote_cls, init_args, init_kwargs
        self._ray_restarts = max_restarts
        self._rank_options: List[Dict[str, Any]] = []
        self._dist_envs: List[Dict[str, Any]] = []
        rendezvous = None  # rank 0's (address, port), as a future: the driver does not wait for it
        for rank in range(world_size):
            dist_env = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": 0,
                        "MASTER_ADDR": None, "MASTER_PORT": None, RENDEZVOUS_KEY: rendezvous,
                        "ROLL_GSPO_ROLE": f"{name}-{rank}", **_log_dir_env()}
            options = rank_options[rank] if rank_options is not None else dict(
                num_cpus=num_cpus, num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank))
            env_vars = {**env, **options.get("runtime_env", {}).get("env_vars", {})}  # a multi-GPU slot's devices win
            options = {**options, **({"runtime_env": {"env_vars": env_vars}} if env_vars else {})}
            self._rank_options.append(options)
            self._dist_envs.append(dist_env)
            worker = self._start_rank(rank)
            if rank == 0:
                # The rendezvous lives where rank 0 landed (another node on a real cluster). The other
                # ranks wait for it in their own __init__, so every role's processes start at once.
                rendezvous = worker.rendezvous_address.remote()
            self.workers.append(worker)
        self._rendezvous = rendezvous  # held: a restarted rank > 0 reads it again
        # Bounded waits (`bound_waits`): each call's method, rank and send time, and the probe ranks answer.
        self.deadlines: Optional[PhaseDeadline] = None
        self._sent: Dict[Any, Tuple[str, int, float]] = {}
        self._probe_method = next((m for m in ("alive", "health") if hasattr(worker_cls, m)), None)
        # Where each rank lives, asked now so that a rank's death can be reported with it.
        self._whereabouts = [w.whereabouts.remote() for w in self.workers]
        _CLUSTERS.add(self)

    def actor_name(self, rank: int) -> str:
        """Ray's name of `rank`'s actor: `<role>-<rank>-<driver pid>` (what `describe_dead_actor` reads)."""
        return f"{self.name}-{rank}-{os.getpid()}"

    def _start_rank(self, rank: int):
        """Start `rank`'s actor with the role's options (its placement bundle, environment)."""
        return self._remote_cls.options(name=self.actor_name(rank), **self._rank_options[rank],
                                        max_restarts=self._ray_restarts, max_task_retries=self._ray_restarts).remote(
            *self._init_args, dist_env=self._dist_envs[rank], **self._init_kwargs)

    def setup_async(self) -> List[ray.ObjectRef]:
        return self.execute_all_async("setup")

    def execute_all(self, method: str, *args, **kwargs) -> List[Any]:
        """Call `method` on every rank with the same arguments; return the per-rank results."""
        return self.gather(self.execute_all_async(method, *args, **kwargs))

    def bound_waits(self, deadlines: PhaseDeadline) -> None:
        """From now on `gather` probes the ranks it waits for and stops the run when one does not
        answer within `deadlines`' bound of the call (ranks with an `alive` or `health` method)."""
        self.deadlines = deadlines if self._probe_method else None

    def gather(self, refs: List[ray.ObjectRef]) -> List[Any]:
        """Results of per-rank calls, failing fast: when one rank raises, its peers may be blocked
        in a collective waiting for it, so they are stopped and the rank's error is raised. With
        `bound_waits`, a rank that stops answering is reported hung (`WorkerHungError`) at the bound."""
        import time

        sent = [self._sent.pop(ref, None) for ref in refs]
        calls = {call for call in sent if call is not None}
        bound = self.deadlines.bound(sent[0][0]) if self.deadlines and sent and None not in sent else None
        watches: Dict[int, Any] = {}
        probes: Dict[int, ray.ObjectRef] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=None if bound is None else probe_interval_s(bound[0]))
            if not ready:
                self._check_answers([sent[list(refs).index(ref)] for ref in pending], bound, watches, probes)
                continue
            try:
                ray.get(ready[0])
            except Exception as exc:
                index = list(refs).index(ready[0])
                self.fail(sent[index][1] if sent[index] else index, exc, sent[index][0] if sent[index] else None)
        if self.deadlines is not None and len({call[0] for call in calls}) == 1:
            first = min(call[2] for call in calls)
            self.deadlines.record(sent[0][0], time.monotonic() - first)
        return ray.get(list(refs))

    def _check_answers(self, waiting: List[Any], bound, watches: Dict[int, Any], probes: Dict[int, Any]) -> None:
        """Probe each rank of `waiting` ((method, rank, sent at) of the calls not answered yet); stop
        the run naming the ranks whose probe went unanswered for the bound."""
        import time

        seconds, how = bound
        now = time.monotonic()
        for method, rank, sent_at in waiting:
            watch = watches.setdefault(rank, HangWatch(seconds, started=sent_at))
            probe = probes.get(rank)
            if probe is not None and ray.wait([probe], timeout=0)[0]:
                watch.answered(now, 0, 0)
                probes.pop(rank)
            if rank not in probes:
                probes[rank] = getattr(self.workers[rank], self._probe_method).remote()
                watch.probe_sent(now)
        hung = [(rank, watch) for rank, watch in sorted(watches.items()) if watch.verdict(now)]
        if not hung:
            return
        method, started = waiting[0][0], min(call[2] for call in waiting)
        answering = [f"rank {rank}" for rank in range(self.world_size) if rank not in dict(hung)]  # or done
        rank, watch = hung[0]
        node, pid = self.where(rank)
        who = f"role {self.name} rank {rank} (node {node}, pid {pid})"
        others = [f"rank {other}" for other, _ in hung[1:]]
        message = hung_message(who + (f" (and {', '.join(others)})" if others else ""), method, now - started,
                               now - (watch.probe_at or now), how, answering)
        output = self.output_of(rank)
        self._kill_stopped([r for r, _ in hung])
        self.shutdown()
        raise WorkerHungError(f"{message}. " + (f"Its output: {output}. " if output else "")
                              + "The run stops; its last complete checkpoint is intact (resume with "
                              "resume_from_checkpoint=auto)")

    def _kill_stopped(self, ranks: List[int]) -> None:
        """kill -9 the hung ranks on this node (a stopped process may never serve Ray's kill request)."""
        import signal

        here = node_address()
        for rank in ranks:
            node, pid = self.where(rank)
            if node == here and pid != "unknown":
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass

    def fail(self, rank: int, exc: BaseException, call: Optional[str] = None):
        """Stop every rank and raise what `rank`'s failed call says: a WorkerDiedError in one line
        when a process died (this rank, or a worker it called), else the call's own exception."""
        if not (isinstance(exc, ray.exceptions.RayActorError) or is_memory_kill(exc)):
            self.shutdown()
            raise exc
        if is_memory_kill(exc):  # Ray's memory monitor: one line with the rank and its memory
            nested = isinstance(exc, ray.exceptions.RayTaskError)  # a worker this rank called
            message = describe_memory_kill(str(exc), known_rank_pids(), (
                f"a worker called by role {self.name} rank {rank}" if nested else f"role {self.name} rank {rank}"))
        elif isinstance(exc, ray.exceptions.RayTaskError):  # alive, but a worker it called died
            during = f" during {phase_of(call)}" if call else ""
            message = (f"role {self.name} rank {rank} failed{during} because a worker it called died: "
                       f"{describe_dead_actor(str(exc))}")
        else:
            message = self.death_message(rank, exc, call=call)
        self.shutdown()
        raise WorkerDiedError(message) from exc

    def rank_pids(self) -> Dict[int, str]:
        """{process id: "role <name> rank <r>"} of the ranks that answered where they live."""
        pids = {}
        for rank, ref in enumerate(getattr(self, "_whereabouts", [])):
            try:
                pids[int(ray.get(ref, timeout=5)[1])] = f"role {self.name} rank {rank}"
            except Exception:  # died before it could answer
                continue
        return pids

    def death_message(self, rank: int, exc: BaseException, note: str = "", call: Optional[str] = None) -> str:
        """`role <name> rank <r> (node, pid) died: <reason>. [note. ]Its output: <log file>. The run stops; ...`"""
        return (f"{self.death_line(rank, exc, call)}. " + (f"{note}. " if note else "")
                + (f"Its output: {self.output_of(rank)}. " if self.output_of(rank) else "")
                + "The run stops; its last complete checkpoint is intact (resume with resume_from_checkpoint=auto)")

    def where(self, rank: int):
        """(node, pid) of `rank`, ("unknown", "unknown") when it died before it could answer."""
        try:
            return tuple(ray.get(self._whereabouts[rank], timeout=5))
        except Exception:  # died before it could answer
            return "unknown", "unknown"

    def death_line(self, rank: int, exc: BaseException, call: Optional[str] = None) -> str:
        """`role <name> rank <r> (node <ip>, pid <pid>) died: <reason>` (`is unresponsive (not dead)`
        for a `RankUnresponsive` reason)."""
        node, pid = self.where(rank)
        reason = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else type(exc).__name__
        verb = "is unresponsive (not dead)" if isinstance(exc, RankUnresponsive) else "died"
        during = f", in phase {phase_of(call)}" if call else ""  # the call it was running, when known
        return f"role {self.name} rank {rank} (node {node}, pid {pid}) {verb}: {reason}{during}"

    def output_of(self, rank: int) -> Optional[str]:
        """The log file `rank`'s output went to (with its node when known)."""
        node, pid = self.where(rank)
        output = log_path(f"{self.name}-{rank}", pid if pid != "unknown" else "*")
        return f"{output} (on node {node})" if output and node != "unknown" else output

    def execute_all_async(self, method: str, *args, **kwargs) -> List[ray.ObjectRef]:
        return [self._sending(rank, method, getattr(w, method).remote(*args, **kwargs))
                for rank, w in enumerate(self.workers)]

    def _sending(self, rank: int, method: str, ref: ray.ObjectRef) -> ray.ObjectRef:
        """`ref`, remembered with its method, rank and send time for `gather`'s bounded wait."""
        import time

        if self.deadlines is not None:
            self._sent[ref] = (method, rank, time.monotonic())
        return ref

    def call_async(self, rank: int, method: str, *args, **kwargs) -> ray.ObjectRef:
        """`method(*args, **kwargs)` on one rank; its ref, for `gather`."""
        return self._sending(rank, method, getattr(self.workers[rank], method).remote(*args, **kwargs))

    def submit(self, rank: int, method: str, *args, **kwargs) -> "Future[Any]":
        """`method(*args, **kwargs)` on one rank, its result in a future awaited on its own (one
        agentic turn), not by `gather`; a failure is the future's exception."""
        return getattr(self.workers[rank], method).remote(*args, **kwargs).future()

    def dispatch(self, method: str, batch: Batch, skip_empty: bool = False, **kwargs) -> Any:
        """Split `batch` evenly over ranks, call `method(shard, **kwargs)` on each, concatenate
        returned Batches (or return the list of per-rank results otherwise). `skip_empty`: ranks
        whose shard would be empty are not called (independent ranks only, e.g. rollout)."""
        return self.collect(self.dispatch_async(method, batch, skip_empty=skip_empty, **kwargs))

    def dispatch_async(self, method: str, batch: Batch, skip_empty: bool = False, **kwargs) -> List[ray.ObjectRef]:
        """`dispatch` without waiting: the per-rank calls, for `collect`."""
        shards = batch.chunk(self.world_size)
        return [self._sending(rank, method, getattr(w, method).remote(s, **kwargs))
                for rank, (w, s) in enumerate(zip(self.workers, shards)) if len(s) or not skip_empty]

    def collect(self, refs: List[ray.ObjectRef]) -> Any:
        """Results of `dispatch_async`, as `dispatch` returns them."""
        results = self.gather(refs)
        return Batch.concat(results) if all(isinstance(r, Batch) for r in results) else results

    def shutdown(self) -> None:
        for rank, worker in enumerate(self.workers):
            ray.kill(worker)
            _STOPPED.append(self.actor_name(rank))
        self.workers = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


_STOPPED: List[str] = []  # names of the ranks this driver stopped, until `wait_until_stopped` saw them gone


def wait_until_stopped(timeout_s: float = 60.0) -> List[str]:
    """Wait until every rank this driver stopped is gone (its name free, so its process ended and its
    memory is back): a run started again in the same driver (an automatic resume) then does not
    hold two runs' processes at once. Returns the names still there at the deadline."""
    import time

    deadline = time.monotonic() + timeout_s
    while _STOPPED and time.monotonic() < deadline:
        for name in list(_STOPPED):
            try:
                ray.get_actor(name)
            except ValueError:
                _STOPPED.remove(name)
        if _STOPPED:
            time.sleep(0.1)
    return list(_STOPPED)


RENDEZVOUS_KEY = "_RENDEZVOUS"  # in a rank's dist_env: the future of rank 0's (address, port)


def _traced(method):
    """`method` of a rank, writing the trace of an exception it raises to the rank's log file
    before Ray hands the exception to the caller (the driver's console gets one line naming the
    file: `describe_worker_error`); each exception once, also through `super()` calls."""
    import functools
    import traceback

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if not getattr(exc, "_roll_gspo_traced", False):
                trace_to_log_file(f"{type(self).__name__}.{method.__name__} (role {os.environ.get('ROLL_GSPO_ROLE')}) "
                                  f"raised:\n{traceback.format_exc().rstrip()}")
                try:
                    exc._roll_gspo_traced = True
                except Exception:  # an exception type without attributes
                    pass
            raise

    return call


def _trace_public_methods(cls) -> None:
    import inspect

    for name, value in list(vars(cls).items()):
        if (not name.startswith("_") and inspect.isfunction(value) and not inspect.iscoroutinefunction(value)
                and not inspect.isgeneratorfunction(value)):
            setattr(cls, name, _traced(value))


class HealthProbed:
    """A rank that answers `alive` on a thread of its own beside a running call: `Cluster.gather`
    tells a stopped or hung rank (no answer) from one working or waiting in a collective (answers)."""

    ray_concurrency_groups = {"health": 1}

    @ray.method(concurrency_group="health")
    def alive(self) -> int:
        return os.getpid()


class RankWorker:
    """Base of every role's worker: rank identity and torch.distributed rendezvous.

    `__init__` stays light (ranks > 0 wait on rank 0's to learn its address); subclasses build
    their engines in `setup()`.
    """

    def __init__(self, dist_env: Dict[str, Any]):
        for key, value in DEFAULT_WORKER_ENV.items():
            os.environ.setdefault(key, value)
        self.rank = int(dist_env["RANK"])
        self.world_size = int(dist_env["WORLD_SIZE"])
        dist_env = dict(dist_env)
        rendezvous = dist_env.pop(RENDEZVOUS_KEY, None)
        if rendezvous is not None:  # ranks > 0: rank 0's address, once its __init__ has run
            dist_env["MASTER_ADDR"], dist_env["MASTER_PORT"] = ray.get(rendezvous)
        elif dist_env["MASTER_ADDR"] is None:  # rank 0 picks the rendezvous
            dist_env = {**dist_env, "MASTER_ADDR": node_address(), "MASTER_PORT": free_port()}
        self._master = (dist_env["MASTER_ADDR"], int(dist_env["MASTER_PORT"]))
        os.environ.update({k: str(v) for k, v in dist_env.items()})
        # The rank's own output (vLLM, DeepSpeed, torch, progress bars) to its log file; Ray then
        # forwards only roll_gspo's records to the driver's console.
        capture_output()
        setup_logging()
        keep_logs_in_file()
        configure_vllm_logging()  # before any vLLM import in this process
        lighter_imports()  # mlflow, sklearn, scipy left out: ~3 + ~1.3 s of CPU less in each rank's start-up

    def rendezvous_address(self):
        return self._master

    def whereabouts(self):
        """(node IP, process id) of this rank, for error messages."""
        return node_address(), os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def setup(self) -> None:
        pass

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _trace_public_methods(cls)  # every role's methods write their failures' traces to the rank's log file


_trace_public_methods(RankWorker)
