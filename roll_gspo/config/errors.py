"""The one error a configuration problem raises: every problem found, one per line."""
from __future__ import annotations

from typing import List, Sequence, Union

from roll_gspo.config.findings import Finding


class ConfigError(ValueError):
    """A configuration problem; the message lists every problem found, one per line.

    `problems` are the lines as the user reads them; `findings` the same problems as
    `findings.Finding`s where a check gave them (a plain line has `key` "" there); `notices` what the
    load noted before it failed (the CPU adaptation's notices, say)."""

    def __init__(self, problems: Sequence[Union[str, Finding]], notices: Sequence[Finding] = ()):
        self.findings: List[Finding] = [p if isinstance(p, Finding) else Finding("", "error", str(p)) for p in problems]
        self.notices: List[Finding] = list(notices)
        self.problems = [f.text for f in self.findings]
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))
