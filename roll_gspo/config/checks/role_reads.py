"""Which blocks each role reads, in one table, and the refusal of keys set where nothing reads them.

Every role has the same blocks (ROLL's layout), but e.g. the rollout engine never reads
`training_args` and the frozen reference never reads an optimizer key: a user who sets
`reference.training_args.learning_rate` believes it acts. A key counts as set when it is written
in the YAML (or an override) and its value differs from the role's default, so a printed config
(`--print-config`, every key written with its default) still loads.

To add a block to the schema: classify it here for every role (a test checks every block is).
"""
from __future__ import annotations

import dataclasses
from typing import AbstractSet, Any, Dict, List, Optional

from roll_gspo.config.findings import Finding, error, notice
from roll_gspo.config.checks.registry import check
from roll_gspo.schema.config import PipelineConfig

READ = None  # the role reads this block (all of its keys, unless UNREAD_KEYS says otherwise)

# role -> block -> READ, or the setting that acts instead (the refusal's way out).
ROLE_BLOCKS: Dict[str, Dict[str, Optional[str]]] = {
    "actor_train": {
        "model_args": READ, "training_args": READ, "data_args": READ, "strategy_args": READ,
        "generating_args": "actor_infer.generating_args (rollout sampling; the trainer scores the responses at "
                           "actor_infer's temperature)",
    },
    "actor_infer": {
        "model_args": READ, "generating_args": READ, "strategy_args": READ,
        "training_args": "actor_train.training_args (actor_infer only samples; the optimizer runs in actor_train)",
        "data_args": "actor_train.data_args (training prompts) or validation.data_args (held-out prompts)",
    },
    "reference": {
        "model_args": READ, "strategy_args": READ,
        "training_args": "none: the reference is frozen (no optimizer step, no gradient; its forward passes "
                         "take reference.infer_batch_size sequences)",
        "generating_args": "actor_infer.generating_args (the reference scores the rollout's responses at "
                           "actor_infer's temperature)",
        "data_args": "actor_train.data_args (the reference scores the responses to those prompts)",
    },
    "teacher": {
        "model_args": READ, "strategy_args": READ,
        "training_args": "none: the teacher is frozen (no optimizer step, no gradient; its forward passes "
                         "take teacher.infer_batch_size sequences)",
        "generating_args": "actor_infer.generating_args (the teacher scores the rollout's responses at "
                           "actor_infer's temperature)",
        "data_args": "actor_train.data_args (the teacher scores the responses to those prompts)",
    },
    "critic": {
        "model_args": READ, "training_args": READ, "strategy_args": READ,
        "generating_args": "actor_infer.generating_args (the critic values the rollout's responses)",
        "data_args": "actor_train.data_args (the critic values the responses to those prompts)",
    },
}

# Single keys of a read block that a role still never reads: path -> the setting that acts instead.
UNREAD_KEYS: Dict[str, str] = {
    "actor_infer.model_args.gradient_checkpointing":
        "actor_train.model_args.gradient_checkpointing (only the training backward pass recomputes activations)",
    "reference.model_args.gradient_checkpointing":
        "actor_train.model_args.gradient_checkpointing (only the training backward pass recomputes activations)",
}

# Keys ROLL's own recipes set although ROLL ignores them in this pipeline: accepted with one notice
# (refusing them failed every ROLL file for nothing). path -> what acts instead.
ROLL_IGNORED_KEYS: Dict[str, str] = {
    "actor_train.training_args.num_train_epochs":
        "max_steps (an rlvr run is max_steps rollout batches, in ROLL too; num_train_epochs is read by the "
        "sft pipeline)",
}


def is_written(path: str, yaml_keys: Optional[AbstractSet[str]]) -> bool:
    """True when `path`, or a block above it (e.g. set through an interpolation), is in the YAML.
    Without the YAML's keys (a config built in code) every key counts as written."""
    if yaml_keys is None:
        return True
    parts = path.split(".")
    return any(".".join(parts[:i]) in yaml_keys for i in range(1, len(parts) + 1))


def _leaves(value: Any, prefix: str) -> Dict[str, Any]:
    if dataclasses.is_dataclass(value):
        out: Dict[str, Any] = {}
        for field in dataclasses.fields(value):
            out.update(_leaves(getattr(value, field.name), f"{prefix}.{field.name}"))
        return out
    return {prefix: value}


@check("warn", keys=tuple(ROLL_IGNORED_KEYS), doc="keys ROLL's recipes set although ROLL ignores them in an rlvr "
       "run: accepted, one notice naming what acts instead", name="role_reads.roll_ignored")
def ignored_key_notices(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """One notice per key of ROLL_IGNORED_KEYS the YAML sets to a non-default value (rlvr pipeline)."""
    if cfg.pipeline != "rlvr":
        return []
    defaults = PipelineConfig()
    notices = []
    for path, acts_instead in ROLL_IGNORED_KEYS.items():
        role, block, key = path.split(".")
        value = getattr(getattr(getattr(cfg, role), block), key)
        if value != getattr(getattr(getattr(defaults, role), block), key) and is_written(path, yaml_keys):
            notices.append(notice(path, f"{path} = {value!r} is ignored in an rlvr run, as in ROLL",
                                  f"what acts is {acts_instead}"))
    return notices


@check("check", keys=tuple(f"{role}.{block}" for role, blocks in ROLE_BLOCKS.items() for block in blocks),
       doc="a key set in a block (or at a key) its role never reads (next section)", name="role_reads.unread",
       rollout_only=True)
def _unread_keys(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    found = unread_key_problems(cfg, yaml_keys)
    if cfg.pipeline == "agentic":  # one template renders the conversation: agentic.problems compares them
        found = [f for f in found if not f.key.endswith(".data_args.template")]
    return found


def unread_key_problems(cfg: PipelineConfig, yaml_keys: Optional[AbstractSet[str]] = None) -> List[Finding]:
    """One refusal per key set in a block (or at a key) its role never reads."""
    defaults = PipelineConfig()
    problems = []
    # ROLL's named teachers read what the single teacher block reads (their paths as ROLL writes them).
    named = {name: ("teacher", cfg.teachers[name.partition(".")[2]]) for name in cfg.teacher_roles() if cfg.teachers}
    for role, (table, block_of_role) in {**{r: (r, getattr(cfg, r)) for r in ROLE_BLOCKS}, **named}.items():
        blocks = ROLE_BLOCKS[table]
        if block_of_role is None:  # an optional role (the critic) not given
            continue
        # An optional role's defaults are a bare RoleConfig's.
        role_defaults = getattr(defaults, role, None) or type(block_of_role)()
        for block, acts_instead in blocks.items():
            path = f"{role}.{block}"
            given = _leaves(getattr(block_of_role, block), path)
            default = _leaves(getattr(role_defaults, block), path)
            for key, value in given.items():
                where = acts_instead if acts_instead is not READ else UNREAD_KEYS.get(key)
                written = is_written(key, yaml_keys) or (role in named and is_written(  # ROLL's or our spelling
                    key.replace("teacher.", "teachers.", 1), yaml_keys))
                if where is None or value == default[key] or not written:
                    continue
                what = block if acts_instead is not READ else key.rpartition(".")[2]
                problems.append(error(key, f"{key} = {value!r} is never read ({role} does not use {what})",
                                      f"the setting that acts is {where}. Remove it here"))
    return problems
