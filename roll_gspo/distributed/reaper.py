"""A watchdog for a private Ray: once the driver that started it is gone, however it ended
(exception, signal, kill -9), every process of that Ray is killed.

Ray's own clean-up runs only on a normal exit, and after a kill -9 of the driver some of its
processes (dashboard and runtime-env agents) stay alive. Every process of the private Ray
inherits a marker variable from the driver; the watchdog, started before Ray in a session of its
own and without the marker, waits for the driver's exit and kills each process carrying it.

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


def marked_processes(token: str):
    """Ids of the processes whose environment holds MARKER=token."""
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


def wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel): poll
        while _alive(pid):
            time.sleep(0.5)
        return
    select.select([fd], [], [])
    os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(token: str, rounds: int = 3) -> int:
    """SIGKILL every marked process, a few rounds apart (a dying raylet may still start one)."""
    killed = 0
    for _ in range(rounds):
        for pid in marked_processes(token):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.5)
    return killed


def main(argv) -> int:
    driver, token = int(argv[1]), argv[2]
    wait_for_exit(driver)
    time.sleep(1.0)  # a normal exit's ray.shutdown() has usually finished by now
    reap(token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
