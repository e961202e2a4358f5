"""Reward functions of the warm-start test (tests/test_rft_warm_start.py)."""


def has_digit(prompt: str, response: str, ground_truth: str) -> float:
    """1 for a reply holding a digit: a rule the random-init micro model passes a fair share of the time."""
    return float(any(c.isdigit() for c in response))
