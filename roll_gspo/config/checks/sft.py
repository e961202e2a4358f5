"""The supervised pipeline (`pipeline: sft`): the data it trains on."""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, error
from roll_gspo.schema.config import PipelineConfig


@check("check", keys=("actor_train.data_args.file_name",), doc="sft: no SFT data", name="sft.data")
def _sft_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    if cfg.has_rollout() or cfg.actor_train.data_args.file_name:
        return []
    return [error("actor_train.data_args.file_name", "actor_train.data_args.file_name: no SFT data given")]
