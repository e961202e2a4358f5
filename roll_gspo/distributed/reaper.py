"""A watchdog for a private Ray: once the driver that started it is gone, however it ended
(exception, signal, kill -9), every process of that Ray is killed.

Ray's own clean-up runs only on a normal exit, and after a kill -9 of the driver some of its
processes (dashboard and runtime-env agents) stay alive. Every process of the private Ray
inherits a marker variable from the driver; the watchdog, started before Ray in a session of its
own and without the marker, notes the driver's descendants every 2 s while it lives, waits
for its exit, then kills what it noted (and their children) and each process carrying the
marker.

Run as a script (`python reaper.py DRIVER_PID TOKEN`): it imports nothing from roll_gspo.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

MARKER = "ROLL_GSPO_PRIVATE_RAY"


def start_reaper() -> str:
    """Mark this process's environment (inherited by the Ray it starts next) and start the
    watchdog. Returns the token."""
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), token], env=env,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True)
    os.environ[MARKER] = token
    return token


def _process_table():
    """{pid: (parent pid, start time)} of every process visible in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(roots, table):
    """{(pid, start time)} of the processes below `roots` (pids) in `table`."""
    children = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, stack = set(), list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child != os.getpid() and (child, table[child][1]) not in found:
                found.add((child, table[child][1]))
                stack.append(child)
    return found


def marked_processes(token: str):
    """Ids of the processes whose environment holds MARKER=token (a process that rewrote its
    title may have overwritten its environment: `descendants` finds those)."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def watch(driver: int, poll_s: float = 2.0):
    """Wait for `driver` to exit; returns {(pid, start time)} of every process seen below it."""
    seen = set()
    try:
        fd = os.pidfd_open(driver)
    except (AttributeError, OSError):  # no pidfd (old kernel): poll
        fd = None
    while True:
        seen |= descendants([driver], _process_table())
        if fd is not None:
            if select.select([fd], [], [], poll_s)[0]:
                os.close(fd)
                return seen
        elif not _alive(driver):
            return seen
        else:
            time.sleep(poll_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(token: str, seen, rounds: int = 3) -> int:
    """SIGKILL every process seen below the driver (still the same process: same start time),
    everything below those, and every marked process; a few rounds apart."""
    killed = 0
    for _ in range(rounds):
        table = _process_table()
        alive = {(pid, start) for pid, start in seen if table.get(pid, (0, None))[1] == start}
        targets = {pid for pid, _ in alive | descendants([pid for pid, _ in alive], table)}
        for pid in targets | set(marked_processes(token)):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.5)
    return killed


def main(argv) -> int:
    driver, token = int(argv[1]), argv[2]
    seen = watch(driver)
    time.sleep(1.0)  # a normal exit's ray.shutdown() has usually finished by now
    reap(token, seen)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
