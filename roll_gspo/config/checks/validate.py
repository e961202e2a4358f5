"""`validate_config`, the runner: every registered config step (`registry`), phase by phase. The
steps live in the modules of this folder, one per concern; what the config names outside itself is
`preflight`'s.
"""
from __future__ import annotations

import logging
from typing import AbstractSet, List, Optional

from roll_gspo.config.findings import Finding
from roll_gspo.config.checks.registry import run_steps
from roll_gspo.schema.config import PipelineConfig

logger = logging.getLogger("roll_gspo.config")


def validate_config(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[str]:
    """Run every registered step (normalise, derive, check, settle, warn: `registry`): fill derived
    defaults, raise ConfigError listing every problem, log and return the warnings and notices.

    `yaml_keys`: dotted paths the YAML writes (the loader passes them); a key never read by its
    role is refused only when written there. None: every key that differs from its default counts.
    """
    warns = [finding.text for finding in check_config(cfg, yaml_keys)]
    for message in warns:
        logger.warning(message)
    return warns


def check_config(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """`validate_config`'s findings, not logged: ConfigError (its `findings`) on any error, else
    the warnings and notices."""
    return run_steps(cfg, yaml_keys)
