"""The one error a configuration problem raises: every problem found, one per line."""
from __future__ import annotations

from typing import Sequence


class ConfigError(ValueError):
    """A configuration problem; the message lists every problem found, one per line."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))
