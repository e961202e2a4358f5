"""SIGTERM / SIGINT handling for a pipeline's step loop.

The first signal asks the loop to stop after the step it is in (which then saves a checkpoint
and exits 0); a second one stops at once (KeyboardInterrupt). `ray job stop` sends SIGTERM.
"""
from __future__ import annotations

import logging
import shlex
import signal
import sys
import threading
from typing import Optional

logger = logging.getLogger("roll_gspo")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    def __init__(self):
        self.requested: Optional[str] = None  # the first signal's name
        self._previous = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            self._restore()
            raise KeyboardInterrupt(f"second stop signal ({name}): stopping at once")
        self.requested = name
        logger.warning("%s received: finishing the current step, saving a checkpoint, then stopping "
                       "(send it again to stop at once)", name)


def resume_command() -> str:
    """This process's command line with `resume_from_checkpoint=auto` in place of any other value."""
    args = [a for a in sys.argv[1:] if not a.lstrip("+~").startswith("resume_from_checkpoint=")]
    return " ".join(shlex.quote(a) for a in ["python", sys.argv[0], *args, "resume_from_checkpoint=auto"])
