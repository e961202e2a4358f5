"""The one typed schema of every key a pipeline reads.

Every field carries ``metadata["help"]`` (what it does, its default, what it trades off) and,
where the value is one of a fixed set, ``metadata["choices"]``. ``roll_gspo.config.loader``
validates a YAML against these dataclasses strictly; ``docs/config_reference.md`` is generated
from them (``python -m roll_gspo.config.reference``) and a test keeps the two in sync.

The layout follows ROLL's: run keys and algorithm keys at the top level, then one block per role
(``actor_train``, ``actor_infer``, ``reference``, ``rewards.<domain>``, ``validation``), each
with ``model_args``, ``training_args``, ``generating_args``, ``data_args`` and ``strategy_args``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# The choice sets, named once so the loader, the algorithm library and the docs agree.
IMPORTANCE_SAMPLING_CHOICES = ["seq", "token", "gspo-token"]
LOSS_AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ADV_ESTIMATORS = ["reinforce", "grpo", "rloo"]
REWARD_NORMS = [None, "group", "batch", "running"]
KL_ESTIMATORS = ["k1", "k2", "k3"]
OLD_LOGPROB_SOURCES = ["trainer", "rollout"]
WEIGHT_SYNC_TRANSPORTS = ["auto", "object_store", "collective"]
VLLM_WEIGHT_UPDATES = ["auto", "layerwise"]
DTYPES = ["fp32", "bf16", "fp16"]
TRAIN_STRATEGIES = ["deepspeed_train"]
INFER_STRATEGIES = ["vllm", "hf_infer"]
LR_SCHEDULERS = ["constant", "linear", "cosine"]
TRACKERS = ["tensorboard", "none"]
PIPELINES = ["rlvr", "sft"]


def _f(default: Any, help: str, choices: Optional[list] = None) -> Any:
    """A dataclass field with help text (and optional choices) attached as metadata."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = list(choices)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
    return field(default=default, metadata=metadata)


def _sub(cls: type, help: str) -> Any:
    """A nested-dataclass field with help text."""
    return field(default_factory=cls, metadata={"help": help})


# --------------------------------------------------------------------------------------------
# Per-role argument groups
# --------------------------------------------------------------------------------------------
@dataclass
class ModelArgs:
    model_name_or_path: Optional[str] = _f(
        None,
        "Model folder (Hugging Face format) or a built-in name such as `builtin:tiny-arith`. "
        "Null means the top-level `pretrain`.")
    dtype: str = _f(
        "fp32",
        "Parameter/compute dtype. fp32 is exact and what CPUs run fastest here; bf16 halves memory "
        "on GPUs but makes trainer and vLLM log-probs drift apart (up to 0.5 nats measured).",
        DTYPES)
    gradient_checkpointing: bool = _f(
        False,
        "Recompute activations in the backward pass (actor_train only): less memory, ~30% more "
        "compute.")
    attn_implementation: Optional[str] = _f(
        None, "transformers attention kernel (`eager`, `sdpa`, ...). Null lets transformers pick.")


@dataclass
class TrainingArgs:
    learning_rate: float = _f(1e-6, "Peak learning rate of AdamW (>= 0). GSPO tolerates somewhat higher "
                                    "rates than GRPO; too high collapses the policy.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    per_device_train_batch_size: int = _f(
        1, "Micro-batch: sequences per forward/backward on one rank. Larger is faster, uses more "
           "memory; the gradient does not depend on it.")
    gradient_accumulation_steps: int = _f(
        1, "Micro-batches accumulated per optimizer step. A mini-batch is "
           "per_device_train_batch_size * gradient_accumulation_steps * world_size sequences; the "
           "rollout batch is split into that many mini-batches (one optimizer step each).")
    warmup_steps: int = _f(0, "Optimizer steps of linear LR warm-up from 0 (>= 0).")
    lr_scheduler_type: str = _f("constant", "LR schedule after warm-up.", LR_SCHEDULERS)
    max_grad_norm: float = _f(1.0, "Gradient clipping by global norm (0 disables; negative is refused).")
    num_train_epochs: int = _f(1, "Passes over the data set (SFT pipeline only; an rlvr config that sets "
                                  "it is refused: max_steps counts its steps).")


@dataclass
class GeneratingArgs:
    max_new_tokens: Optional[int] = _f(None, "Generated tokens cap (>= 1). Null means `response_length`; "
                                             "0 is refused, not replaced.")
    temperature: float = _f(1.0, "Sampling temperature (>= 0). RL needs diversity inside a group: "
                                 "near 1.0 for training, 0 (greedy) for validation. The trainer scores "
                                 "at the same temperature.")
    top_p: float = _f(1.0, "Nucleus sampling, in (0, 1]. Values < 1 bias the rollout away from the policy "
                           "the trainer scores (full distribution), which the importance ratio does not "
                           "correct. With old_logprob_source: rollout on vLLM it needs temperature 1 (or 0), "
                           "else it is refused (see old_logprob_source).")
    top_k: int = _f(-1, "Top-k sampling (-1 or 0: off). Same caveats as top_p.")
    num_return_sequences: Optional[int] = _f(
        None, "Responses per prompt (>= 1). Null means `num_return_sequences_in_group` (training) or 1 "
              "(validation).")


@dataclass
class DataArgs:
    file_name: List[str] = _f(
        [], "Data files (JSONL, JSON or parquet; read with `datasets`) or built-in task sets such as "
            "`builtin:arith/train`. Each row holds `prompt` (or chat `messages`) and "
            "`ground_truth`, optionally `domain` to route it to a reward domain.")
    prompt_key: str = _f("prompt", "Column holding the prompt text.")
    messages_key: str = _f("messages", "Column holding chat messages (used when present; rendered "
                                       "with the tokenizer's chat template).")
    response_key: str = _f("response", "Column holding the target response (SFT only).")
    answer_key: str = _f("ground_truth", "Column holding the reference answer.")
    domain_key: str = _f("domain", "Column naming the reward domain; rows without it go to the "
                                   "first domain under `rewards`.")
    max_samples: Optional[int] = _f(None, "Keep only the first N rows (null: all).")
    shuffle: bool = _f(True, "Shuffle prompts each epoch (seeded by `seed`).")


@dataclass
class StrategyArgs:
    strategy_name: str = _f(
        "", "Backend of the role: `deepspeed_train` (actor_train, reference), `vllm` or `hf_infer` "
            "(actor_infer; hf_infer is transformers `generate`, slower, no extra engine).",
        [""] + TRAIN_STRATEGIES + INFER_STRATEGIES)
    strategy_config: Dict[str, Any] = _f(
        {}, "Backend options. deepspeed_train: a DeepSpeed config (e.g. "
            "`{zero_optimization: {stage: 3}}`); batch, LR, clipping and dtype entries are filled "
            "from training_args/model_args (a `bf16`/`fp16` `enabled` contradicting model_args.dtype "
            "is refused). vllm: `vllm.EngineArgs` keywords (e.g. `max_model_len`, `enforce_eager`); "
            "unknown ones are refused, and so are a `max_model_len` below prompt_length + "
            "response_length, a `dtype` or `model` contradicting model_args, and "
            "`generation_config`/`override_generation_config` (sampling comes from generating_args "
            "only). `logprobs_mode` is set by roll_gspo (see old_logprob_source).")


@dataclass
class RoleConfig:
    model_args: ModelArgs = _sub(ModelArgs, "Which model the role loads and how. actor_train and "
                                            "actor_infer must load the same folder (one policy).")
    training_args: TrainingArgs = _sub(TrainingArgs, "Optimizer and batch keys (actor_train only; set "
                                                     "elsewhere they are refused).")
    generating_args: GeneratingArgs = _sub(GeneratingArgs, "Sampling keys (actor_infer only; set "
                                                           "elsewhere they are refused).")
    data_args: DataArgs = _sub(DataArgs, "Training prompts or SFT data (actor_train only; set "
                                         "elsewhere they are refused).")
    strategy_args: StrategyArgs = _sub(StrategyArgs, "Backend and its options.")
    world_size: int = _f(1, "Ranks (Ray actors) of this role; data-parallel for training.")
    num_cpus_per_worker: float = _f(
        1.0, "Ray CPUs reserved per rank (> 0; each rank is one bundle of the role's placement "
             "group). Fractions let roles share a small machine's cores.")
    num_gpus_per_worker: float = _f(
        0.0, "Ray GPUs per rank. Fractions (e.g. 0.5 on actor_train and actor_infer) colocate "
             "roles on one GPU; 0 runs on CPU.")
    infer_batch_size: int = _f(16, "Sequences per forward pass when this role computes log-probs.")


@dataclass
class RewardConfig:
    worker_cls: str = _f(
        "roll_gspo.workers.rewards.MathRuleRewardWorker",
        "Import path of the reward worker class. Built in: `...MathRuleRewardWorker` (math-verify "
        "equivalence with the ground truth), `...RegexMatchRewardWorker` (exact or regex match), "
        "`...FunctionRewardWorker` (calls `reward_fn`).")
    reward_fn: Optional[str] = _f(
        None, "For FunctionRewardWorker: import path `pkg.module:function` (or `pkg.module.function`) "
              "of `fn(prompt: str, response: str, ground_truth: str) -> float`.")
    pattern: Optional[str] = _f(
        None, "For RegexMatchRewardWorker: a regex whose first group (or whole match) is compared "
              "with the ground truth. Null: the stripped response must equal it.")
    tag_included: List[str] = _f(
        [], "Data domains this worker scores. Empty: the domain named by this block's key.")
    world_size: int = _f(1, "Reward worker actors for this domain.")
    num_cpus_per_worker: float = _f(0.1, "Ray CPUs reserved per reward worker.")
    timeout_s: float = _f(
        10.0, "Seconds one response may take to score. A reward that raises or times out scores "
              "0 and is counted in `reward/errors` / `reward/timeouts`; the run goes on.")
    reward_kwargs: Dict[str, Any] = _f({}, "Extra keyword arguments passed to the reward function.")


@dataclass
class ValidationConfig:
    data_args: DataArgs = _sub(DataArgs, "Held-out prompts (e.g. `builtin:arith/val`).")
    generating_args: GeneratingArgs = field(
        default_factory=lambda: GeneratingArgs(temperature=0.0),
        metadata={"help": "Sampling for validation; greedy (temperature 0) by default."})


# --------------------------------------------------------------------------------------------
# The pipeline config
# --------------------------------------------------------------------------------------------
@dataclass
class PipelineConfig:
    # --- run keys ---
    pipeline: str = _f("rlvr", "Which pipeline `run_pipeline.py` runs: `rlvr` (GSPO/GRPO with "
                               "verifiable rewards) or `sft` (supervised fine-tuning).", PIPELINES)
    exp_name: str = _f("roll_gspo", "Experiment name, used in log lines and tracker runs.")
    seed: int = _f(42, "Seed of data order, sampling and initialisation.")
    output_dir: str = _f("./output/${exp_name}", "Checkpoints, metrics.jsonl, plots and the final "
                                                 "model go here. Never suffixed with a timestamp, "
                                                 "so a resume finds it.")
    logging_dir: Optional[str] = _f(None, "TensorBoard event files. Null: `<output_dir>/tensorboard`.")
    max_steps: int = _f(100, "Pipeline steps (one rollout batch each).")
    save_steps: int = _f(0, "Checkpoint every N steps, and at the end (0: only at the end).")
    eval_steps: int = _f(0, "Validate every N steps, at step 0 and at the end (0: never).")
    logging_steps: int = _f(1, "Print a metrics line every N steps (metrics.jsonl gets every step).")
    save_total_limit: int = _f(2, "Checkpoints kept on disk; older ones are deleted after a newer "
                                  "one is complete.")
    resume_from_checkpoint: Optional[str] = _f(
        None, "`auto`: resume from the newest complete checkpoint in output_dir if any; a path: "
              "that checkpoint; null: start fresh (refused if output_dir already has checkpoints, "
              "so nothing is overwritten silently).")
    track_with: str = _f("tensorboard", "Metric tracker besides metrics.jsonl.", TRACKERS)
    tracker_kwargs: Dict[str, Any] = _f({}, "Extra options for the tracker (e.g. `flush_secs`).")
    pretrain: str = _f("builtin:tiny-arith", "Policy model: a folder in Hugging Face format or a "
                                             "built-in name (`builtin:tiny-arith`).")
    reward_pretrain: Optional[str] = _f(None, "Model for model-based reward workers (unused by the "
                                              "rule rewards).")

    # --- GSPO / rollout keys (ROLL's names) ---
    adv_estimator: str = _f(
        "grpo", "Advantage estimator: `grpo` (group z-score), `rloo` (leave-one-out baseline), "
                "`reinforce` (reward-to-go; pair with reward_norm or whitening for a baseline).",
        ADV_ESTIMATORS)
    importance_sampling: str = _f(
        "seq", "`seq`: GSPO's length-normalised sequence ratio; `token`: PPO/GRPO per-token ratio; "
               "`gspo-token`: sequence ratio with per-token advantages (equals `seq` when advantages "
               "are per response).", IMPORTANCE_SAMPLING_CHOICES)
    rollout_batch_size: int = _f(64, "Prompts per step.")
    num_return_sequences_in_group: int = _f(
        8, "Responses per prompt (G). A step trains on rollout_batch_size * G responses. Larger G "
           "gives a better group baseline at proportional rollout cost.")
    prompt_length: int = _f(2048, "Maximum prompt tokens; longer prompts are filtered out and "
                                  "counted (`data/filtered_prompts`).")
    response_length: int = _f(4096, "Maximum generated tokens per response.")
    ppo_epochs: int = _f(1, "Passes over each rollout batch. Optimizer steps per rollout = "
                            "ppo_epochs * number of mini-batches; exactly 1 or more than 16 warns.")
    pg_clip_low: float = _f(3e-4, "Lower clip: ratios below 1 - pg_clip_low are clipped. GSPO "
                                  "paper: 3e-4 (sequence ratios live near 1); GRPO: 0.2.")
    pg_clip_high: float = _f(4e-4, "Upper clip: ratios above 1 + pg_clip_high are clipped. GSPO "
                                   "paper: 4e-4; GRPO (clip-higher): 0.27.")
    dual_clip_loss: bool = _f(False, "Dual clip: for negative advantages, cap the loss at "
                                     "-dual_clip_c * A so one huge ratio cannot dominate.")
    dual_clip_c: float = _f(3.0, "Dual-clip constant c > 1 (3.0 as in the dual-clip PPO paper).")
    use_kl_loss: bool = _f(False, "Add kl_loss_coef * KL(policy || reference) to the loss (starts "
                                  "the reference role). The GSPO paper uses none.")
    kl_loss_coef: float = _f(0.001, "Weight of the KL loss (>= 0).")
    kl_estimator: str = _f("k3", "Per-token KL estimator: k1 (log-ratio), k2 (half squared), k3 "
                                 "(low-variance, always >= 0).", KL_ESTIMATORS)
    add_token_level_kl: bool = _f(False, "Subtract init_kl_coef * (old_logp - ref_logp) from each "
                                         "token's reward before advantages (starts the reference).")
    init_kl_coef: float = _f(0.2, "Coefficient of the token-level KL penalty (>= 0).")
    loss_agg_mode: str = _f(
        "seq-mean-token-mean", "How the per-token loss matrix becomes a scalar. "
        "`seq-mean-token-mean` with importance_sampling seq is exactly GSPO's objective; "
        "`token-mean` weights long responses more; `seq-mean-token-sum` favours long responses; "
        "`seq-mean-token-sum-norm` divides by a constant length (Dr.GRPO).", LOSS_AGG_MODES)
    loss_norm_length: Optional[int] = _f(None, "T_norm of `seq-mean-token-sum-norm` (>= 1). Null: "
                                               "response_length; 0 is refused, not replaced.")
    whiten_advantages: bool = _f(False, "Masked z-score of advantages over the batch.")
    advantage_clip: Optional[float] = _f(None, "Clamp advantages to [-c, c] (null: off).")
    reward_clip: Optional[float] = _f(None, "Clamp rewards to [-c, c] after normalisation (null: off).")
    reward_norm: Optional[str] = _f(
        None, "Reward normalisation before the estimator: null, `group` (per prompt), `batch`, "
              "`running` (running statistics, saved in checkpoints). `group` with one response per "
              "group (or `batch` with one per batch) is refused: it turns every reward into 0.",
        REWARD_NORMS)
    reward_shift: bool = _f(False, "With reward_norm: only subtract the mean.")
    reward_scale: bool = _f(False, "With reward_norm: only divide by the std. Both false: full "
                                   "z-score; both true is an error.")
    old_logprob_source: str = _f(
        "trainer", "`trainer`: recompute old log-probs with the training engine (one extra forward "
                   "pass, exact); `rollout`: use the rollout engine's sampled-token log-probs (saves the "
                   "pass; GSPO's sequence ratio tolerates the engines' small float mismatch). They are "
                   "the trainer's full-distribution log-probs: hf_infer re-scores the responses; vLLM "
                   "reports `processed_logprobs` without top-p/top-k and `raw_logprobs` with them at "
                   "temperature 1 (or 0). vLLM with top_p < 1 or top_k > 0 at any other temperature "
                   "has no exact mode, and a `logprobs_mode` in strategy_config overrides the choice: "
                   "both are refused with `rollout`. The mean |trainer - rollout| gap is logged either "
                   "way when both are available.",
        OLD_LOGPROB_SOURCES)
    model_update_frequency: int = _f(
        1, "Push trained weights to the rollout engine every N steps. N > 1 warns: rollouts between "
           "syncs come from weights up to N-1 updates old and nothing corrects for it (the ratio "
           "measures the change from the trainer's weights, or from the stale ones with "
           "old_logprob_source: rollout).")
    weight_sync_bucket_mb: float = _f(256.0, "Weights are sent to vLLM in buckets of at most this "
                                             "many MB (> 0; bounds the extra memory of a sync).")
    weight_sync_transport: str = _f(
        "auto", "How weight buckets reach the rollout ranks. auto: collective when the sending "
                "trainer rank has a GPU; otherwise one reused shared-memory segment to ranks on the "
                "trainer's node (needs /dev/shm room for 2 buckets; falls back with a warning) and Ray's "
                "object store to the others. object_store: always the object store (slower on one "
                "node; for debugging or a small /dev/shm). collective: a torch.distributed group of its "
                "own (gloo on CPU, NCCL on GPUs) between trainer rank 0 and every rollout worker (each "
                "vLLM tensor-parallel worker included), one broadcast per bucket; any node.",
        WEIGHT_SYNC_TRANSPORTS)
    weight_sync_timeout_s: float = _f(
        600.0, "Deadline (> 0) of each step of a weight sync: forming the collective group, every "
               "broadcast, every rollout rank's load of a bucket. A rollout worker that dies or hangs "
               "mid-sync then fails the run with an error naming it instead of blocking it.")
    vllm_weight_update: str = _f(
        "auto", "How vLLM takes the new weights. auto: on CPU with an unquantized model, each linear "
                "layer keeps a plain copy of its weight (vLLM frees it after packing it for oneDNN; "
                "the copy doubles the rollout rank's linear-weight memory), the buckets are copied "
                "into it and each layer is re-packed, about 20 ms less per sync than layerwise; "
                "elsewhere layerwise. layerwise: always vLLM's layerwise reload (any model and "
                "quantization, no extra memory).",
        VLLM_WEIGHT_UPDATES)

    # --- roles ---
    actor_train: RoleConfig = field(
        default_factory=lambda: RoleConfig(strategy_args=StrategyArgs(strategy_name="deepspeed_train")),
        metadata={"help": "The policy being trained (DeepSpeed ZeRO ranks)."})
    actor_infer: RoleConfig = field(
        default_factory=lambda: RoleConfig(strategy_args=StrategyArgs(strategy_name="vllm")),
        metadata={"help": "Rollout engine ranks (vLLM or hf_infer)."})
    reference: RoleConfig = field(
        default_factory=lambda: RoleConfig(strategy_args=StrategyArgs(strategy_name="deepspeed_train")),
        metadata={"help": "Frozen reference model; started only when use_kl_loss or "
                          "add_token_level_kl needs it."})
    rewards: Dict[str, RewardConfig] = field(
        default_factory=lambda: {"math_rule": RewardConfig()},
        metadata={"help": "Reward workers per data domain (`rewards.<domain>.*`)."})
    validation: ValidationConfig = _sub(ValidationConfig, "Held-out evaluation every eval_steps.")
