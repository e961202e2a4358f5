"""A training checkpoint as a model folder the evaluation command can load.

A checkpoint (`<output_dir>/checkpoints/step_<N>/`) holds the training engine's state, not a Hugging
Face folder, and a run stopped by SIGTERM or its budget has no `final_model/` yet: its last
checkpoint is the only copy of what it learned. DeepSpeed's own reader
(`deepspeed.utils.zero_to_fp32`, any ZeRO stage and rank count) gives the fp32 weights; the model's
config, generation config and tokenizer come from the model the run started from (the run's YAML:
`actor_train.model_args.model_name_or_path`). The folder is written once into the cache, keyed by
the checkpoint's path and time.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from roll_gspo.lifecycle.checkpoint import COMPLETE_MARKER, STATE_FILE


def is_checkpoint(path: str) -> bool:
    """A committed checkpoint folder (`step_<N>/` with its COMPLETE marker and pipeline state)."""
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER)) and os.path.isfile(os.path.join(path, STATE_FILE))


def checkpoint_model(path: str, base_model: Optional[str], cache_dir: Optional[str] = None) -> str:
    """The Hugging Face folder of the policy weights in checkpoint `path`, built once into
    `<cache>/eval_models/`. `base_model`: the model the run trained (a folder, `.gguf` or
    `builtin:` name) for its config and tokenizer. Refused with the reason: no base model, an
    FSDP2 or LoRA checkpoint (not converted here: evaluate the run's final_model/)."""
    from roll_gspo.builtin.cache import build_atomically, cache_root
    from roll_gspo.builtin.models import resolve_model

    path = os.path.realpath(path)  # one cache entry however the folder is reached
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as fh:
        shape = (json.load(fh).get("trainer_shapes") or {}).get("actor_train") or {}
    if shape.get("engine", "deepspeed") != "deepspeed" or shape.get("lora"):
        kind = "a LoRA" if shape.get("lora") else f"an {shape.get('engine')}"
        raise ValueError(f"--model {path}: {kind} checkpoint is not converted to a model folder here (only "
                         f"DeepSpeed full fine-tuning is); evaluate the run's final_model/ (a run writes it at its end)")
    if not base_model:
        raise ValueError(f"--model {path} is a training checkpoint: give --config with the run's YAML, whose "
                         f"actor_train.model_args.model_name_or_path supplies the model's config and tokenizer")
    base = resolve_model(base_model)
    key = hashlib.sha256(f"{path}:{os.path.getmtime(os.path.join(path, COMPLETE_MARKER))}:{base}".encode()).hexdigest()
    target = os.path.join(cache_root(cache_dir), "eval_models", f"{os.path.basename(path)}-{key[:16]}")

    def build(folder: str) -> None:
        import shutil

        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from safetensors.torch import save_file

        state = get_fp32_state_dict_from_zero_checkpoint(path)
        # tied embeddings share storage; safetensors wants each tensor on its own
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        for name in os.listdir(base):  # config, generation config, tokenizer: everything but the weights
            weights = ".safetensors" in name or name.endswith((".bin", ".pt", ".gguf"))  # and their index files
            if not weights and os.path.isfile(os.path.join(base, name)):
                shutil.copy2(os.path.join(base, name), os.path.join(folder, name))

    return build_atomically(target, build, what=f"the model of checkpoint {path}")
