"""Reward functions the end-to-end tests name by import path (`tests.reward_fns:...`)."""


def digit_fraction(prompt: str, response: str, ground_truth: str) -> float:
    """Dense signal even for a random model: the fraction of digit characters in the response."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def slow_digit_fraction(prompt: str, response: str, ground_truth: str, seconds: float = 0.05) -> float:
    """digit_fraction after a pause: makes a step last long enough that a signal sent after one
    step is logged lands in the next step even on an idle machine (tiny steps take ~0.1 s)."""
    import time

    time.sleep(seconds)
    return digit_fraction(prompt, response, ground_truth)


def flaky(prompt: str, response: str, ground_truth: str) -> float:
    """Raises on responses that start with a digit (a broken user reward); scores the rest."""
    if response[:1].isdigit():
        raise ValueError("flaky reward failed on purpose")
    return digit_fraction(prompt, response, ground_truth)


def half_solved(prompt: str, response: str, ground_truth: str) -> float:
    """Prompts whose ground truth starts with "s" are always solved (every response scores 1: a
    zero-variance group); the others score a hash of the response, so their groups vary."""
    import zlib

    if ground_truth.startswith("s"):
        return 1.0
    return zlib.crc32(response.encode()) % 997 / 997


def dies_once(prompt: str, response: str, ground_truth: str, marker: str, seconds: float = 0.0) -> float:
    """Kills the reward worker (the Ray actor) the first time it is called in a run: `marker` is
    a file that records that it did. Rule rewards run in a child process of the worker
    (roll_gspo.rewards.scoring), so the worker is this process's parent when it is a Ray actor.
    `seconds`: a pause per response afterwards, as slow_digit_fraction's."""
    import os
    import signal
    import time

    import psutil

    if not os.path.exists(marker):
        parent = psutil.Process().parent()
        worker = parent.pid if parent is not None and "ray::" in " ".join(parent.cmdline()) else os.getpid()
        with open(marker, "w") as handle:
            handle.write(str(worker))
        os.kill(worker, signal.SIGKILL)
    time.sleep(seconds)
    return digit_fraction(prompt, response, ground_truth)


def hangs_once(prompt: str, response: str, ground_truth: str, marker: str) -> float:
    """Hangs the reward worker (run in its process: `timeout_s: 0`) the first time it is called in a
    run, recording that it did in the file `marker`; scores digit_fraction afterwards."""
    import os
    import time

    if not os.path.exists(marker):
        with open(marker, "w") as handle:
            handle.write(str(os.getpid()))
        time.sleep(3600)
    return digit_fraction(prompt, response, ground_truth)
