"""The `strategy_config` of `fsdp2_train` / `fsdp2_infer` (ROLL's FSDP2 keys): checked against
`schema.FSDP2StrategyConfig` like every block of the config (unknown keys with a "did you mean",
types, choices, values refused with their reason), then read by the strategy through
`roll_gspo.config.plan.fsdp2.parse_fsdp2_config`.

A DeepSpeed config is an open mapping handed to DeepSpeed; an FSDP2 one is this project's own
reading of ROLL's keys, so every key is declared, and one that cannot act is refused or, where ROLL
ignores it too (dtype keys of a frozen engine), accepted with a notice.
"""
from __future__ import annotations

from typing import List

from roll_gspo.config.findings import Finding, error, notice
from roll_gspo.config.plan.fsdp2 import fsdp2_config_problems, parse_fsdp2_config
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import FSDP2_DTYPES, PipelineConfig

FSDP2_STRATEGIES = ("fsdp2_train", "fsdp2_infer")
# Keys a frozen engine has no use for (it reduces no gradients); ROLL ignores them there too.
TRAINING_ONLY_KEYS = ("reduce_dtype", "enable_mix_precision", "reduce_scatter_during_grad_accumulation")


def _fsdp2_roles(cfg: PipelineConfig):
    """(name, role) of each role that runs an FSDP2 engine in this config."""
    names = ["actor_train"] + (["reference"] if cfg.has_rollout() and cfg.needs_reference() else [])
    names += ["critic"] if cfg.uses_critic() else []
    return [(n, getattr(cfg, n)) for n in names if getattr(cfg, n).strategy_args.strategy_name in FSDP2_STRATEGIES]


@check("check", keys=("<role>.strategy_args.strategy_config",),
       doc="an FSDP2 `strategy_config` with unknown keys, wrong types or refused values, a `param_dtype` "
           "contradicting the role's dtype, an `fsdp_size` that does not divide world_size", name="fsdp2.config")
def fsdp2_problems(cfg: PipelineConfig, yaml_keys=None) -> List[Finding]:
    """Every FSDP2 role's strategy_config checked, and checked against the role's dtype and ranks."""
    problems: List[Finding] = []
    for name, role in _fsdp2_roles(cfg):
        path = f"{name}.strategy_args.strategy_config"
        own = fsdp2_config_problems(path, role.strategy_args.strategy_config)
        problems += own
        if own:
            continue
        options = parse_fsdp2_config(role.strategy_args.strategy_config, path)
        if options.param_dtype is not None and FSDP2_DTYPES[options.param_dtype] != role.model_args.dtype:
            problems.append(error(f"{path}.param_dtype", f"{path}.param_dtype = {options.param_dtype!r} contradicts "
                                                         f"{name}.model_args.dtype = {role.model_args.dtype!r}; the "
                                                         f"compute dtype is model_args.dtype (drop param_dtype or make "
                                                         f"them agree)"))
        world, size = role.world_size, options.fsdp_size
        if 1 < size < world and world % size:
            problems.append(error(f"{path}.fsdp_size", f"{path}.fsdp_size = {size}: HSDP needs {name}.world_size "
                                                       f"({world}) to be a multiple of it (world_size / fsdp_size "
                                                       f"replicas of fsdp_size shards); use a divisor of {world}, or 1 "
                                                       f"to shard over all ranks"))
    return problems


@check("warn", keys=tuple(f"<role>.strategy_args.strategy_config.{key}" for key in TRAINING_ONLY_KEYS),
       doc="training-only FSDP2 keys on a frozen role: accepted, one notice", name="fsdp2.frozen_keys")
def fsdp2_notices(cfg: PipelineConfig, yaml_keys=None) -> List[Finding]:
    """One notice per training-only key written in a frozen FSDP2 role's strategy_config."""
    notices = []
    for name, role in _fsdp2_roles(cfg):
        if name in ("actor_train", "critic"):  # trainers: every key acts
            continue
        config = role.strategy_args.strategy_config
        for key in TRAINING_ONLY_KEYS:
            if key in config:
                path = f"{name}.strategy_args.strategy_config.{key}"
                notices.append(notice(path, f"{path} = {config[key]!r} is ignored by a frozen engine (the {name} "
                                            f"reduces no gradients), as in ROLL", "nothing acts instead"))
    return notices
