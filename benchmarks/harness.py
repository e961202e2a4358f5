"""What the benchmark scripts share: robust medians and "-" for missing figures, a clock that times
wrapped methods, random Qwen2 model folders, the overrides and local Ray of a measured pipeline
run, and child processes driven one JSON line at a time (environment, free port, reply pipe).

Scripts put the repository root on ``sys.path`` themselves before ``from benchmarks.harness import
...`` (that is what makes this module importable when they run as ``python benchmarks/<script>.py``).
Keep it out of code that runs inside Ray actors: they need not have the repository on their path
(the package install covers roll_gspo and pipelines only).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import select
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------
def finite(values: Iterable[Optional[float]]) -> List[float]:
    """The values that are finite numbers, as floats (None, NaN and inf dropped)."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    """Median of the finite values, None when there are none."""
    values = finite(values)
    return statistics.median(values) if values else None


def mean_finite(values: Iterable[Optional[float]]) -> float:
    """Mean of the finite values, NaN when there are none (a table cell then reads n/a)."""
    values = finite(values)
    return sum(values) / len(values) if values else float("nan")


def stdev_finite(values: Iterable[Optional[float]]) -> float:
    """Sample standard deviation of the finite values, 0.0 with fewer than two."""
    values = finite(values)
    return statistics.stdev(values) if len(values) > 1 else 0.0


def validation_tasks(records: Iterable[Mapping[str, Any]]) -> List[str]:
    """The tasks (reward domains) a run validated on: every `val/<task>/accuracy` key, sorted."""
    return sorted({k.split("/")[1] for r in records for k in r
                   if k.startswith("val/") and k.endswith("/accuracy") and k.count("/") == 2})


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux ru_maxrss is in KB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def fmt(value: Optional[float], spec: str = ".3f") -> str:
    """`value` formatted with `spec`, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


class PhaseClock:
    """Seconds spent in wrapped methods, per phase, since the last `take()`."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    def wrap(self, obj, method: str, phase: Union[str, Callable[[], Optional[str]]], on_result=None) -> None:
        """Time every call of `obj.method` as `phase` (a callable: named per call; None: not counted)."""
        original = getattr(obj, method)
        clock = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            name = phase() if callable(phase) else phase
            if name:
                clock.seconds[name] = clock.seconds.get(name, 0.0) + time.perf_counter() - start
            if on_result is not None:
                on_result(result)
            return result

        setattr(obj, method, timed)

    def take(self) -> Dict[str, float]:
        """The seconds per phase so far; the clock starts again from zero."""
        seconds, self.seconds = self.seconds, {}
        return seconds


def print_report(table: str, report: Dict[str, Any], json_path: Optional[str]) -> None:
    """Print the table after a blank line and, with a `--json` path, write the report there too."""
    print()
    print(table)
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(report, handle, indent=2, default=str)
        print(f"\n[bench] JSON: {json_path}")


# ------------------------------------------------------------------------------------------------
# Models and pipeline runs
# ------------------------------------------------------------------------------------------------
def random_qwen2_model(folder: str, shape: Dict[str, int], what: str) -> str:
    """A random-init fp32 Qwen2 of `shape` with the built-in char tokenizer, built into `folder` once."""
    from roll_gspo.builtin.cache import build_atomically

    def build(tmp: str) -> None:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from roll_gspo.builtin.models import _save_random_model
        from roll_gspo.builtin.tokenizer import build_tokenizer

        # The config of roll_gspo's own built-in models, with another shape.
        tokenizer = build_tokenizer()
        config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=256, tie_word_embeddings=True,
                             bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, use_cache=True, **shape)
        _save_random_model(tmp, Qwen2ForCausalLM, config, tokenizer, seed=0)

    return build_atomically(folder, build, what=what)


def build_overrides(model: str, output_dir: str, total_steps: int, extra: Sequence[str] = ()) -> List[str]:
    """Hydra overrides for a measured pipeline run (extra ones last, so they win)."""
    # No evaluation or checkpoints: they are not part of a step's cost.
    return [f"pretrain={model}", "eval_steps=0", "save_steps=0", f"output_dir={output_dir}",
            f"max_steps={total_steps}", *extra]


def run_rlvr_in_process(config: str, overrides: Sequence[str], output_dir: str) -> List[Dict[str, Any]]:
    """Run an RLVR pipeline in this process (its Ray: the caller's, when one is started) with
    `overrides` and output_dir; its metrics.jsonl records, one per step."""
    from roll_gspo.config import load_config

    from pipelines.rlvr_pipeline import run_rlvr

    run_rlvr(load_config(config, [*overrides, f"output_dir={output_dir}"]))
    with open(os.path.join(output_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def required_cpus(cfg) -> float:
    """CPUs the pipeline's actors ask Ray for (reference and reward roles included)."""
    roles = [cfg.actor_train, cfg.actor_infer] + ([cfg.reference] if cfg.needs_reference() else [])
    required = sum(r.world_size * r.num_cpus_per_worker for r in roles)
    return required + sum(r.world_size * r.num_cpus_per_worker for r in cfg.rewards.values())


def init_local_ray(required: float, log_to_driver: bool = False):
    """Start a private local Ray with every core, or as many logical CPUs as the actors ask for."""
    import ray

    # Never join another process's Ray: address="local" also ignores RAY_ADDRESS and a `ray start`
    # head on this machine (the pipeline's own init_ray then reuses this one).
    return ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(required)),
                    include_dashboard=False, log_to_driver=log_to_driver)


# ------------------------------------------------------------------------------------------------
# Child processes: the script again with hidden flags, a JSON spec file, commands on stdin and one
# JSON reply per line on a pipe (stdout and stderr go to a log, so replies never mix with output).
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for torch.distributed's MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> Dict[str, str]:
    """torch.distributed's env:// settings for one rank of a group on this machine."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def child_env(omp_threads: Optional[Union[int, str]] = None, defaults: Optional[Mapping[str, str]] = None,
              **settings: str) -> Dict[str, str]:
    """os.environ plus `defaults` where unset and `settings`, OMP_NUM_THREADS (None: unset), the repo on PYTHONPATH."""
    env = dict(os.environ)
    for key, value in (defaults or {}).items():
        env.setdefault(key, value)
    env.update(settings)
    if omp_threads is None:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return env


def read_json(path: str) -> Any:
    """The JSON document in `path` (a child's spec)."""
    with open(path) as handle:
        return json.load(handle)


def serve(reply_fd: int, ready: Dict[str, Any], handle: Callable[[Dict[str, Any]], Dict[str, Any]]) -> None:
    """Child side: send `ready`, then reply `handle(command)` to each JSON command line until {"exit": true}."""
    replies = os.fdopen(reply_fd, "w", buffering=1)
    replies.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            break
        replies.write(json.dumps(handle(command)) + "\n")


def add_child_flags(parser) -> None:
    """The hidden flags a benchmark passes to itself when it runs as a `ChildProcess`: the spec
    file and the descriptor its replies go to."""
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_reply_fd", type=int, help=argparse.SUPPRESS)


def served_as_child(args, child_main: Callable[[str, int], None]) -> bool:
    """Run `child_main(spec, reply_fd)` when this process was started as a child; True if it was."""
    if not args._child:
        return False
    child_main(args._child, args._reply_fd)
    return True


class ChildProcess:
    """Driver side: `script flags... --_reply_fd N` with `spec` written to `spec_path` first."""

    def __init__(self, what: str, script: str, flags: Sequence[str], spec: Dict[str, Any], spec_path: str,
                 log_path: str, env: Dict[str, str], cwd: Optional[str] = None, niceness: int = 0,
                 timeout: Optional[float] = None):
        self.what, self.log_path, self.timeout = what, log_path, timeout
        with open(spec_path, "w") as handle:
            json.dump(spec, handle)
        read_fd, write_fd = os.pipe()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, script, *flags, "--_reply_fd", str(write_fd)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True, pass_fds=(write_fd,),
            env=env, cwd=cwd, preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)

    def send(self, command: Union[str, Dict[str, Any]]) -> None:
        """Write one line to the child's stdin: a string as it is, a dict as JSON."""
        self.proc.stdin.write((command if isinstance(command, str) else json.dumps(command)) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> Dict[str, Any]:
        """The child's next reply; raises with the log's tail when it exits or misses the timeout."""
        if self.timeout is not None:
            # One reply per command, so nothing is ever left in the file object's buffer unseen by select.
            ready, _, _ = select.select([self.replies], [], [], self.timeout)
            if not ready:
                self.proc.kill()
                self._fail(f"no reply within {self.timeout:.0f} s")
        line = self.replies.readline()
        if not line:
            try:
                code = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
            self._fail(f"exited (code {code})")
        return json.loads(line)

    def request(self, command: Union[str, Dict[str, Any]]) -> Dict[str, Any]:
        """`send` then `receive`."""
        self.send(command)
        return self.receive()

    def _fail(self, why: str) -> None:
        """Raise with the end of the child's log."""
        with open(self.log_path) as handle:
            tail = handle.read()[-4000:]
        raise RuntimeError(f"{self.what} {why}; log {self.log_path}:\n{tail}")

    def close(self, last: Union[str, Dict[str, Any]] = '{"exit": true}', wait_s: float = 60) -> None:
        """Ask the child to stop with `last`, kill it after `wait_s` seconds, close its log."""
        if self.proc.poll() is None:
            try:
                self.send(last)
                self.proc.wait(timeout=wait_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()
