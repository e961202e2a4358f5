"""Built-in tiny model and synthetic arithmetic tasks.

No model or dataset hub is reachable on the machines this project targets, so everything needed
for an end-to-end run is generated locally: a character-level tokenizer, a random-init Qwen2
model, and verifiable arithmetic prompts. Built artefacts live under a cache folder
(``$ROLL_GSPO_CACHE`` or ``~/.cache/roll_gspo``), are built on first use and reused after.
Builds go to a temporary folder renamed into place, so a half-built folder is never used, and a
file lock keeps concurrent processes (Ray actors) from building the same thing twice.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import random
import shutil
import string
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
CACHE_ENV = "ROLL_GSPO_CACHE"

# Bump when the generated content changes, so stale caches are not reused.
MODEL_FORMAT_VERSION = "v1"
TASK_FORMAT_VERSION = "v2"

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN]
# Renders chat `messages` by plain concatenation: the tiny model has no chat format, but chat-style
# data should still load.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


# --------------------------------------------------------------------------------------------
# Cache and atomic builds
# --------------------------------------------------------------------------------------------
def cache_root(cache_dir: Optional[str] = None) -> str:
    """The cache folder: the argument, else ``$ROLL_GSPO_CACHE``, else ``~/.cache/roll_gspo``."""
    root = cache_dir or os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "roll_gspo")
    return os.path.abspath(os.path.expanduser(root))


@contextlib.contextmanager
def _file_lock(path: str):
    """Exclusive inter-process lock (POSIX flock; a no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _status(msg: str) -> None:
    """A visible one-line progress message (builds take seconds to minutes; say why we wait)."""
    try:
        from tqdm import tqdm
        tqdm.write(msg, file=sys.stderr)
    except Exception:  # pragma: no cover
        print(msg, file=sys.stderr)
    logger.info(msg)


def build_atomically(target: str, build: Callable[[str], None], *, what: str = "") -> str:
    """Run ``build(tmp_folder)`` and rename the folder to ``target``; reuse ``target`` if present.

    The rename is the completion marker: an interrupted build leaves only a ``.tmp`` folder.
    """
    target = os.path.abspath(target)
    if os.path.isdir(target):
        return target
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    with _file_lock(target + ".lock"):
        if os.path.isdir(target):  # another process built it while we waited
            return target
        label = what or os.path.basename(target)
        _status(f"[roll_gspo] building {label} into {target} (first use; cached afterwards)")
        t0 = time.time()
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
        try:
            build(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _status(f"[roll_gspo] built {label} in {time.time() - t0:.1f}s")
    return target


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
def char_vocab() -> List[str]:
    """Token strings in id order: specials, then arithmetic characters, letters, other ASCII.

    Printable ASCII is covered fully so any English/ASCII prompt round-trips; the order is fixed
    because token ids are baked into saved models.
    """
    chars = list("0123456789+-*/=() ") + list(string.ascii_lowercase) + list(string.ascii_uppercase)
    chars += list(".,:?!")
    chars += [c for c in string.printable if c not in chars and c not in "\r\x0b\x0c"]
    return SPECIAL_TOKENS + chars


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (every character is one token, no bos)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(char_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # [\s\S] rather than "." so newlines are split too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN,
        model_max_length=256)
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
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
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        **MODEL_SIZES[size],
    )
    _save_random_model(folder, Qwen2ForCausalLM, config, tokenizer, seed)


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
        vocab_size=len(tokenizer), max_position_embeddings=256, tie_word_embeddings=True,
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
    if it also accepts ``cache_dir=`` it gets the cache root, to resolve other built-ins.
    ``provider`` is a module imported before resolution when ``builder`` is None (lets a module
    register its builder lazily)."""
    name: str
    description: str = ""
    builder: Optional[Callable[..., None]] = None
    provider: Optional[str] = None


BUILTIN_MODELS: Dict[str, BuiltinModel] = {}


def _norm_builtin(name: str) -> str:
    name = name.strip()
    return name if name.startswith(BUILTIN_PREFIX) else BUILTIN_PREFIX + name


def register_builtin_model(name: str, builder: Optional[Callable[..., None]], *,
                           description: Optional[str] = None,
                           provider: Optional[str] = None) -> BuiltinModel:
    """Add or update a built-in model (``name`` with or without the ``builtin:`` prefix)."""
    key = _norm_builtin(name)
    entry = BUILTIN_MODELS.get(key) or BuiltinModel(name=key)
    entry.builder = builder
    if description is not None:
        entry.description = description
    if provider is not None:
        entry.provider = provider
    BUILTIN_MODELS[key] = entry
    return entry


register_builtin_model(
    "builtin:tiny-arith-base", lambda folder: write_base_model(folder, seed=0, size="tiny"),
    description="Random-init 4-layer Qwen2 (hidden 128) with a char-level tokenizer.")
# SFT-warm-started model; its builder (an SFT run on builtin:arith/sft) is registered elsewhere.
register_builtin_model(
    "builtin:tiny-arith", None, provider="pipelines.warm_start",
    description="builtin:tiny-arith-base after SFT on builtin:arith/sft (configs/sft_tiny_arith.yaml).")


register_builtin_model(
    "builtin:tiny-moe-base", lambda folder: write_base_moe_model(folder, seed=0, size="tiny"),
    description="Random-init 4-layer Qwen3-MoE (hidden 128, 8 experts of width 64, top-2) with the "
                "char-level tokenizer.")
register_builtin_model(
    "builtin:tiny-moe", None, provider="pipelines.warm_start",
    description="builtin:tiny-moe-base after SFT on builtin:arith_easy/sft_biased (configs/sft_tiny_moe.yaml).")


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
    if not name.startswith(BUILTIN_PREFIX):
        path = os.path.abspath(os.path.expanduser(name))
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"model folder {name!r} does not exist. Set `pretrain` (or "
                f"`<role>.model_args.model_name_or_path`) to a local Hugging Face model folder or "
                f"a built-in name: {', '.join(sorted(BUILTIN_MODELS))}. Model hubs are not used.")
        return path
    entry = BUILTIN_MODELS.get(name)
    if entry is None:
        raise ValueError(f"unknown built-in model {name!r}; valid: {', '.join(sorted(BUILTIN_MODELS))}")
    folder = builtin_model_folder(name, cache_dir)
    if os.path.isdir(folder):
        return folder
    if entry.builder is None and entry.provider:
        import importlib
        importlib.import_module(entry.provider)  # expected to call register_builtin_model
    if entry.builder is None:
        raise RuntimeError(
            f"built-in model {name!r} has no builder registered and is not cached at {folder}. "
            f"The module that provides it must call register_builtin_model({name!r}, builder) "
            f"first.")
    builder = entry.builder
    return build_atomically(folder, lambda tmp: _call_builder(builder, tmp, cache_dir),
                            what=f"model {name}")


# --------------------------------------------------------------------------------------------
# Synthetic arithmetic tasks
# --------------------------------------------------------------------------------------------
ARITH_LEVELS: Tuple[int, ...] = (1, 2, 3, 4, 5)
ARITH_DOMAIN = "math_rule"
SFT_BIASED_P_CORRECT = 0.35
LEVEL_DESCRIPTIONS = {
    1: "single-digit a+b",
    2: "two-digit + one-digit (either order)",
    3: "two-digit a+b",
    4: "subtraction a-b with a, b < 100 (may be negative)",
    5: "multiplication a*b, one factor 1-9 and the other 1-20",
}


def arith_level_space(level: int) -> List[Tuple[str, str]]:
    """Every (prompt, answer) of a level, in a fixed order. Prompts look like ``12+35=``."""
    pairs: List[Tuple[int, int]]
    if level == 1:
        pairs, op = [(a, b) for a in range(10) for b in range(10)], "+"
    elif level == 2:
        pairs = [(a, b) for a in range(10, 100) for b in range(10)]
        pairs += [(b, a) for a, b in pairs]
        op = "+"
    elif level == 3:
        pairs, op = [(a, b) for a in range(10, 100) for b in range(10, 100)], "+"
    elif level == 4:
        pairs, op = [(a, b) for a in range(100) for b in range(100)], "-"
    elif level == 5:
        pairs = [(a, b) for a in range(1, 10) for b in range(1, 21)]
        pairs = sorted(set(pairs + [(b, a) for a, b in pairs]))
        op = "*"
    else:
        raise ValueError(f"unknown arithmetic level {level!r}; valid: {list(ARITH_LEVELS)}")
    fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}[op]
    return [(f"{a}{op}{b}=", str(fn(a, b))) for a, b in pairs]


def _row(prompt: str, answer: str, level: int) -> dict:
    return {"prompt": prompt, "ground_truth": answer, "domain": ARITH_DOMAIN, "level": level}


def make_arith_samples(n: int, *, seed: int, levels: Sequence[int] = ARITH_LEVELS,
                       exclude: Iterable[str] = ()) -> List[dict]:
    """``n`` arithmetic rows, levels balanced (round-robin), deterministic from ``seed``.

    Each level walks through its shuffled prompt space, reshuffling when exhausted, so a level
    repeats prompts only once all have been used. Prompts in ``exclude`` are never produced.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    levels = list(levels)
    if not levels:
        raise ValueError("levels must not be empty")
    rng = random.Random(seed)
    excluded = set(exclude)
    pools: Dict[int, List[Tuple[str, str]]] = {}
    for lv in sorted(set(levels)):
        pool = [p for p in arith_level_space(lv) if p[0] not in excluded]
        if not pool:
            raise ValueError(f"arithmetic level {lv} has no prompts left after exclusions")
        pools[lv] = pool
    cursors = {lv: len(pool) for lv, pool in pools.items()}  # forces a shuffle on first draw
    rows = []
    for i in range(n):
        lv = levels[i % len(levels)]
        pool = pools[lv]
        if cursors[lv] >= len(pool):
            rng.shuffle(pool)
            cursors[lv] = 0
        prompt, answer = pool[cursors[lv]]
        cursors[lv] += 1
        rows.append(_row(prompt, answer, lv))
    rng.shuffle(rows)
    return rows


def make_arith_splits(*, seed: int = 0, n_train: int = 20000, n_val: int = 256,
                      n_sft: int = 20000, levels: Sequence[int] = ARITH_LEVELS,
                      max_val_fraction: float = 0.25) -> Dict[str, List[dict]]:
    """Train / val / sft rows; val prompts never occur in train or sft.

    Val takes at most ``max_val_fraction`` of each level's prompt space (level 1 has only 100),
    spreading the rest of its quota over the larger levels.
    """
    levels = sorted(set(levels))
    rng = random.Random(f"arith-val-{seed}")
    spaces = {lv: arith_level_space(lv) for lv in levels}
    for lv in levels:
        rng.shuffle(spaces[lv])
    caps = {lv: int(len(spaces[lv]) * max_val_fraction) for lv in levels}
    if sum(caps.values()) < n_val:
        raise ValueError(f"n_val={n_val} too large for levels {levels}")
    quota = {lv: 0 for lv in levels}
    remaining = n_val
    while remaining:
        for lv in levels:
            if remaining and quota[lv] < caps[lv]:
                quota[lv] += 1
                remaining -= 1
    val = [_row(p, a, lv) for lv in levels for p, a in spaces[lv][:quota[lv]]]
    rng.shuffle(val)
    val_prompts = {r["prompt"] for r in val}
    train = make_arith_samples(n_train, seed=seed, levels=levels, exclude=val_prompts)
    sft = make_arith_samples(n_sft, seed=seed + 1, levels=levels, exclude=val_prompts)
    for r in sft:
        r["response"] = r["ground_truth"]  # SFT target: the bare answer, then eos
    return {"train": train, "val": val, "sft": sft, "sft_biased": biased_sft_rows(sft, seed=seed)}


def biased_sft_rows(rows: Sequence[dict], *, seed: int, p_correct: float = SFT_BIASED_P_CORRECT) -> List[dict]:
    """SFT rows whose target is the true answer with probability ``p_correct`` and otherwise
    the answer plus one: a consistent, plausible mistake. A model fitted to them puts most of its
    mass on the wrong answer (greedy decoding is mostly wrong) while still sampling the right one
    often enough for rewards to find it: the warm start RL needs to show it learns."""
    rng = random.Random(f"arith-sft-biased-{seed}")
    out = []
    for r in rows:
        right = rng.random() < p_correct
        out.append({**r, "response": r["ground_truth"] if right else str(int(r["ground_truth"]) + 1)})
    return out


def _write_jsonl(path: str, rows: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


@dataclass
class BuiltinTask:
    name: str
    splits: Tuple[str, ...]
    writer: Callable[..., None]
    description: str = ""
    defaults: Dict[str, int] = field(default_factory=dict)


def _write_arith(folder: str, *, seed: int = 0, n_train: int = 20000, n_val: int = 256,
                 n_sft: int = 20000, levels: Sequence[int] = ARITH_LEVELS) -> None:
    splits = make_arith_splits(seed=seed, n_train=n_train, n_val=n_val, n_sft=n_sft, levels=levels)
    for split, rows in splits.items():
        _write_jsonl(os.path.join(folder, f"{split}.jsonl"), rows)
    meta = {"task": "arith", "version": TASK_FORMAT_VERSION, "seed": seed,
            "sizes": {k: len(v) for k, v in splits.items()},
            "levels": {lv: LEVEL_DESCRIPTIONS[lv] for lv in levels}}
    with open(os.path.join(folder, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)


BUILTIN_TASKS: Dict[str, BuiltinTask] = {
    "arith": BuiltinTask("arith", ("train", "val", "sft", "sft_biased"), _write_arith,
                         "Verifiable arithmetic, 5 difficulty levels; sft rows add `response` "
                         "(sft_biased: answer+1 on a fixed 65% of rows)."),
    # Levels a 1M-parameter model masters in a minute of SFT on 2 CPU cores: the task of the
    # out-of-the-box example, where RL must undo the warm start's off-by-one habit.
    "arith_easy": BuiltinTask("arith_easy", ("train", "val", "sft", "sft_biased"),
                              functools.partial(_write_arith, levels=(1, 2)),
                              "Levels 1-2 only: single-digit sums and two-digit plus one-digit."),
}


def _register_extra_tasks() -> None:
    from roll_gspo import builtin_tasks

    BUILTIN_TASKS.update({
        "code": BuiltinTask("code", ("train", "val"), builtin_tasks.write_code_task,
                            "One-line integer functions `f(x)=...` to complete after `def f(x): return `; "
                            "three assert tests per row (CodeSandboxRewardWorker, domain code_sandbox)."),
        "choice": BuiltinTask("choice", ("train", "val"), builtin_tasks.write_choice_task,
                              "Sums with three options answered by letter (MultipleChoiceRewardWorker, "
                              "domain multiple_choice)."),
        "mixed": BuiltinTask("mixed", ("train", "val"), builtin_tasks.write_mixed_task,
                             "A third each of arith_easy (math_rule), code (code_sandbox) and choice "
                             "(multiple_choice) rows."),
    })


_register_extra_tasks()


def builtin_data_names() -> List[str]:
    return [f"{BUILTIN_PREFIX}{t.name}/{s}" for t in BUILTIN_TASKS.values() for s in t.splits]


def write_builtin_task(name: str, folder: str, **sizes) -> str:
    """Write every split of task ``name`` as ``<folder>/<split>.jsonl`` (folder may exist).

    ``sizes`` go to the task writer (arith: seed, n_train, n_val, n_sft)."""
    task = BUILTIN_TASKS.get(name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name)
    if task is None:
        raise ValueError(f"unknown built-in task {name!r}; valid: {sorted(BUILTIN_TASKS)}")
    os.makedirs(folder, exist_ok=True)
    task.writer(folder, **sizes)
    return folder


def resolve_data_file(name_or_path: str, *, cache_dir: Optional[str] = None) -> str:
    """A data file path for a path or a built-in name such as ``builtin:arith/train``."""
    name = str(name_or_path).strip()
    if not name.startswith(BUILTIN_PREFIX):
        path = os.path.abspath(os.path.expanduser(name))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"data file {name!r} does not exist (check `data_args.file_name`; built-in data "
                f"sets: {', '.join(builtin_data_names())})")
        return path
    if name not in builtin_data_names():
        raise ValueError(f"unknown built-in data set {name!r}; valid: {', '.join(builtin_data_names())}")
    task_name, split = name[len(BUILTIN_PREFIX):].split("/", 1)
    folder = os.path.join(cache_root(cache_dir), "data", f"{task_name}-{TASK_FORMAT_VERSION}")
    build_atomically(folder, lambda tmp: write_builtin_task(task_name, tmp), what=f"task {task_name}")
    return os.path.join(folder, f"{split}.jsonl")
