"""The FSDP2 options a role runs with: its `strategy_config` (ROLL's FSDP2 keys) walked over
`schema.FSDP2StrategyConfig` like every block of the config, read by the strategy through
`parse_fsdp2_config`. Their checks are `roll_gspo.config.checks.fsdp2`'s."""
from __future__ import annotations

from typing import Any, Dict, List

from roll_gspo.config.errors import ConfigError
from roll_gspo.config.findings import Finding
from roll_gspo.config.roll import roll_compat
from roll_gspo.config.typed_walk import build, walk
from roll_gspo.schema.config import FSDP2StrategyConfig


def fsdp2_config_problems(path: str, strategy_config: Dict[str, Any]) -> List[Finding]:
    """Problems of one FSDP2 strategy_config written at `path` (dotted, for the messages)."""
    problems: List[Finding] = []
    checked = walk(strategy_config, FSDP2StrategyConfig, path, problems)
    if not problems:
        roll_compat.refused_value_problems(FSDP2StrategyConfig, checked, strategy_config, problems, path=path)
    return problems


def parse_fsdp2_config(strategy_config: Dict[str, Any], path: str = "strategy_config") -> FSDP2StrategyConfig:
    """The typed FSDP2 options (defaults for keys left out); ConfigError when they do not check."""
    problems = fsdp2_config_problems(path, strategy_config)
    if problems:
        raise ConfigError(problems)
    return build(FSDP2StrategyConfig, walk(strategy_config, FSDP2StrategyConfig, path, []))
