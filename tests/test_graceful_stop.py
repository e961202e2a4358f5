"""SIGTERM / SIGINT in the driver: the first asks the step loop to stop, the second stops at once."""
import os
import signal
import sys

import pytest

from roll_gspo.lifecycle.graceful_stop import GracefulStop, resume_command

pytestmark = pytest.mark.chaos


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_requests_a_stop_second_stops_at_once(sig):
    before = signal.getsignal(sig)
    with GracefulStop() as stop:
        os.kill(os.getpid(), sig)
        assert stop.requested == sig.name  # the handler ran; the loop goes on to the step's end
        with pytest.raises(KeyboardInterrupt, match="second stop signal"):
            os.kill(os.getpid(), sig)
    assert signal.getsignal(sig) is before


def test_resume_command_replaces_any_resume_value(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["run_pipeline.py", "--config", "my run.yaml", "max_steps=9",
                                      "resume_from_checkpoint=/x/step_2"])
    assert resume_command() == ("python run_pipeline.py --config 'my run.yaml' max_steps=9 "
                                "resume_from_checkpoint=auto")
