"""Dynamic batching (token-budget micro-batches): only on roles whose passes it splits, with a budget that
holds one whole sequence; ROLL's sequence packing read as such budgets."""
from __future__ import annotations

from typing import AbstractSet, Dict, List, Optional, Tuple

from roll_gspo.config.checks.registry import check
from roll_gspo.config.findings import Finding, error, notice
from roll_gspo.schema.config import PipelineConfig, RoleConfig

# ROLL's SequencePackingConfig fields; the budgets per phase, then the Megatron-only minimum counts.
PACKING_BUDGETS = {"train": "max_packed_sequence_length_train", "infer": "max_packed_sequence_length_forward"}
PACKING_MINIMUMS = ("min_num_micro_batches_train", "min_num_micro_batches_forward")
PACKING_ALGORITHMS = ("none", "load_balance")


def _roles(cfg: PipelineConfig) -> Dict[str, Tuple[RoleConfig, Tuple[str, ...]]]:
    """Each present role with the passes token budgets split: actor_train trains and scores, the frozen
    reference and teacher score, vLLM schedules its own batches."""
    roles = {"actor_train": (cfg.actor_train, ("train", "infer")), "reference": (cfg.reference, ("infer",)),
             "actor_infer": (cfg.actor_infer, ())}
    roles.update({name: (role, ("infer",)) for name, role in cfg.teacher_roles().items()})
    return roles


@check("derive", keys=("<role>.use_sequence_packing", "<role>.sequence_packing_args"),
       doc="ROLL's sequence packing (Megatron only in ROLL) acts as token-budget micro-batches: "
           "max_packed_sequence_length_train / _forward become max_tokens_per_microbatch_in_train / _in_infer "
           "(one notice); unknown packing options, another algorithm or a budget clashing with one written "
           "are refused; options without use_sequence_packing are ignored as ROLL ignores them",
       name="batching.sequence_packing")
def sequence_packing_as_token_budgets(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None
                                      ) -> List[Finding]:
    findings: List[Finding] = []
    written = yaml_keys or set()
    for name, (role, phases) in _roles(cfg).items():
        args = dict(role.sequence_packing_args or {})
        if not role.use_sequence_packing:
            if args:
                findings.append(notice(f"{name}.sequence_packing_args", f"{name}.sequence_packing_args: read only with "
                                                                       f"{name}.use_sequence_packing: true, as in ROLL; "
                                                                       f"ignored"))
            continue
        key = f"{name}.sequence_packing_args"
        unknown = sorted(set(args) - set(PACKING_BUDGETS.values()) - set(PACKING_MINIMUMS) - {"algorithm"})
        if unknown:
            findings.append(error(key, f"{key}: unknown option(s) {', '.join(unknown)}; ROLL's are algorithm, "
                                       f"{', '.join(PACKING_BUDGETS.values())}, {', '.join(PACKING_MINIMUMS)}"))
        algorithm = args.get("algorithm", "none")
        if algorithm not in PACKING_ALGORITHMS:
            findings.append(error(f"{key}.algorithm", f"{key}.algorithm = {algorithm!r}: one of "
                                                      f"{', '.join(PACKING_ALGORITHMS)}"))
        if not phases:
            findings.append(notice(f"{name}.use_sequence_packing", f"{name}.use_sequence_packing: nothing to pack, "
                                                                   f"vLLM schedules its own batches by tokens; ignored"))
            continue
        became: List[str] = []
        for phase in phases:
            budget = args.get(PACKING_BUDGETS[phase])
            if budget is None:  # unset: one whole sequence, the least any micro-batch must hold
                budget = cfg.max_sequence_tokens()
            on_key, budget_key = f"use_dynamic_batching_in_{phase}", f"max_tokens_per_microbatch_in_{phase}"
            if f"{name}.{budget_key}" in written and getattr(role, budget_key) != budget:
                findings.append(error(f"{key}.{PACKING_BUDGETS[phase]}",
                                      f"{key}.{PACKING_BUDGETS[phase]} = {budget} sets {name}.{budget_key}, which is "
                                      f"also written as {getattr(role, budget_key)}; keep one"))
                continue
            setattr(role, on_key, True)
            setattr(role, budget_key, int(budget))
            became.append(f"{budget_key} = {int(budget)}")
        minimums = [k for k in PACKING_MINIMUMS if k in args]
        findings.append(notice(f"{name}.use_sequence_packing",
                               f"{name}.use_sequence_packing: token-budget micro-batches"
                               f"{' (' + ', '.join(became) + ')' if became else ''}; the same gradient as packing, "
                               f"rows padded to their micro-batch's longest rather than concatenated"
                               f"{'; ' + ', '.join(minimums) + ' (Megatron pipeline stages to fill) ignored' if minimums else ''}"))
    return findings


@check("check", keys=("<role>.use_dynamic_batching_in_train", "<role>.max_tokens_per_microbatch_in_train",
                      "<role>.sequence_length_round_in_train"),
       doc="dynamic batching on a role whose passes it does not split, or with a token budget below one "
           "whole sequence", name="batching.dynamic")
def _dynamic_batching_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """Token-budget micro-batches: a budget that holds one whole sequence, and the keys only on
    roles whose passes they split (actor_train: train and infer; reference: infer)."""
    problems = []
    longest = cfg.max_sequence_tokens()
    for name, (role, phases) in _roles(cfg).items():
        for phase in ("train", "infer"):
            on, budget = getattr(role, f"use_dynamic_batching_in_{phase}"), getattr(role, f"max_tokens_per_microbatch_in_{phase}")
            rounding = getattr(role, f"sequence_length_round_in_{phase}")
            if on and phase not in phases:
                why = ("vLLM schedules its own batches by tokens (max_num_batched_tokens in "
                       "actor_infer.strategy_args.strategy_config)" if name == "actor_infer"
                       else f"the {name} is frozen: it only runs log-prob passes (use_dynamic_batching_in_infer)")
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
