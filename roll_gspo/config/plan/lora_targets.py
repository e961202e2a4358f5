"""Which modules a `lora_target` names (ROLL's reading): a comma list of module names (a module matches a
name when its own name is it or ends in `.<name>`, PEFT's rule), `all-linear` (every linear layer but the
LM head), or a regex (a value holding `*`, `$`, `|` or `(`) matched against whole module names. The
trainer (roll_gspo.strategies.lora) and --dry-run (on a weightless copy of the model, the checks of
`roll_gspo.config.checks.lora`) resolve it with the same function, so --dry-run refuses what the trainer
would."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

REGEX_MARKS = ("*", "$", "|", "(")  # ROLL keeps a lora_target holding one of these as a regex
ALL_LINEAR = "all-linear"
# ROLL's other expansions, not built: their adapters are not linear layers.
UNBUILT_TARGETS = {
    "all-embedding": "adapters on embeddings are not built (only linear layers take adapters here)",
    "all-router": "adapters on MoE routers are not built (LoRA on Mixture-of-Experts models is refused)",
}


@dataclass(frozen=True)
class LoraTarget:
    """A parsed lora_target: a regex over whole module names, or names (suffixes) plus all-linear."""
    regex: Optional[str]
    names: Tuple[str, ...]
    all_linear: bool


def parse_lora_target(text: str) -> LoraTarget:
    """ROLL's reading of lora_target (ValueError on an empty list or an invalid regex)."""
    text = str(text).strip()
    if any(mark in text for mark in REGEX_MARKS):
        try:
            re.compile(text)
        except re.error as exc:
            raise ValueError(f"not a valid regex ({exc})") from exc
        return LoraTarget(regex=text, names=(), all_linear=False)
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise ValueError("names no module (a comma list of module names, `all-linear`, or a regex)")
    for name in names:
        if name in UNBUILT_TARGETS:
            raise ValueError(f"`{name}`: {UNBUILT_TARGETS[name]}; use `all-linear` or linear module names")
    return LoraTarget(regex=None, names=tuple(n for n in names if n != ALL_LINEAR), all_linear=ALL_LINEAR in names)


def split_names(text: Optional[str]) -> List[str]:
    """A comma list (additional_target) as names."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


# --------------------------------------------------------------------------------------------
# Targets on a model (the trainer's model, or a weightless copy for --dry-run)
# --------------------------------------------------------------------------------------------
def linear_modules(model) -> Dict[str, object]:
    """{module name: module} of every torch.nn.Linear of `model`."""
    import torch

    return {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def describe_linear_modules(model) -> str:
    """The model's linear modules by their last name, with counts: what lora_target can name."""
    counts: Dict[str, int] = {}
    for name in linear_modules(model):
        suffix = name.rpartition(".")[2]
        counts[suffix] = counts.get(suffix, 0) + 1
    return ", ".join(f"{suffix} (x{count})" if count > 1 else suffix for suffix, count in counts.items())


def name_matches(module_name: str, key: str) -> bool:
    """PEFT's rule: a module matches a name when its own name is it or ends in `.<name>`."""
    return module_name == key or module_name.endswith("." + key)


def output_layer_names(model) -> List[str]:
    """Names of the LM head module(s): what all-linear leaves out."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules() if head is not None and module is head]


def resolve_lora_targets(model, text: str, key: str) -> List[str]:
    """The module names `text` (a lora_target) selects on `model`, in model order; ValueError naming
    `key` and listing the model's linear modules when it names no module, a module that is not a
    linear layer, or an LM head tied to the input embedding."""
    target = parse_lora_target(text)
    linear = linear_modules(model)
    modules = dict(model.named_modules())
    listing = f"the model's linear modules: {describe_linear_modules(model)}"
    if target.regex is not None:
        matched = [name for name in modules if re.fullmatch(target.regex, name)]
        if not matched:
            raise ValueError(f"{key} = {text!r} (a regex over whole module names, e.g. "
                             f"`.*layers\\.\\d+\\.self_attn\\.q_proj`) matches no module of the model; {listing}")
        _check_linear(matched, linear, modules, key, text, listing)
        selected = set(matched)
    else:
        selected = set()
        for name in target.names:
            found = [m for m in modules if name_matches(m, name)]
            if not found:
                raise ValueError(f"{key} names {name!r}, which no module of the model is called; {listing}")
            _check_linear(found, linear, modules, key, name, listing)
            selected.update(found)
        if target.all_linear:
            heads = set(output_layer_names(model))
            selected.update(name for name in linear if name not in heads)
    tied = _tied_output_layer(model)
    if tied and tied in selected:
        raise ValueError(f"{key} = {text!r} selects the LM head {tied!r}, whose weight is the input embedding's "
                         f"(tie_word_embeddings): an adapter on it would change the output layer only, and a "
                         f"merged sync would change both; leave it out (`all-linear` does)")
    return [name for name in modules if name in selected]


def _check_linear(names, linear, modules, key, what, listing) -> None:
    other = [n for n in names if n not in linear]
    if other:
        kinds = sorted({type(modules[n]).__name__ for n in other})
        raise ValueError(f"{key}: {what!r} selects modules that are not linear layers ({', '.join(kinds)}, e.g. "
                         f"{other[0]!r}); only linear layers take adapters here; {listing}")


def _tied_output_layer(model) -> Optional[str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is None or embed is None or head.weight is not embed.weight:
        return None
    names = output_layer_names(model)
    return names[0] if names else None


def peft_target_modules(model, text: str, key: str) -> List[str]:
    """What PEFT's LoraConfig.target_modules gets for `text`, selecting exactly the modules
    `resolve_lora_targets` does: their last names (`q_proj`, ...) when those select no other
    module (PEFT's suffix rule), else their whole names."""
    selected = resolve_lora_targets(model, text, key)
    suffixes = sorted({name.rpartition(".")[2] for name in selected})
    by_suffix = [m for m, _ in model.named_modules() if m and any(name_matches(m, s) for s in suffixes)]
    return suffixes if set(by_suffix) == set(selected) else selected
