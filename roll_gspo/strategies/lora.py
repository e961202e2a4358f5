"""LoRA on a training engine's model (PEFT): wrapping the loaded model, and the two ways its
weights leave the trainer.

* Merged (`merged_weight_entries`): every weight under its Hugging Face name, each adapted linear
  layer's as W + (lora_alpha / r) * B @ A, computed from gathered copies (the trainer's own
  parameters are never merged in place, so no rounding creeps into the base weights). What the
  weight sync sends with `lora_sync: merged` and what `final_model/` holds.
* Adapter (`adapter_weight_entries`): the adapter's tensors under PEFT's saved names
  (`...q_proj.lora_A.weight`), which `save_adapter` writes as a PEFT folder (`final_model/adapter`,
  `lora_sync: adapter`'s folder for vLLM).

Both are lists of `WeightEntry`, which `TrainEngineStrategy.iter_weight_buckets` gathers in buckets
(collectively under ZeRO-3 and FSDP2).
"""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from roll_gspo.config.plan.lora_targets import peft_target_modules, split_names
from roll_gspo.schema.config import ModelArgs

logger = logging.getLogger("roll_gspo.lora")
ADAPTER = "default"  # PEFT's adapter name
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model


@dataclass
class WeightEntry:
    """One tensor of the weights a trainer hands out: its `name`, the parameters it is computed
    from (gathered together), and `combine` (their whole CPU copies -> the tensor; None: the first
    parameter as it is)."""
    name: str
    params: Sequence[torch.nn.Parameter]
    combine: Optional[Callable[[List[torch.Tensor]], torch.Tensor]] = None


def apply_lora(model, args: ModelArgs):
    """`model` wrapped by PEFT with the role's adapter (fresh from lora_target/lora_rank/lora_alpha,
    or loaded from adapter_name_or_path, trainable); only the adapter (and additional_target) train."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    if args.adapter_name_or_path:
        peft_model = PeftModel.from_pretrained(model, args.adapter_name_or_path, is_trainable=True)
        logger.info("LoRA: adapter loaded from %s", args.adapter_name_or_path)
    else:
        targets = peft_target_modules(model, args.lora_target, "model_args.lora_target")
        config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                            target_modules=targets, modules_to_save=split_names(args.additional_target) or None,
                            task_type=TaskType.CAUSAL_LM)
        peft_model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in peft_model.parameters())
    logger.info("LoRA: %d trainable parameters of %d (%.2f%%), rank %s, alpha %s", trainable, total,
                100.0 * trainable / max(total, 1), args.lora_rank, args.lora_alpha)
    return peft_model


def is_peft_model(module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "disable_adapter")


def adapter_disabled(module, disabled: bool = True):
    """A context in which `module` (a PEFT model) scores with its adapter off: the base model."""
    if not disabled:
        return nullcontext()
    if not is_peft_model(module):
        raise RuntimeError("scoring with the adapter disabled needs a LoRA-trained model (model_args.lora_target)")
    return _adapter_off(module)


@contextmanager
def _adapter_off(module):
    with module.disable_adapter():
        yield


def _hf_name(name: str) -> str:
    """A PEFT model's parameter name as the Hugging Face checkpoint names it."""
    name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")


def merged_weight_entries(peft_model) -> List[WeightEntry]:
    """Every weight of the base model under its checkpoint name (tied weights under each name), with
    the adapter merged into each adapted linear layer's weight and additional_target's trained copies
    in place of the originals."""
    from peft.tuners.lora import LoraLayer

    adapted: Dict[int, LoraLayer] = {}  # id(base weight) -> its LoRA layer
    adapter_params = set()
    for module in peft_model.modules():
        if isinstance(module, LoraLayer) and ADAPTER in getattr(module, "lora_A", {}):
            adapted[id(module.get_base_layer().weight)] = module
            adapter_params.update(id(p) for p in module.lora_A[ADAPTER].parameters())
            adapter_params.update(id(p) for p in module.lora_B[ADAPTER].parameters())
    entries = []
    for name, param in peft_model.named_parameters(remove_duplicate=False):
        if id(param) in adapter_params or ".original_module." in name:
            continue
        layer = adapted.get(id(param))
        if layer is None:
            entries.append(WeightEntry(_hf_name(name), (param,)))
            continue
        scale = float(layer.scaling[ADAPTER])
        entries.append(WeightEntry(_hf_name(name), (param, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight),
                                   lambda t, s=scale: merge_lora(t[0], t[1], t[2], s)))
    return entries


def merge_lora(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in W's dtype (the product in fp32). weight: (out, in), lora_a: (r, in),
    lora_b: (out, r)."""
    delta = (lora_b.float() @ lora_a.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


def adapter_weight_entries(peft_model) -> List[WeightEntry]:
    """The adapter's trainable tensors under the names PEFT saves them (`save_adapter` writes them)."""
    from peft.utils import get_peft_model_state_dict

    named = [(name, param) for name, param in peft_model.named_parameters() if param.requires_grad]
    # PEFT renames what it saves (drops the adapter name, keeps additional_target's copies): ask it,
    # with an index per parameter standing in for the weights.
    saved = get_peft_model_state_dict(peft_model, state_dict={name: torch.tensor([i]) for i, (name, _) in
                                                              enumerate(named)}, adapter_name=ADAPTER,
                                      save_embedding_layers=False)  # adapters sit on linear layers only
    return [WeightEntry(key, (named[int(index)][1],)) for key, index in saved.items()]


def adapter_config(peft_model, base_model_path: str) -> dict:
    """adapter_config.json's content for the trained adapter."""
    config = peft_model.peft_config[ADAPTER].to_dict()
    config["base_model_name_or_path"] = base_model_path
    config["inference_mode"] = True
    for key, value in list(config.items()):
        if isinstance(value, set):
            config[key] = sorted(value)
    return config


def save_adapter(folder: str, tensors: Dict[str, torch.Tensor], config: dict) -> None:
    """A PEFT adapter folder: adapter_model.safetensors and adapter_config.json (loads with
    `PeftModel.from_pretrained`, and into vLLM as a LoRA request)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(folder, "adapter_config.json"), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True, default=str)
