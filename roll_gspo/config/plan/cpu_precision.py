"""Half precision on CPUs: a role whose weights are bf16 or fp16 runs fast only where the CPU has
matrix instructions for that type; elsewhere every matmul converts its operands and runs at a
fraction of the fp32 speed.

Measured on this project's 2-core AMD EPYC (AVX512-BF16, no AVX512-FP16 or AMX; torch 2.13, 2
threads, under load): matmuls of 256-4096 rows by 576-2048 reach 50-180 GFLOP/s in fp32, 125-200 in
bf16, and 10-18 in fp16 (0.2-0.6 where an operand needs a copy). So fp16 on a CPU without fp16
instructions is refused, naming the key (a run would take 5-20 times as long as in bf16, for
nothing), and bf16 on a CPU without bf16 instructions is warned about (converted matmuls: no
faster than fp32, and the trainer-vs-rollout gap of half precision all the same). Machines of the
project's kind differ here: on a 2-core Intel Xeon with AVX512 but no AVX512-BF16 or AMX (2026-11-29,
2 threads, quiet), 2048 x 2048 matmuls ran at 325 GFLOP/s in fp32 and 61 in bf16, and a 0.5B-shape
GSPO step took 556 s in bf16 against 127-ish in fp32 (docs/benchmarks.md).

The CPU checked is this machine's: a CPU run's ranks run here (or, on a CPU Ray cluster, on
machines assumed to be like it). Roles placed on GPUs are not checked.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

from roll_gspo.config.findings import Finding, error, notice, warning
from roll_gspo.schema.config import PipelineConfig

# /proc/cpuinfo flags of the matrix instructions each half-precision dtype needs to run fast.
NATIVE_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> Tuple[str, ...]:
    """This machine's CPU flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return tuple(line.split(":", 1)[1].split())
    except OSError:
        pass
    return ()


def native_half_dtypes(flags: Tuple[str, ...]) -> Dict[str, bool]:
    """{dtype: whether the CPU with these flags has matrix instructions for it}."""
    return {dtype: any(flag in flags for flag in needed) for dtype, needed in NATIVE_FLAGS.items()}


def resolve_auto_dtypes(cfg: PipelineConfig, flags: Tuple[str, ...] = ()) -> List[Finding]:
    """In place, at load (after the CPU adaptation, before validation): every `model_args.dtype:
    auto` set to the faster precision of the hardware its role runs on: bf16 on a GPU and on a CPU
    with bf16 matrix instructions (`flags`, default /proc/cpuinfo's), else fp32 (bf16 converted
    on each matmul ran ~5x slower than fp32 on such a CPU). One notice per choice, naming its keys."""
    from roll_gspo.config.plan.cpu_run import placed_on_gpu, rank_blocks

    chosen: Dict[Tuple[str, str], List[str]] = {}
    cpu_bf16: Optional[bool] = None
    for name, role in rank_blocks(cfg).items():
        if role.model_args.dtype != "auto":
            continue
        if placed_on_gpu(role):
            dtype, why = "bf16", ("a GPU role (bf16 assumes an NVIDIA Ampere or newer GPU; write fp32 or fp16 for an "
                                  "older one)")
        else:
            if cpu_bf16 is None:
                cpu_bf16 = native_half_dtypes(flags or cpu_flags())["bf16"]
            dtype, why = (("bf16", "this CPU has bf16 matrix instructions (AVX512-BF16 or AMX-BF16)") if cpu_bf16 else
                          ("fp32", "this CPU has no bf16 matrix instructions (AVX512-BF16 or AMX-BF16), so bf16 "
                                   "matmuls would be converted, ~5x slower than fp32; fp32 also keeps the trainer's "
                                   "and the rollout engine's log-probs equal"))
        role.model_args.dtype = dtype
        chosen.setdefault((dtype, why), []).append(f"{name}.model_args.dtype")
    return [notice(key, f"dtype: auto -> {dtype}: {why}", f"keys: {', '.join(keys)}", source="cpu_precision")
            for (dtype, why), keys in chosen.items() for key in keys]


def _model_roles(cfg: PipelineConfig) -> Dict[str, object]:
    """The roles that load a model and would compute in model_args.dtype, by name."""
    roles: Dict[str, object] = {"actor_train": cfg.actor_train}
    if cfg.has_rollout():
        roles["actor_infer"] = cfg.actor_infer
        if cfg.needs_reference():
            roles["reference"] = cfg.reference
    if cfg.critic is not None:
        roles["critic"] = cfg.critic
    if cfg.uses_teacher():
        roles.update(cfg.teacher_roles())
    return roles


def cpu_precision_findings(cfg: PipelineConfig, flags: Tuple[str, ...] = ()) -> List[Finding]:
    """An error per CPU role in fp16 and a warning per CPU role in bf16 where this CPU (`flags`,
    default /proc/cpuinfo's) has no matrix instructions for that dtype. Nothing where the flags
    cannot be read (another OS): the check cannot tell."""
    flags = flags or cpu_flags()
    if not flags:
        return []
    native = native_half_dtypes(flags)
    found: List[Finding] = []
    for name, role in _model_roles(cfg).items():
        dtype = role.model_args.dtype  # type: ignore[attr-defined]
        on_gpu = role.device_mapping is not None or bool(role.num_gpus_per_worker)  # type: ignore[attr-defined]
        if on_gpu or dtype == "fp32" or native[dtype]:
            continue
        key = f"{name}.model_args.dtype"
        if dtype == "fp16":
            better = "bf16 (this CPU has bf16 matrix instructions) or fp32" if native["bf16"] else "fp32"
            found.append(error(key, f"{key} = fp16 on a CPU without fp16 matrix instructions (AVX512-FP16 or "
                                    f"AMX-FP16): every fp16 matmul is converted, measured 5-20x slower than bf16 "
                                    f"on an AVX512-BF16 CPU", f"use {better}"))
        else:
            found.append(warning(key, f"{key} = bf16 on a CPU without bf16 matrix instructions (AVX512-BF16 or "
                                      f"AMX-BF16): bf16 matmuls are converted (measured ~5x slower than fp32 on "
                                      f"such a 2-core Xeon), while the trainer's and the rollout engine's log-probs "
                                      f"still drift apart (rollout/logprob_gap)", "fp32 is faster here and exact"))
    return found
