"""A training checkpoint as a model folder the evaluation command can load.

A checkpoint (`<output_dir>/checkpoints/step_<N>/`) holds the training engine's state, not a Hugging
Face folder, and a run stopped by SIGTERM or its budget has no `final_model/` yet: its last
checkpoint is the only copy of what it learned. DeepSpeed's own reader
(`deepspeed.utils.zero_to_fp32`, any ZeRO stage and rank count) gives the fp32 weights; the model's
config, generation config and tokenizer come from the model the run started from (the run's YAML:
`actor_train.model_args.model_name_or_path`). The folder is written once into the cache, keyed by
the checkpoint's path and time.

A LoRA run's checkpoint holds only the adapter (its frozen base weights are the pretrained ones):
the adapter is put on the base model as training put it (`roll_gspo.strategies.lora.apply_lora`
with the run's `actor_train.model_args`, so the same modules, rank and scale), its trained tensors
loaded, and each adapted weight merged as W + (lora_alpha / r) B A, the merge the run's own
final_model/ gets (`merged_weight_entries`).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Dict, Optional

from roll_gspo.eval.errors import EvalInputError
from roll_gspo.lifecycle.checkpoint import COMPLETE_MARKER, STATE_FILE

if TYPE_CHECKING:
    import torch

    from roll_gspo.schema.config import ModelArgs


def is_checkpoint(path: str) -> bool:
    """A committed checkpoint folder (`step_<N>/` with its COMPLETE marker and pipeline state)."""
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER)) and os.path.isfile(os.path.join(path, STATE_FILE))


def checkpoint_model(path: str, base_model: Optional[str], cache_dir: Optional[str] = None,
                     model_args: Optional["ModelArgs"] = None) -> str:
    """The Hugging Face folder of the policy weights in checkpoint `path`, built once into
    `<cache>/eval_models/`. `base_model`: the model the run trained (a folder, `.gguf` or
    `builtin:` name) for its config and tokenizer (default: `model_args.model_name_or_path`).
    `model_args`: the run's actor_train.model_args, needed for a LoRA checkpoint (its lora_* keys).
    Refused with the reason: no base model, an FSDP2 checkpoint (not converted here: evaluate the
    run's final_model/), a LoRA checkpoint without the run's LoRA settings or not matching them."""
    from roll_gspo.builtin.cache import build_atomically, cache_root
    from roll_gspo.builtin.models import resolve_model

    path = os.path.realpath(path)  # one cache entry however the folder is reached
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as fh:
        shape = (json.load(fh).get("trainer_shapes") or {}).get("actor_train") or {}
    if shape.get("engine", "deepspeed") != "deepspeed":
        raise EvalInputError(f"--model {path}: an {shape.get('engine')} checkpoint is not converted to a model folder "
                             f"here (only DeepSpeed's are); evaluate the run's final_model/ (a run writes it at its end)")
    lora = bool(shape.get("lora"))
    if lora and (model_args is None or not model_args.uses_lora()):
        raise EvalInputError(f"--model {path} is a LoRA checkpoint (the adapter only): give --config with the run's "
                             f"YAML (and the overrides of its command line, after it), whose actor_train.model_args "
                             f"(lora_target, lora_rank, lora_alpha) say how the adapter sits on the base model")
    base_model = base_model or (model_args.model_name_or_path if model_args is not None else None)
    if not base_model:
        raise EvalInputError(f"--model {path} is a training checkpoint: give --config with the run's YAML, whose "
                             f"actor_train.model_args.model_name_or_path supplies the model's config and tokenizer")
    base = resolve_model(base_model)
    settings = _lora_settings(model_args) if lora and model_args is not None else ""
    key = hashlib.sha256(f"{path}:{os.path.getmtime(os.path.join(path, COMPLETE_MARKER))}:{base}:{settings}"
                         .encode()).hexdigest()
    target = os.path.join(cache_root(cache_dir), "eval_models", f"{os.path.basename(path)}-{key[:16]}")

    def build(folder: str) -> None:
        import shutil

        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from safetensors.torch import save_file

        state = get_fp32_state_dict_from_zero_checkpoint(path)
        if lora and model_args is not None:
            state = merged_lora_state(state, base, model_args, path)
        # tied embeddings share storage; safetensors wants each tensor on its own
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        for name in os.listdir(base):  # config, generation config, tokenizer: everything but the weights
            weights = ".safetensors" in name or name.endswith((".bin", ".pt", ".gguf"))  # and their index files
            if not weights and os.path.isfile(os.path.join(base, name)):
                shutil.copy2(os.path.join(base, name), os.path.join(folder, name))

    return build_atomically(target, build, what=f"the model of checkpoint {path}")


def _lora_settings(args: "ModelArgs") -> str:
    """The keys that decide where an adapter sits and how it scales (part of the cache key)."""
    return json.dumps([args.lora_target, args.lora_rank, args.lora_alpha, args.additional_target,
                       args.adapter_name_or_path])


def merged_lora_state(adapter: Dict[str, "torch.Tensor"], base: str, model_args: "ModelArgs",
                      what: str) -> Dict[str, "torch.Tensor"]:
    """The base model's weights (folder `base`) with the checkpoint's trained adapter tensors
    (`adapter`: the PEFT model's parameter names, as DeepSpeed saved them) merged in, under the
    Hugging Face names. Refused, naming the keys, when the run's LoRA settings do not build the
    adapter the checkpoint holds (other targets or rank)."""
    import torch
    from transformers import AutoModelForCausalLM

    from roll_gspo.strategies.lora import apply_lora, merged_weight_entries

    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), model_args)
    params = dict(peft_model.named_parameters())
    trainable = {name for name, p in params.items() if p.requires_grad}
    known = set(params) | {name for name, _ in peft_model.named_buffers()}
    missing, unknown = sorted(trainable - set(adapter)), sorted(set(adapter) - known)
    shapes = sorted(n for n in trainable & set(adapter) if tuple(adapter[n].shape) != tuple(params[n].shape))
    if missing or unknown or shapes:
        found = ("; ".join(f"{label} {names[:3]}{' ...' if len(names) > 3 else ''}" for label, names in
                           (("not in the checkpoint:", missing), ("not in the model:", unknown),
                            ("other shapes:", shapes)) if names))
        raise EvalInputError(f"--model {what}: the checkpoint's adapter is not the one the run's actor_train.model_args "
                             f"(lora_target {model_args.lora_target!r}, lora_rank {model_args.lora_rank}, "
                             f"additional_target {model_args.additional_target!r}) put on {base}: {found}. Give "
                             f"--config with the YAML (and overrides) the run trained with")
    with torch.no_grad():
        for name in trainable:
            params[name].copy_(adapter[name].to(params[name].dtype))
        merged = {}
        for entry in merged_weight_entries(peft_model):
            tensors = [p.detach() for p in entry.params]
            merged[entry.name] = entry.combine(tensors) if entry.combine is not None else tensors[0]
    return merged
