"""LoRA's keys (ROLL's, in `model_args`): what they mean, how actor_infer's follow actor_train's, and
every check of them, at load (the steps `lora.*`, run by validate) and against the model and adapter files
(`lora_preflight_problems`, from preflight / --dry-run).

`lora_target` is the switch, as in ROLL; which modules it names is `roll_gspo.config.plan.lora_targets`'
(`resolve_lora_targets`, the trainer's reading too). Only linear layers take adapters here.
"""
from __future__ import annotations

import copy
import json
import os
import re
from typing import Dict, List, Optional, Tuple

from roll_gspo.config.findings import Finding, error, notice, warning
from roll_gspo.config.checks.registry import check
from roll_gspo.config.plan.lora_targets import (describe_linear_modules, name_matches, parse_lora_target,
                                                 resolve_lora_targets, split_names)
from roll_gspo.schema.config import ModelArgs, PipelineConfig

LORA_KEYS = ("lora_target", "lora_rank", "lora_alpha", "lora_dropout", "additional_target", "adapter_name_or_path")
DEFAULT_RANK = 8  # ROLL's; lora_alpha defaults to 2 x rank
VLLM_MAX_LORA_RANK = 512  # vllm.config.lora.MaxLoRARanks' largest
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


# --------------------------------------------------------------------------------------------
# Checks at load (validate_config)
# --------------------------------------------------------------------------------------------
_DEFAULTS = ModelArgs()


def _written_lora_keys(args: ModelArgs) -> List[str]:
    return [k for k in LORA_KEYS if getattr(args, k) != getattr(_DEFAULTS, k)]


def fill_lora_defaults(args: ModelArgs) -> None:
    """ROLL's defaults of a LoRA role: rank 8, alpha 2 x rank."""
    if args.lora_rank is None:
        args.lora_rank = DEFAULT_RANK
    if args.lora_alpha is None and isinstance(args.lora_rank, int):
        args.lora_alpha = 2 * args.lora_rank


@check("check", keys=("<role>.model_args.lora_target", "<role>.model_args.lora_rank", "<role>.model_args.lora_alpha",
                      "<role>.model_args.lora_dropout", "lora_target", "lora_sync"),
       doc="LoRA (docs/lora.md): `lora_rank` <= 0, `lora_alpha` <= 0, `lora_dropout` outside [0, 1); LoRA keys on "
           "actor_infer contradicting actor_train's (or set there alone), on the reference or a reward model; "
           "top-level `lora_*` anchors no role uses; `lora_sync: adapter` with hf_infer, `additional_target`, a "
           "rank above 512 or `sleep_level: 2` (`--dry-run` adds the checks against the model)",
       name="lora.keys")
def lora_problems(cfg: PipelineConfig, yaml_keys=None) -> List[Finding]:
    """The LoRA keys of every role. Target lists written on both roles in different words are
    compared on the model by `lora_preflight_problems`."""
    problems: List[Finding] = []
    train, infer = cfg.actor_train.model_args, cfg.actor_infer.model_args
    blocks = [("reference", cfg.reference.model_args,
               "the reference is the base model: with LoRA on actor_train its log-probs come from actor_train with "
               "the adapter disabled, and no reference model starts")]
    blocks += [(f"rewards.{domain}", reward.model_args, "adapters on reward or judge models are not built")
               for domain, reward in cfg.rewards.items()]
    for path, args, why in blocks:
        for key in _written_lora_keys(args):
            problems.append(error(f"{path}.model_args.{key}", f"{path}.model_args.{key} = {getattr(args, key)!r}: "
                                                              f"{why}; remove it"))
    if not cfg.has_rollout():
        if _written_lora_keys(infer):
            problems.append(error("actor_infer.model_args.lora_target",
                                  "actor_infer.model_args.lora_*: the sft pipeline has no rollout engine; set the LoRA "
                                  "keys on actor_train only"))
    elif not train.uses_lora() and infer.uses_lora():
        problems.append(error("actor_infer.model_args.lora_target", f"actor_infer.model_args.lora_target = "
                                                                    f"{infer.lora_target!r} while actor_train trains "
                                                                    f"every weight (no "
                                                                    f"actor_train.model_args.lora_target): the rollout "
                                                                    f"engine samples the policy actor_train trains; "
                                                                    f"set LoRA on actor_train (actor_infer's keys may "
                                                                    f"then be left out)"))
    anchors = [k for k in ("lora_target", "lora_rank", "lora_alpha") if getattr(cfg, k) is not None]
    if anchors and not train.uses_lora():
        problems.append(error(anchors[0], f"top-level {', '.join(anchors)} set, but no role's model_args uses it: "
                                          f"ROLL's top-level LoRA keys act only when interpolated "
                                          f"(actor_train.model_args.lora_target: ${{lora_target}}, ...); set them in "
                                          f"actor_train.model_args"))
    if not train.uses_lora():
        return problems
    if cfg.lora_sync == "adapter":
        problems += _adapter_sync_problems(cfg)
    for path, args in (("actor_train", train), ("actor_infer", infer)):
        problems += _value_problems(args, f"{path}.model_args")
    if problems or not cfg.has_rollout():
        return problems
    filled = copy.copy(train)  # what `_fill_lora` will make of it
    fill_lora_defaults(filled)
    return _infer_contradictions(filled, infer)


@check("settle", keys=("actor_train.model_args.lora_rank", "actor_train.model_args.lora_alpha",
                       "actor_infer.model_args"),
       doc="LoRA: ROLL's defaults (rank 8, alpha 2 x rank), and actor_infer's LoRA keys from actor_train's where "
           "it leaves them out", name="lora.fill")
def _fill_lora(cfg: PipelineConfig, yaml_keys=None) -> List[Finding]:
    train, infer = cfg.actor_train.model_args, cfg.actor_infer.model_args
    if not train.uses_lora():
        return []
    fill_lora_defaults(train)
    if cfg.has_rollout():
        for key in LORA_KEYS:
            if getattr(infer, key) == getattr(_DEFAULTS, key):  # written and equal, or in other words: kept
                setattr(infer, key, getattr(train, key))
    return []


def _value_problems(args: ModelArgs, path: str) -> List[Finding]:
    problems = []
    if args.lora_target is not None:
        try:
            parse_lora_target(args.lora_target)
        except ValueError as exc:
            problems.append(error(f"{path}.lora_target", f"{path}.lora_target = {args.lora_target!r}: {exc}"))
    if args.lora_rank is not None and args.lora_rank < 1:
        problems.append(error(f"{path}.lora_rank", f"{path}.lora_rank: must be >= 1 (the adapter's rank; null means "
                                                   f"{DEFAULT_RANK}), got {args.lora_rank}"))
    if args.lora_alpha is not None and args.lora_alpha <= 0:
        problems.append(error(f"{path}.lora_alpha", f"{path}.lora_alpha: must be > 0 (the update is scaled by "
                                                    f"lora_alpha / lora_rank; null means 2 x lora_rank), got "
                                                    f"{args.lora_alpha}"))
    if not 0.0 <= args.lora_dropout < 1.0:
        problems.append(error(f"{path}.lora_dropout",
                              f"{path}.lora_dropout: must be in [0, 1), got {args.lora_dropout}"))
    return problems


def _infer_contradictions(train: ModelArgs, infer: ModelArgs) -> List[Finding]:
    """actor_infer's LoRA keys written unlike actor_train's (lora_target written in other words is
    resolved on the model at preflight)."""
    problems = []
    for key in LORA_KEYS:
        theirs, ours = getattr(train, key), getattr(infer, key)
        if ours == getattr(_DEFAULTS, key) or ours == theirs or key == "lora_target":
            continue
        problems.append(error(f"actor_infer.model_args.{key}", f"actor_infer.model_args.{key} = {ours!r} contradicts "
                                                               f"actor_train.model_args.{key} = {theirs!r}: the "
                                                               f"rollout engine samples the adapter actor_train "
                                                               f"trains; leave it out on actor_infer (it is derived) "
                                                               f"or make them agree"))
    return problems


def _adapter_sync_problems(cfg: PipelineConfig) -> List[Finding]:
    problems = []
    strategy = cfg.actor_infer.strategy_args.strategy_name
    if cfg.has_rollout() and not cfg.actor_infer.strategy_args.engine.loads_lora_adapters:
        problems.append(error("lora_sync", f"lora_sync: adapter loads the adapter into vLLM's LoRA support, but "
                                           f"actor_infer runs {strategy!r}; use lora_sync: merged (the merged weights, "
                                           f"which {strategy} takes) or vllm"))
    from roll_gspo.placement.colocation import offload_between_phases, sleep_level

    if (cfg.actor_train.model_args.lora_rank or DEFAULT_RANK) > VLLM_MAX_LORA_RANK:
        problems.append(error("lora_sync", f"lora_sync: adapter with lora_rank {cfg.actor_train.model_args.lora_rank}: "
                                           f"vLLM's LoRA support takes ranks up to {VLLM_MAX_LORA_RANK}; use "
                                           f"lora_sync: merged"))

    if offload_between_phases(cfg) and sleep_level(cfg) >= 2:
        problems.append(error("lora_sync", "lora_sync: adapter with vLLM sleeping at sleep_level 2 between phases: "
                                           "level 2 drops the base weights, which an adapter sync never sends again; "
                                           "use lora_sync: merged (every sync refills every weight) or sleep_level 1"))
    if cfg.actor_train.model_args.additional_target:
        problems.append(error("actor_train.model_args.additional_target",
                              f"actor_train.model_args.additional_target = "
                              f"{cfg.actor_train.model_args.additional_target!r} with lora_sync: adapter: vLLM's "
                              f"adapters hold LoRA matrices only, so the fully trained modules would never reach the "
                              f"rollout engine; use lora_sync: merged"))
    return problems


@check("warn", keys=("actor_train.model_args.lora_dropout", "reference"),
       doc="LoRA: a `lora_dropout` that has no effect; with a KL term, where the reference log-probs come from",
       name="lora.warnings")
def lora_warnings(cfg: PipelineConfig, yaml_keys=None) -> List[Finding]:
    """What a LoRA config sets that does not act, said once at load."""
    train = cfg.actor_train.model_args
    if not train.uses_lora():
        return []
    warns = []
    if train.lora_dropout > 0:
        warns.append(warning("actor_train.model_args.lora_dropout", f"actor_train.model_args.lora_dropout = "
                                                                    f"{train.lora_dropout} has no effect: every "
                                                                    f"forward pass runs without dropout here (old and "
                                                                    f"new log-probs must score one policy), the "
                                                                    f"adapter's too"))
    if cfg.has_rollout() and cfg.needs_reference_log_probs():
        warns.append(notice("reference", "LoRA with a KL term: the reference log-probs come from actor_train with its "
                                         "adapter disabled (the base model); no reference role starts and reference.* "
                                         "is not read"))
    return warns


# --------------------------------------------------------------------------------------------
# Checks against the model and the adapter files (preflight, --dry-run)
# --------------------------------------------------------------------------------------------
def weightless_model(name_or_path: str):
    """The model of a folder (its config.json) or built-in name, built on the meta device (no
    weights, no memory); None when its config cannot be found here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = None
    if name_or_path.startswith("builtin:"):
        from roll_gspo.builtin import models

        folder = models.builtin_model_folder(name_or_path)
        if os.path.isfile(os.path.join(folder, "config.json")):
            config = AutoConfig.from_pretrained(folder)
        else:
            entry = models.BUILTIN_MODELS.get(name_or_path)
            fields = dict(getattr(entry, "config", None) or {})
            if fields.get("model_type"):
                config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    elif os.path.isfile(os.path.join(name_or_path, "config.json")):
        config = AutoConfig.from_pretrained(name_or_path)
    if config is None:
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def read_adapter(path: str, key: str) -> Tuple[Optional[dict], Dict[str, Tuple[int, ...]], List[str]]:
    """(adapter_config.json, {tensor name: shape}, problems) of a PEFT adapter folder."""
    if not os.path.isdir(path):
        return None, {}, [f"{key} = {path!r}: no such folder (a PEFT adapter folder holds {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS[0]}, e.g. a run's final_model/adapter)"]
    config_file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_file):
        return None, {}, [f"{key} = {path!r} has no {ADAPTER_CONFIG}: not a PEFT adapter folder"]
    config = json.loads(open(config_file).read())
    if str(config.get("peft_type", "")).upper() != "LORA":
        return config, {}, [f"{key} = {path!r}: peft_type {config.get('peft_type')!r}; only LoRA adapters are built"]
    weights = [os.path.join(path, name) for name in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(path, name))]
    if not weights:
        return config, {}, [f"{key} = {path!r} has no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})"]
    if weights[0].endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(weights[0], framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    else:
        import torch

        shapes = {name: tuple(t.shape) for name, t in torch.load(weights[0], map_location="cpu").items()}
    return config, shapes, []


def _adapter_target_text(config: dict) -> Optional[str]:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return targets  # PEFT's regex form
    if isinstance(targets, (list, tuple)) and targets:
        return ",".join(str(t) for t in targets)
    return None


def _fill_from_adapter(args: ModelArgs, config: dict, key: str) -> List[str]:
    """Null lora keys from the adapter's config; written ones must agree with it."""
    problems = []
    found = {"lora_rank": config.get("r"), "lora_alpha": config.get("lora_alpha"),
             "additional_target": ",".join(config.get("modules_to_save") or []) or None}
    for name, value in found.items():
        if value is None:
            continue
        if getattr(args, name) in (None, getattr(_DEFAULTS, name)):
            setattr(args, name, value)
        elif getattr(args, name) != value:
            problems.append(f"{key}: the adapter has {name} {value!r} (adapter_config.json), but "
                            f"actor_train.model_args.{name} = {getattr(args, name)!r}; leave it null (it is read from "
                            f"the adapter) or make them agree")
    if args.lora_target is None:
        args.lora_target = _adapter_target_text(config)
    return problems


def _adapter_shape_problems(model, shapes: Dict[str, Tuple[int, ...]], key: str) -> List[str]:
    """Each lora_A / lora_B tensor of the adapter against the model's module of that name."""
    modules = dict(model.named_modules())
    problems = []
    for name, shape in shapes.items():
        match = re.match(r"^(?:base_model\.model\.)?(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", name)
        if not match:
            continue
        module_name, which = match.groups()
        module = modules.get(module_name)
        if module is None:
            problems.append(f"{key}: the adapter's {name!r} is for module {module_name!r}, which the model does not "
                            f"have: the adapter was trained on another model; the model's linear modules: "
                            f"{describe_linear_modules(model)}")
            break
        expected = getattr(module, "in_features", None) if which == "A" else getattr(module, "out_features", None)
        got = shape[1] if which == "A" else shape[0]
        if expected is not None and got != expected:
            problems.append(f"{key}: the adapter's {name!r} has shape {list(shape)}, but {module_name!r} has "
                            f"{'in' if which == 'A' else 'out'}_features {expected}: the adapter was trained on a "
                            f"model of another size")
            break
    return problems


def lora_preflight_problems(cfg: PipelineConfig) -> List[str]:
    """The LoRA keys against the files they name: the adapter folder (its keys fill the null lora_*
    keys, in place), and the policy model (targets exist and are linear layers, actor_infer's
    targets select the same modules, additional_target names modules, the adapter's shapes fit,
    no Mixture-of-Experts model)."""
    train, infer = cfg.actor_train.model_args, cfg.actor_infer.model_args
    if not train.uses_lora():
        return []
    problems: List[str] = []
    adapter_shapes: Dict[str, Tuple[int, ...]] = {}
    if train.adapter_name_or_path:
        key = "actor_train.model_args.adapter_name_or_path"
        config, adapter_shapes, own = read_adapter(train.adapter_name_or_path, key)
        problems += own
        if config is not None and not own:
            problems += _fill_from_adapter(train, config, key)
            fill_lora_defaults(train)
            for name in LORA_KEYS:  # actor_infer follows (it was derived from the keys as written)
                if cfg.has_rollout() and getattr(infer, name) in (None, getattr(_DEFAULTS, name)):
                    setattr(infer, name, getattr(train, name))
    folder, target = train.model_name_or_path, train.lora_target
    if problems or folder is None or target is None:  # derive filled the folder; the YAML or the adapter the targets
        return problems
    model = weightless_model(folder)
    if model is None:
        return problems  # the model is built on first use: the trainer checks the same when it loads it
    if any((getattr(model.config, k, None) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return [f"actor_train.model_args.lora_target: LoRA on a Mixture-of-Experts model "
                f"({train.model_name_or_path!r}) is not built; train every weight (remove the lora_* keys)"]
    try:
        selected = resolve_lora_targets(model, target, "actor_train.model_args.lora_target")
    except ValueError as exc:
        return problems + [str(exc)]
    if cfg.has_rollout() and infer.lora_target is not None and infer.lora_target != target:
        try:
            theirs = resolve_lora_targets(model, infer.lora_target, "actor_infer.model_args.lora_target")
        except ValueError as exc:
            problems.append(str(exc))
        else:
            if set(theirs) != set(selected):
                only_train = sorted(set(selected) - set(theirs))[:3]
                only_infer = sorted(set(theirs) - set(selected))[:3]
                problems.append(f"actor_infer.model_args.lora_target = {infer.lora_target!r} selects other modules "
                                f"than actor_train.model_args.lora_target = {train.lora_target!r} (only actor_train: "
                                f"{only_train}, only actor_infer: {only_infer}); the rollout engine samples the "
                                f"adapter actor_train trains: leave it out on actor_infer or make them agree")
    modules = dict(model.named_modules())
    for name in split_names(train.additional_target):
        if not any(name_matches(m, name) for m in modules):
            problems.append(f"actor_train.model_args.additional_target names {name!r}, which no module of the model "
                            f"is called (modules trained in full beside the adapters, e.g. lm_head or embed_tokens)")
    if adapter_shapes:
        problems += _adapter_shape_problems(model, adapter_shapes, "actor_train.model_args.adapter_name_or_path")
    return problems
