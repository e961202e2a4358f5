"""Which malloc the model roles' Ray workers run with (`memory_allocator`).

On CPU, PyTorch allocates and frees every activation and gradient of every pass through the C
library's malloc. glibc hands large blocks back to the kernel when they are freed and takes them
again on the next pass, so each step pays hundreds of thousands of page faults (measured: ~97k
faults/s in a training rank, 19M model). Ray's wheel bundles jemalloc (it runs Ray's own
processes); preloaded into the workers with freed pages kept (`dirty_decay_ms:-1`), the pages
are reused instead: the training phase takes ~18 % less time there (benchmarks/bench_train_phase.py,
docs/training_speed.md). The cost: a worker's resident memory stays at its peak between phases,
which is what its peak already reserved.

The choice must be in the environment when the worker's process starts (LD_PRELOAD), so it goes
into the actor's Ray `runtime_env`, not into `os.environ` of a running worker.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, Optional

from roll_gspo.utils.allocator_choice import auto_uses_jemalloc

logger = logging.getLogger("roll_gspo.allocator")

# Freed pages stay with the process (no purge, no page fault when they are used again).
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
CHOICES = ("auto", "jemalloc", "system")
_said = set()  # each role asks; say each thing once


def _say_once(level: int, message: str, *args) -> None:
    if (message, args) not in _said:
        _said.add((message, args))
        logger.log(level, message, *args)


def bundled_jemalloc() -> Optional[str]:
    """Ray's bundled libjemalloc.so (Linux wheels), or None."""
    try:
        import ray
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(ray.__file__), "core", "libjemalloc.so")
    return path if os.path.isfile(path) else None


def allocator_env(choice: str, on_gpu: bool, library: Optional[str] = None,
                  inherited_preload: Optional[str] = None, parameters: Optional[int] = None) -> Dict[str, str]:
    """Environment variables that give a model role's worker its allocator.

    `choice`: `auto` (auto_uses_jemalloc), `jemalloc` or `system`. `library`: the jemalloc to
    preload (default: Ray's). `inherited_preload`: the driver's own LD_PRELOAD (default:
    os.environ's); a user who preloads an allocator themselves keeps it. `parameters`: the
    policy's size, for `auto`."""
    if choice not in CHOICES:
        raise ValueError(f"memory_allocator={choice!r}: one of {', '.join(CHOICES)}")
    wanted = choice == "jemalloc" or (choice == "auto" and auto_uses_jemalloc(on_gpu, parameters))
    if choice == "auto" and not on_gpu and not wanted:
        _say_once(logging.INFO, "memory_allocator=auto: the system malloc for a policy of %.0fM parameters (jemalloc "
                  "without decay grew without bound at 0.5B)", parameters / 1e6)
    if not wanted:
        return {}
    inherited = os.environ.get("LD_PRELOAD") if inherited_preload is None else inherited_preload
    if inherited:
        _say_once(logging.INFO, "memory_allocator=%s: LD_PRELOAD=%s is already set; the workers keep it", choice, inherited)
        return {}
    library = library or bundled_jemalloc()
    if library is None:
        _say_once(logging.WARNING, "memory_allocator=%s: this Ray has no bundled libjemalloc.so; the workers use the system "
                       "malloc (set memory_allocator: system to silence this)", choice)
        return {}
    return {"LD_PRELOAD": library, "MALLOC_CONF": JEMALLOC_CONF}
