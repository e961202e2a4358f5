"""What a config check reports: one `Finding` (key path, level, message, remedy). The bottom of
`roll_gspo.config`: it imports nothing of the project (the checks' registry is `registry`)."""
from __future__ import annotations

from dataclasses import dataclass

LEVELS = ("error", "warning", "notice")


@dataclass(frozen=True)
class Finding:
    """One thing a check found: the key path it is about (`actor_train.training_args.learning_rate`;
    `""` when it names no key of the config), how serious it is, what is wrong and, where it is said
    apart, what to do; `source` names what found it (a registry step's name, `cpu_run`, ...)."""
    key: str
    level: str
    message: str
    remedy: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"Finding.level must be one of {LEVELS}, got {self.level!r}")

    @property
    def body(self) -> str:
        """What is wrong, and the remedy where it is said apart."""
        return f"{self.message}; {self.remedy}" if self.remedy else self.message

    @property
    def text(self) -> str:
        """The line the user reads (a notice's starts with `notice: `)."""
        return f"notice: {self.body}" if self.level == "notice" else self.body


def error(key: str, message: str, remedy: str = "", source: str = "") -> Finding:
    return Finding(key, "error", message, remedy, source)


def warning(key: str, message: str, remedy: str = "", source: str = "") -> Finding:
    return Finding(key, "warning", message, remedy, source)


def notice(key: str, message: str, remedy: str = "", source: str = "") -> Finding:
    """A notice; `message` without the `notice: ` its text starts with."""
    return Finding(key, "notice", message, remedy, source)
