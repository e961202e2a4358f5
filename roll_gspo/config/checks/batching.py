"""Dynamic batching (token-budget micro-batches): only on roles whose passes it splits, with a budget that
holds one whole sequence."""
from __future__ import annotations

from typing import AbstractSet, List, Optional

from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, error
from roll_gspo.schema.config import PipelineConfig, RoleConfig


@check("check", keys=("<role>.use_dynamic_batching_in_train", "<role>.max_tokens_per_microbatch_in_train",
                      "<role>.sequence_length_round_in_train"),
       doc="dynamic batching on a role whose passes it does not split, or with a token budget below one "
           "whole sequence", name="batching.dynamic")
def _dynamic_batching_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """Token-budget micro-batches: a budget that holds one whole sequence, and the keys only on
    roles whose passes they split (actor_train: train and infer; reference: infer)."""
    problems = []
    longest = cfg.max_sequence_tokens()
    readers = {"actor_train": ("train", "infer"), "reference": ("infer",), "actor_infer": ()}
    for name, phases in readers.items():
        role: RoleConfig = getattr(cfg, name)
        for phase in ("train", "infer"):
            on, budget = getattr(role, f"use_dynamic_batching_in_{phase}"), getattr(role, f"max_tokens_per_microbatch_in_{phase}")
            rounding = getattr(role, f"sequence_length_round_in_{phase}")
            if on and phase not in phases:
                why = ("vLLM schedules its own batches by tokens (max_num_batched_tokens in "
                       "actor_infer.strategy_args.strategy_config)" if name == "actor_infer"
                       else "the reference is frozen: it only runs log-prob passes (use_dynamic_batching_in_infer)")
                problems.append(error(f"{name}.use_dynamic_batching_in_{phase}",
                                      f"{name}.use_dynamic_batching_in_{phase}: nothing reads it: {why}"))
            if not on:
                continue
            if not budget or budget < longest:
                problems.append(error(f"{name}.max_tokens_per_microbatch_in_{phase}",
                                      f"{name}.max_tokens_per_microbatch_in_{phase} = {budget}: with "
                                      f"use_dynamic_batching_in_{phase} it must be set to at least one whole sequence, "
                                      f"{'sequence_length' if cfg.pipeline == 'agentic' else 'prompt_length + response_length'} "
                                      f"= {longest} tokens"))
            if rounding < 1:
                problems.append(error(f"{name}.sequence_length_round_in_{phase}",
                                      f"{name}.sequence_length_round_in_{phase}: must be >= 1, got {rounding}"))
    return problems
