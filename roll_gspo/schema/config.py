"""The one typed schema of every key a pipeline reads.

Every field carries ``metadata["help"]`` (what it does, its default, what it trades off) and,
where the value is one of a fixed set, ``metadata["choices"]``. ``roll_gspo.config.load.loader``
validates a YAML against these dataclasses strictly; ``docs/config_reference.md`` is generated
from them (``python -m roll_gspo.config.load.config_reference``) and a test keeps the two in sync.

The layout follows ROLL's: run keys and algorithm keys at the top level, then one block per role
(``actor_train``, ``actor_infer``, ``reference``, ``rewards.<domain>``, ``validation``), each
with ``model_args``, ``training_args``, ``generating_args``, ``data_args`` and ``strategy_args``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, TypeGuard

from roll_gspo.catalog import engines, estimators, policy_losses, reward_workers
from roll_gspo.schema.frozen import SchemaBlock

# The choice sets, named once so the loader, the algorithm library and the docs agree.
IMPORTANCE_SAMPLING_CHOICES = ["seq", "token", "gspo-token"]
LOSS_AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# policy_loss's values and ROLL's actor_train.pg_variant (roll_gspo.catalog.policy_losses).
POLICY_LOSS_CHOICES = policy_losses.choices()
ROLL_PG_VARIANTS = [None] + list(policy_losses.ROLL_PG_VARIANTS)
# Estimator facts (critic, pipelines, granularity) are declared once in roll_gspo.catalog.estimators.
ADV_ESTIMATORS = estimators.names()
REWARD_NORMS = [None, "group", "batch", "running"]
KL_ESTIMATORS = ["k1", "k2", "k3"]
OLD_LOGPROB_SOURCES = ["auto", "trainer", "rollout"]
WEIGHT_SYNC_TRANSPORTS = ["auto", "object_store", "collective"]
VLLM_WEIGHT_UPDATES = ["auto", "layerwise"]
DTYPES = ["fp32", "bf16", "fp16"]
# Engine facts (the roles each runs, sleep, parallelism, log-probs) are declared once in roll_gspo.catalog.engines.
TRAIN_STRATEGIES = engines.names("actor_train")
INFER_STRATEGIES = engines.names("actor_infer")
# ROLL's names of frozen engines (the reference role): the training engines without an optimizer.
FROZEN_STRATEGIES = engines.frozen_names()
# ROLL's dtype spellings in an FSDP2 strategy_config -> this project's names (model_args.dtype).
FSDP2_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                "fp32": "fp32", "float32": "fp32", "float": "fp32"}
# Chat templates by name (roll_gspo.data.chat_templates); null keeps the data's own form.
CHAT_TEMPLATES = [None, "native", "qwen2_5", "qwen3", "chatml", "empty", "longcot_V3"]
NORM_TYPES = [None, "group", "batch", "running"]
MODEL_TYPES = [None, "trl", "auto_sequence_classification", "auto_token_classification",
               "diffusion_module"]
CHECKPOINT_TYPES = ["file_system"]
LR_SCHEDULERS = ["constant", "linear", "cosine"]
TRACKERS = ["tensorboard", "wandb", "swanlab", "mlflow", "stdout", "none"]
QUERY_FILTERS = ["no_filter", "mean_filter", "std_filter"]
PIPELINES = ["rlvr", "sft", "agentic"]
# ROLL's env managers (roll.pipeline.agentic.env_manager.*) -> how trajectories become samples here.
ENV_MANAGERS = ["traj", "step"]
REWARD_GROUPINGS = ["traj_group_id", "tags", "batch"]
REWARD_NORM_METHODS = ["mean_std", "mean", "identity"]
# The judge's token budget when `generating_args.max_new_tokens` is unset: the default prompt asks
# it to think briefly before the verdict line, which 64 tokens (the old default) cut off, scoring
# the response 0 as `error`. (roll_gspo.rewards.judge re-exports it for the judge worker.)
DEFAULT_JUDGE_MAX_NEW_TOKENS = 512


# Who reads the policy's size (PipelineConfig.policy_parameters): installed by roll_gspo.config.plan.model_shape.
_POLICY_SIZE_READERS: List[Callable[["PipelineConfig"], Optional[int]]] = []


def install_policy_size_reader(reader: Callable[["PipelineConfig"], Optional[int]]) -> None:
    """Let `PipelineConfig.policy_parameters` read the policy's size with `reader` (the config
    package's; the schema imports nothing above itself)."""
    _POLICY_SIZE_READERS[:] = [reader]


def _f(default: Any, help: str, choices: Optional[list] = None) -> Any:
    """A dataclass field with help text (and optional choices) attached as metadata."""
    metadata: Dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = list(choices)
    if isinstance(default, (list, dict)):
        return field(default_factory=_copier(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _copier(default: Any) -> Callable[[], Any]:
    """A default factory: a fresh copy of a list or dict default for each instance."""
    return lambda: type(default)(default)


def _alias(target: str, help: str, default: Any = None, invert: bool = False) -> Any:
    """A ROLL name for the field `target` of the same block. Setting it sets `target` (negated
    when `invert`); setting both to different values is an error (roll_compat.resolve_aliases)."""
    metadata = {"help": f"ROLL's name for `{target}`{' (negated)' if invert else ''}. {help}",
                "alias_of": target, "alias_invert": invert}
    return field(default=default, metadata=metadata)


def _refused_unless(default: Any, help: str, reason: str) -> Any:
    """A ROLL key accepted at `default` (ROLL's "off" value, which is what runs here) and refused
    with `reason` at any other value, because what it switches on is not built here."""
    metadata = {"help": f"{help} Only `{default}` is accepted: {reason}", "refused_unless": default,
                "refusal": reason}
    if isinstance(default, (list, dict)):
        return field(default_factory=_copier(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _sub(cls: type, help: str) -> Any:
    """A nested-dataclass field with help text."""
    return field(default_factory=cls, metadata={"help": help})


# --------------------------------------------------------------------------------------------
# Per-role argument groups
# --------------------------------------------------------------------------------------------
@dataclass
class ModelArgs(SchemaBlock):
    model_name_or_path: Optional[str] = _f(
        None,
        "Model folder (Hugging Face format) or a built-in name such as `builtin:tiny-arith`. "
        "Null means the top-level `pretrain`.")
    dtype: str = _f(
        "fp32",
        "Parameter and compute dtype. `fp32`: trainer and vLLM log-probs agree; `bf16`: half the weight memory, "
        "faster where the hardware has bf16, a larger trainer-vs-rollout gap; `auto` (not ROLL's): bf16 on a GPU or"
        " a CPU with bf16 instructions, else fp32, named in a notice "
        "([training_speed.md](training_speed.md#bf16-on-cpu-what-each-engine-keeps-in-which-precision)).",
        DTYPES + ["auto"])
    gradient_checkpointing: bool = _f(
        False,
        "Recompute activations in the backward pass (actor_train only): less memory, ~30% more "
        "compute.")
    attn_implementation: Optional[str] = _f(
        None, "transformers attention kernel (`eager`, `sdpa`, `flash_attention_2`; ROLL's `fa2` "
              "means flash_attention_2, which needs a CUDA GPU and the flash-attn package). Null "
              "lets transformers pick.")
    # --- ROLL's names and keys (roll_gspo.config.roll.roll_compat) ---
    disable_gradient_checkpointing: Optional[bool] = _alias(
        "gradient_checkpointing", "ROLL's default (false) turns checkpointing on for training "
        "roles; frozen roles ignore it as ROLL does.", invert=True)
    model_type: Optional[str] = _f(
        None, "ROLL's model head: null is a causal LM (every policy role); `trl`, `auto_sequence_classification` "
              "and `auto_token_classification` are reward-model heads, and a critic's value model takes null, `trl`"
              " or `auto_token_classification`.", MODEL_TYPES)
    ulysses_size: int = _refused_unless(
        1, "ROLL's DeepSpeed-Ulysses sequence-parallel group size.",
        "sequence parallelism is not built here; with 1 every rank holds whole sequences (same "
        "result, more activation memory per rank).")
    # --- LoRA (ROLL's keys; checked in roll_gspo.config.checks.lora, docs/lora.md) ---
    lora_target: Optional[str] = _f(
        None, "The LoRA switch (null: full-parameter training): the modules that get an adapter, as a comma list of"
              " module names (`q_proj,v_proj`), `all-linear` (every linear layer but the LM head) or a regex over "
              "whole module names ([lora.md](lora.md#keys)).")
    lora_rank: Optional[int] = _f(None, "LoRA rank r (>= 1). Null: 8 (ROLL's default).")
    lora_alpha: Optional[int] = _f(
        None, "LoRA alpha; the update is scaled by lora_alpha / lora_rank. Null: 2 x lora_rank (ROLL's default).")
    lora_dropout: float = _f(
        0.0, "PEFT's dropout on the adapter's input, in [0, 1). Accepted for ROLL's files, but every forward pass "
             "here runs without dropout (old and new log-probs must score one policy), so it has no effect.")
    additional_target: Optional[str] = _f(
        None, "Modules trained in full beside the adapters (PEFT's modules_to_save; comma list of module "
              "names), saved in the adapter and merged into the synced weights. Refused with "
              "lora_sync: adapter (vLLM's adapters hold LoRA matrices only).")
    adapter_name_or_path: Optional[str] = _f(
        None, "A PEFT adapter folder (adapter_config.json and adapter weights, e.g. a run's "
              "`final_model/adapter`) to start from instead of a fresh adapter. Its targets, rank and alpha "
              "fill the lora_* keys left null (written ones must agree); turns LoRA on by itself. Its shapes "
              "must fit the model (checked by --dry-run). The reference (adapter disabled) is the base model.")

    def uses_lora(self) -> bool:
        """This role trains (or samples) a LoRA adapter on the model instead of all its weights."""
        return self.lora_target is not None or self.adapter_name_or_path is not None


@dataclass
class TrainingArgs(SchemaBlock):
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
    max_grad_norm: float = _f(1.0, "Gradient clipping by global norm (0 disables).")
    num_train_epochs: int = _f(1, "Passes over the data set (SFT pipeline only). An rlvr run ignores it, as "
                                  "ROLL does (max_steps counts its steps): accepted with one notice.")


@dataclass
class GeneratingArgs(SchemaBlock):
    max_new_tokens: Optional[int] = _f(None, "Generated tokens cap (>= 1). Null means `response_length`.")
    temperature: float = _f(1.0, "Sampling temperature (>= 0). RL needs diversity inside a group: "
                                 "near 1.0 for training, 0 (greedy) for validation. The trainer scores "
                                 "at the same temperature.")
    top_p: float = _f(1.0, "Nucleus sampling, in (0, 1]. Values < 1 bias the rollout away from the policy the "
                           "trainer scores (full distribution), which the importance ratio does not correct "
                           "([algorithm.md](algorithm.md#old-log-probs-old_logprob_source)).")
    top_k: int = _f(-1, "Top-k sampling (-1 or 0: off). Same caveats as top_p.")
    num_return_sequences: Optional[int] = _f(
        None, "Responses per prompt (>= 1). Null means `num_return_sequences_in_group` (training) or 1 "
              "(validation).")
    num_beams: int = _refused_unless(
        1, "ROLL's beam count.", "beam search is not built (RL needs sampled responses whose "
        "probabilities the trainer scores; beams are not samples of the policy).")


@dataclass
class DataArgs(SchemaBlock):
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
    # --- ROLL's names and keys (roll_gspo.config.roll.roll_compat) ---
    template: Optional[str] = _f(
        None, "Chat template applied to every prompt (a `prompt` row as one user turn): `native` the tokenizer's "
              "own, `qwen2_5` / `qwen3` / `chatml` / `empty` ChatML forms, `longcot_V3` the tokenizer's then "
              "`<think>\\n`. Null: `messages` rows use the tokenizer's template, `prompt` rows are used as written "
              "([data_and_rewards.md](data_and_rewards.md#data)).", CHAT_TEMPLATES)
    tag_key: str = _f("tag", "Column naming a row's tag; a row without `domain` goes to the reward "
                             "block whose tag_included lists its tag.")
    tag: Optional[str] = _alias("tag_key", "Column of the data tag.")
    messages: Optional[str] = _alias("messages_key", "Column of chat messages (a list of "
                                                     "{role, content}, or its JSON string).")
    prompt: Optional[str] = _alias("prompt_key", "Column of the prompt text.")
    dataset_dir: Optional[str] = _f(
        None, "Folder relative data file names are looked up in first (then as written). ROLL "
              "declares no such field and silently ignores it; its YAMLs write file names that "
              "already start with it, which the fallback keeps working.")
    preprocessing_num_workers: Optional[int] = _f(
        None, "Processes that template and tokenize the prompts (datasets.map num_proc). Null or "
              "1: in this process.")
    interleave_probs: Optional[str] = _refused_unless(
        None, "ROLL's per-file sampling probabilities (a comma-separated string). ROLL declares no "
              "such field and drops it: its files are concatenated, as here; `\"1.0\"` (the value "
              "in ROLL's YAMLs) is accepted as meaning that.",
        "per-file sampling is not built; the files are concatenated (use "
        "`domain_interleave_probs` for a per-domain mix).")
    domain_interleave_probs: Dict[str, float] = _f(
        {}, "ROLL's per-domain mix of each rollout batch (actor_train): reward domain -> share, e.g. `{math_rule: "
            "0.75, code: 0.25}`, each domain from its own shuffled stream; empty: one stream over all rows "
            "([data_and_rewards.md](data_and_rewards.md#dynamic-sampling-and-domain-mix)).")


@dataclass
class StrategyArgs(SchemaBlock):
    strategy_name: str = _f(
        "", "Backend of the role: `deepspeed_train` or `fsdp2_train` (actor_train), `vllm` or `hf_infer` "
            "(actor_infer; transformers `generate`), `deepspeed_infer` or `fsdp2_infer` (the reference, a frozen "
            "engine) ([training_speed.md](training_speed.md#which-training-engine-zero-2-zero-3-or-fsdp2)).",
        [""] + TRAIN_STRATEGIES + INFER_STRATEGIES + FROZEN_STRATEGIES)
    strategy_config: Dict[str, Any] = _f(
        {}, "The role's engine options: a DeepSpeed config for deepspeed_* (ROLL's `${deepspeed_zero3}` presets "
            "too), `vllm.EngineArgs` keywords and ROLL's `sleep_level` for vllm, ROLL's FSDP2 keys for fsdp2_* "
            "([FSDP2 strategy_config](#fsdp2-strategy_config)); null means {}. Batch, learning-rate and dtype "
            "entries come from training_args and model_args ([gpu.md](gpu.md)).")

    @property
    def engine(self) -> engines.EngineKind:
        """The catalog's facts of `strategy_name` (none holds for an empty or unbuilt name)."""
        return engines.engine_of(self.strategy_name)


@dataclass
class FSDP2WrapPolicy(SchemaBlock):
    transformer_layer_cls_to_wrap: List[str] = _f(
        [], "Module classes (class names, e.g. `[Qwen2DecoderLayer]`) each instance of which is sharded as "
            "one unit: its parameters are gathered for its forward/backward and freed after. Empty: the "
            "model's own `_no_split_modules` (its decoder layers). A name no module of the model has is "
            "refused when the strategy starts.")
    wrap_embeddings: bool = _f(
        False, "Shard the input embedding as a unit of its own (else it is gathered with the root). "
               "Refused for a model whose LM head shares the embedding's weight (tie_word_embeddings).")
    wrap_lm_output: bool = _f(
        False, "Shard the LM head as a unit of its own; refused with tied embeddings, as wrap_embeddings.")
    moe_experts: List[str] = _refused_unless(
        [], "ROLL's MoE expert classes sharded one expert at a time.",
        "per-expert units need every rank to run every expert in step (ROLL's apply_expert_patch), which "
        "is not built; experts are sharded with their decoder layer.")


@dataclass
class FSDP2StrategyConfig(SchemaBlock):
    """`strategy_config` of fsdp2_train / fsdp2_infer: ROLL's FSDP2 keys. Checked like every block
    (unknown keys, types, refusals); read by roll_gspo.strategies.fsdp2_strategy."""
    fsdp_size: int = _f(
        1, "Ranks one copy of the model is sharded over. <= 1 or >= world_size: all of the role's ranks (FSDP; "
           "ROLL's recipes write their GPU count, which on fewer ranks means this). In between: HSDP, world_size / "
           "fsdp_size replicas each sharded fsdp_size ways, gradients reduce-scattered in a replica then "
           "all-reduced across replicas.")
    param_dtype: Optional[str] = _f(
        None, "Compute dtype of the gathered parameters (FSDP2 MixedPrecisionPolicy.param_dtype). Null: "
              "model_args.dtype, which sets it here. fsdp2_train keeps the sharded master weights and Adam's states"
              " in fp32 whatever this is.",
        [None] + list(FSDP2_DTYPES))
    reduce_dtype: Optional[str] = _f(
        None, "Dtype gradients are reduce-scattered and accumulated in (MixedPrecisionPolicy.reduce_dtype). "
              "Null: fp32 with enable_mix_precision (the default), else the compute dtype. A frozen role "
              "(fsdp2_infer) reduces nothing: accepted there with a notice.",
        [None] + list(FSDP2_DTYPES))
    enable_mix_precision: bool = _f(
        True, "ROLL's switch: true reduces gradients in fp32, false in the compute dtype (reduce_dtype "
              "wins when written). ROLL also computes in bf16 whenever it is true; here model_args.dtype "
              "sets the compute dtype. fsdp2_infer: accepted with a notice.")
    reshard_after_forward: Optional[bool] = _f(
        None, "true: each unit frees its gathered parameters after its forward and gathers them again "
              "for the backward (least memory, one more all-gather per unit; ZeRO-3-like); false: they "
              "stay gathered from forward to backward (more memory, less communication; ZeRO-2-like). "
              "Null: true for the units, false for the root (torch's default).")
    offload_policy: bool = _f(
        False, "FSDP2's CPUOffloadPolicy: sharded parameters, gradients and Adam's states stay in host "
               "memory and the optimizer steps there; each unit is copied to the device for its compute "
               "(least device memory, slowest). On a CPU-only machine they are in host memory anyway. "
               "Between phases (is_offload_states) only the optimizer side then moves.")
    reduce_scatter_during_grad_accumulation: bool = _f(
        True, "true: gradients are reduce-scattered after every micro-batch and accumulated sharded (least "
              "memory); false: each rank accumulates the full gradient and it is reduced once, at the "
              "mini-batch's last micro-batch (less communication, a whole gradient of memory per rank). "
              "fsdp2_infer: accepted with a notice.")
    wrap_policy: FSDP2WrapPolicy = _sub(FSDP2WrapPolicy, "Which modules are sharded as units of their own.")
    async_save_ckpt: bool = _refused_unless(
        False, "ROLL's asynchronous DCP checkpoint write.",
        "checkpoints are written synchronously, fsynced and published by an atomic rename "
        "([crash_safety.md](crash_safety.md)); an asynchronous write could publish a folder before its "
        "shards are on disk.")
    save_only_model: bool = _refused_unless(
        False, "ROLL's checkpoints without optimizer state.",
        "a checkpoint holds the optimizer, LR schedule and RNG so that a resume continues exactly.")
    use_batched_model_update: bool = _refused_unless(
        False, "ROLL's batched parameter gather in the weight sync.",
        "the sync gathers one parameter at a time into buckets of weight_sync_bucket_mb (set that instead).")
    apply_expert_patch: bool = _refused_unless(
        False, "ROLL's MoE patch that runs every expert on every rank (for wrap_policy.moe_experts).",
        "per-expert sharding is not built (experts are sharded with their decoder layer, which needs no patch).")
    apply_tiled_mlp: bool = _refused_unless(
        False, "ROLL's TiledMLP patch (the MLP computed in sequence tiles to cut activation memory).",
        "TiledMLP is not built; use model_args.gradient_checkpointing or smaller micro-batches "
        "(max_tokens_per_microbatch_in_train).")
    tiled_num_shards: Optional[int] = _refused_unless(
        None, "ROLL's TiledMLP tile count.", "it sizes TiledMLP (apply_tiled_mlp), which is not built.")
    model_type: Optional[str] = _refused_unless(
        None, "ROLL's model family for TiledMLP.", "it selects TiledMLP's patch (apply_tiled_mlp), which is not built.")


@dataclass
class RoleConfig(SchemaBlock):
    model_args: ModelArgs = _sub(ModelArgs, "Which model the role loads and how.")
    training_args: TrainingArgs = _sub(TrainingArgs, "Optimizer and batch keys (actor_train only).")
    generating_args: GeneratingArgs = _sub(GeneratingArgs, "Sampling keys (actor_infer only).")
    data_args: DataArgs = _sub(DataArgs, "Training prompts or SFT data (actor_train only).")
    strategy_args: StrategyArgs = _sub(StrategyArgs, "Backend and its options.")
    world_size: int = _f(1, "Ranks (Ray actors) of this role; data-parallel for training. With a "
                            "device_mapping it is derived: len(device_mapping) / num_gpus_per_worker "
                            "(leave it out, or give that same number).")
    device_mapping: Optional[Any] = _f(
        None, "ROLL's GPU placement of the role: global GPU indices, as a list or a string such as `'list(range(0, "
              "8))'` (read as data, never evaluated); each num_gpus_per_worker GPUs form a rank, and overlapping "
              "maps colocate roles. Null: world_size ranks of num_cpus_per_worker CPUs and num_gpus_per_worker GPUs"
              " ([placement.md](placement.md#placement-by-device_mapping-rolls-form)).")
    num_cpus_per_worker: float = _f(
        1.0, "Ray CPUs reserved per rank (> 0; each rank is one bundle of the role's placement "
             "group). Fractions let roles share a small machine's cores.")
    num_gpus_per_worker: float = _f(
        0.0, "Ray GPUs per rank. Without device_mapping: fractions (e.g. 0.5 on actor_train and "
             "actor_infer) colocate roles on one GPU; 0 runs on CPU. With device_mapping: whole GPUs "
             "per rank (0 means 1); deepspeed_train and hf_infer ranks use exactly 1, a vllm rank "
             "tensor_parallel_size x pipeline_parallel_size of its strategy_config (as in ROLL).")
    infer_batch_size: int = _f(16, "Sequences per forward pass when this role computes log-probs.")
    # --- ROLL's keys (roll_gspo.config.roll.roll_compat) ---
    system_envs: Dict[str, str] = _f(
        {}, "Environment variables set in this role's workers before they build anything, over "
            "the top-level `system_envs`. Values are strings; a YAML integer (`OMP_NUM_THREADS: 2`) is "
            "taken as its digits.")
    use_dynamic_batching_in_train: bool = _f(
        False, "ROLL's dynamic batching in training: each mini-batch's rows sorted by length and packed into "
               "micro-batches of at most max_tokens_per_microbatch_in_train tokens instead of "
               "per_device_train_batch_size rows; the gradient is unchanged, the padding nearly gone "
               "(`actor/padding_frac`; [training_speed.md](training_speed.md)).")
    use_dynamic_batching_in_infer: bool = _f(
        False, "The same for log-prob passes without gradient (actor_train's old log-probs, the "
               "reference's log-probs): max_tokens_per_microbatch_in_infer tokens per forward pass "
               "instead of infer_batch_size rows. Not read by actor_infer (vLLM schedules its own batches).")
    max_tokens_per_microbatch_in_train: int = _f(
        0, "Token budget of one training micro-batch with use_dynamic_batching_in_train (rows x padded length, "
           "padding included), at least one whole sequence. Larger: fewer, bigger passes (faster, more activation "
           "memory).")
    max_tokens_per_microbatch_in_infer: Optional[int] = _f(
        None, "Token budget of one log-prob pass with use_dynamic_batching_in_infer, at least one whole sequence; "
              "usually larger than the train budget (no activations kept for a backward pass).")
    sequence_length_round_in_train: int = _f(
        4, "Padded length of a dynamic training micro-batch: its longest row rounded up to a multiple of "
           "this (>= 1; at most the batch's width). Larger values give fewer distinct shapes (GPU kernels), "
           "1 the least padding.")
    sequence_length_round_in_infer: int = _f(
        4, "The same rounding for dynamic log-prob passes (>= 1).")
    worker_cls: Optional[str] = _f(
        None, "ROLL's worker class of the role (actor_train only): ROLL's policy-gradient and default actor workers"
              " are accepted, and the loss is the one policy_loss / pg_variant names "
              "([roll_compat.md](roll_compat.md)).")
    pg_variant: Optional[str] = _f(
        None, "ROLL's policy-gradient variant (actor_train only): vanilla, ppo, tis, topr, cispo, kimi15. Acts as "
              "policy_loss (vanilla -> reinforce, ppo -> ppo, the others by their name).", ROLL_PG_VARIANTS)
    topr_positive_weight: Optional[float] = _f(
        None, "ROLL's name (actor_train only) for the top-level topr_positive_weight.")
    topr_negative_weight: Optional[float] = _f(
        None, "ROLL's name (actor_train only) for the top-level topr_negative_weight.")
    opd_kl_coef: Optional[float] = _f(
        None, "A teacher's own weight (>= 0) of its reverse KL in the advantages (teacher blocks only; ROLL reads "
              "opd_kl_coef here, per teacher). Null: the top-level opd_kl_coef.")
    tag_included: List[str] = _f(
        [], "A teacher's rows in ROLL's multi-teacher form (teacher blocks only): the row tags it scores, matched "
            "against each row's reward domain and that reward block's tag_included. Empty: every row.")
    use_sequence_packing: bool = _f(
        False, "ROLL's sequence packing (its Megatron strategy only): here it acts as token-budget micro-batches "
               "(use_dynamic_batching_in_train / _in_infer with sequence_packing_args' max_packed_sequence_length_* "
               "as the budgets, said in a notice): the same gradient, rows padded to their micro-batch's longest "
               "instead of concatenated ([training_speed.md](training_speed.md)).")
    sequence_packing_args: Dict[str, Any] = _f(
        {}, "ROLL's sequence-packing options, read with use_sequence_packing: algorithm (none, load_balance), "
            "max_packed_sequence_length_train / _forward (the token budgets), min_num_micro_batches_train / _forward "
            "(Megatron pipeline stages' minimum: nothing to fill here, accepted with a notice). Without "
            "use_sequence_packing they are ignored, as in ROLL (one notice).")


@dataclass
class QueryFilterConfig(SchemaBlock):
    type: str = _f(
        "no_filter", "Dynamic sampling: `no_filter`, `mean_filter` (drop a prompt whose scores' mean is outside "
                     "filter_args' thresholds) or `std_filter` (drop it when their std is at most "
                     "filter_args.std_threshold; 0 is DAPO's); dropped prompts are replaced by new ones "
                     "([data_and_rewards.md](data_and_rewards.md#dynamic-sampling-and-domain-mix)).", QUERY_FILTERS)
    filter_args: Dict[str, Any] = _f(
        {}, "mean_filter: `threshold_up` (default inf), `threshold_down` (default -1); std_filter: `std_threshold` "
            "(default -1).")


REWARD_TYPES = [None, "hard", "soft"]
JUDGE_MODEL_TYPES = [None, "api", "inference"]


@dataclass
class RewardConfig(SchemaBlock):
    worker_cls: str = _f("roll_gspo.workers.rewards.MathRuleRewardWorker", reward_workers.help_text())
    reward_fn: Optional[str] = _f(
        None, "For FunctionRewardWorker: import path `pkg.module:function` (or `pkg.module.function`) "
              "of `fn(prompt: str, response: str, ground_truth: str) -> float`. For RewardModelWorker: "
              "an optional rule reward added to the model's score (weights `rule_weight`/`model_weight` "
              "in `reward_kwargs`).")
    pattern: Optional[str] = _f(
        None, "For RegexMatchRewardWorker: a regex whose first group (or whole match) is compared "
              "with the ground truth. Null: the stripped response must equal it.")
    tag_included: List[str] = _f(
        [], "Data domains this worker scores. Empty: the domain named by this block's key.")
    world_size: int = _f(1, "Reward worker actors for this domain. With a device_mapping it is derived "
                            "(one worker per num_gpus_per_worker GPUs).")
    num_cpus_per_worker: float = _f(0.1, "Ray CPUs reserved per reward worker.")
    num_gpus_per_worker: float = _f(
        0.0, "Ray GPUs per reward worker: for a judge model loaded by the worker (`judge_model_type: "
             "inference`) or a reward model. 0 runs on CPU.")
    device_mapping: Optional[Any] = _f(
        None, "ROLL's GPU placement of this domain's workers, read as `<role>.device_mapping` is: a model-backed "
              "reward (a local judge, a reward model) loads its model there, one worker per num_gpus_per_worker "
              "GPUs. Null: CPU, or num_gpus_per_worker GPUs placed by Ray "
              "([placement.md](placement.md#placement-by-device_mapping-rolls-form)).")
    timeout_s: float = _f(
        10.0, "Seconds one response may take to score. Rule rewards run in a persistent child process "
              "per worker; one that overruns is killed (with anything it started) and restarted. A "
              "reward that raises or times out scores 0 and is counted in `reward/<domain>/errors` / "
              "`reward/<domain>/timeouts`; the run goes on. Code sandbox: the limit per test program; "
              "LLM judge: per request.")
    reward_kwargs: Dict[str, Any] = _f({}, "Extra keyword arguments passed to the reward function.")
    # --- shared by every worker (ROLL's names) ---
    reward_type: Optional[str] = _f(
        None, "`hard`: 0/1 (all tests pass / right option); `soft`: partial credit (code: the fraction "
              "of tests passed; multiple choice: 0.5 for the right letter outside `\\boxed{}`). Null: "
              "hard. Read by CodeSandboxRewardWorker, MultipleChoiceRewardWorker and IFEvalRewardWorker "
              "(soft: the fraction of the row's instructions followed).", REWARD_TYPES)
    response_length_penalty_coef: float = _f(
        0.0, "Subtract `coef * response_tokens / response_length` from every score (a full-length "
             "response pays `coef`). 0: off.")
    format_pattern: Optional[str] = _f(
        None, "A regex the whole response must match (`re.match`, DOTALL and MULTILINE), e.g. "
              "`^<think>.*</think>.*<answer>.*</answer>$`; a response that does not scores 0 with "
              "status `format` (counted in `reward/<domain>/format`). Null: no check. Independently of "
              "it, a response that stops inside `<think>` (its own, or one the prompt opened) always "
              "scores 0 with status `format`.")
    # --- code sandbox (ROLL's keys) ---
    use_local: bool = _f(
        True, "CodeSandboxRewardWorker: run tests on this worker's machine (the only mode built).")
    code_url: Optional[str] = _f(
        None, "CodeSandboxRewardWorker: URL of a remote sandbox service (ROLL's key). Not built: set "
              "`use_local: true`.")
    sandbox: str = _f(
        "auto", "CodeSandboxRewardWorker's isolation: `bwrap` (bubblewrap >= 0.8), `rlimits` (`unshare` namespaces "
                "and resource limits) or `auto` (bwrap where it works, else rlimits); both run without network "
                "under CPU, memory and process limits ([data_and_rewards.md](data_and_rewards.md#code-sandbox)).",
        ["auto", "bwrap", "rlimits"])
    sandbox_memory_mb: int = _f(512, "CodeSandboxRewardWorker: address-space limit per test program (MB).")
    sandbox_max_processes: int = _f(
        16, "CodeSandboxRewardWorker: processes a test program may have at once (fork bombs stop here).")
    # --- LLM judge (ROLL's keys) ---
    judge_model_type: Optional[str] = _f(
        None, "LLMJudgeRewardWorker: `api` (an OpenAI-compatible endpoint at `judge_api_url`) or "
              "`inference` (the judge model `model_args.model_name_or_path` loaded by the worker, with "
              "`strategy_args.strategy_name` vllm or hf_infer). Null: api.", JUDGE_MODEL_TYPES)
    judge_prompt: Optional[str] = _f(
        None, "LLMJudgeRewardWorker: the judge's prompt template with `{question}`, `{response}`, "
              "`{reference}`; it must ask for a last line `VERDICT: CORRECT` or `VERDICT: INCORRECT` "
              "(or `SCORE: <0-10>`). Null: the built-in template.")
    judge_model_name: Optional[str] = _f(
        None, "LLMJudgeRewardWorker (api): the model name sent to the endpoint.")
    judge_api_url: Optional[str] = _f(
        None, "LLMJudgeRewardWorker (api): base URL of the OpenAI-compatible server, e.g. "
              "`http://127.0.0.1:8000/v1`.")
    judge_api_key: Optional[str] = field(default=None, repr=False, metadata={"help": (
        "LLMJudgeRewardWorker (api): the endpoint's key; `env:NAME` reads it from the environment variable "
        "NAME (recommended: the YAML then holds no secret). Never logged; `--print-config` shows a literal "
        "key as `***`.")})
    judge_max_retries: int = _f(
        3, "LLMJudgeRewardWorker (api): retries of a failed request (refused, timeout, HTTP 5xx/429), with "
           "exponential backoff from 0.5 s.")
    model_args: ModelArgs = _sub(ModelArgs, "Judge model (`judge_model_type: inference`) or reward model "
                                            "(RewardModelWorker; null path: `reward_pretrain`).")
    generating_args: GeneratingArgs = field(
        default_factory=lambda: GeneratingArgs(temperature=0.0, max_new_tokens=DEFAULT_JUDGE_MAX_NEW_TOKENS),
        metadata={"help": f"Judge sampling (LLMJudgeRewardWorker); greedy, {DEFAULT_JUDGE_MAX_NEW_TOKENS} tokens by "
                          f"default: room for the default prompt's brief reasoning before its verdict line (a "
                          f"verdict cut at the budget scores 0 as `error`; a batch with more than a fifth cut "
                          f"warns)."})
    strategy_args: StrategyArgs = _sub(StrategyArgs, "Backend of a judge model loaded by the worker: "
                                                     "`vllm` or `hf_infer` (LLMJudgeRewardWorker, inference).")
    infer_batch_size: int = _f(8, "Responses per forward pass (RewardModelWorker, hf_infer judge).")
    data_args: DataArgs = _sub(DataArgs, "Prompt template of a model-based reward worker "
                                         "(`template`); rule-based workers read none of it.")
    query_filter_config: QueryFilterConfig = _sub(
        QueryFilterConfig, "ROLL's dynamic sampling for this domain's prompts: groups whose G scores "
                           "fail the filter are dropped and replaced by newly drawn prompts.")


@dataclass
class TaskConfig(SchemaBlock):
    """One task of `tasks` (roll_gspo.tasks): prompts generated from a source, scored by its own rule."""
    name: Optional[str] = _f(
        None, "The task in its source: a reasoning-gym generator (`chain_sum`, `basic_arithmetic`, ...; `rg:` "
              "prefix optional) or a built-in one (`builtin:arith`, `builtin:arith_easy`, `builtin:choice`). Null: "
              "the block's key.")
    source: Optional[str] = _f(None, "`reasoning_gym` or `builtin`. Null: the source that holds `name` (or "
                                     "its prefix's).", [None, "reasoning_gym", "builtin"])
    config: Dict[str, Any] = _f(
        {}, "The generator's own config (reasoning-gym: its config dataclass's fields, e.g. `{min_terms: 2, "
            "max_terms: 2}`; builtin arith: `levels`).")
    weight: float = _f(1.0, "Share of each rollout batch drawn from this task (normalised over the tasks, like "
                            "ROLL's domain_interleave_probs; 0: validation only).")
    train_size: int = _f(1000, "Training rows generated (>= 1), from seeds `seed .. seed+train_size-1`.")
    val_size: int = _f(100, "Validation rows generated (>= 1), scored every eval_steps and by `python -m "
                            "roll_gspo.eval`.")
    seed: int = _f(0, "First seed of the training rows (reasoning-gym draws row i from seed + i).")
    val_seed: Optional[int] = _f(
        None, "First seed of the validation rows, apart from the training seeds. Null: seed + 1000000 (builtin "
              "tasks keep validation prompts out of training themselves).")
    system_prompt: Optional[str] = _f(
        None, "The system turn of every prompt (rendered with data_args.template, else the tokenizer's chat "
              "template). Null: the source's default (reasoning-gym: asks for the answer in "
              "`<answer></answer>` tags; builtin: none, the raw `12+34=` prompt). Empty: no system turn.")
    format_weight: float = _f(
        0.0, "Added to the reward of a reply that writes exactly one `<answer>...</answer>`. Accuracy never "
             "needs the format: the answer is the tagged one if present, else `\\boxed{}`, an 'answer is' "
             "phrase, or the last number.")
    partial_credit: bool = _f(
        False, "false: the answer term of the reward is 1 for a correct answer, else 0 (also the accuracy). "
               "true: the task's own score, e.g. reasoning-gym's len(gold)/len(answer) for any answer holding "
               "the gold string (a negated answer, a digit slip, a list of guesses), which group normalisation "
               "turns into positive advantages for near misses. The format term is added either way.")
    reward: str = _f("tasks", "The `rewards` block, a TaskRewardWorker (or a subclass), that scores this task's "
                              "rows.")


@dataclass
class WarmStartConfig(SchemaBlock):
    """A warm start from the policy's own correct answers (rejection-sampling fine-tuning, as in STaR
    and RFT) before the RL run: sample, keep the correct replies, fine-tune with the SFT pipeline, then
    train with RL from the fine-tuned model (pipelines/rft_warm_start.py; docs/data_and_rewards.md)."""
    enabled: bool = _f(
        False, "Fine-tune the policy on its own correct replies before RL (`pipeline: rlvr`); its files go to "
               "`<output_dir>/warm_start/`, a finished one is reused, and the RL roles start from "
               "`warm_start/model` "
               "([data_and_rewards.md](data_and_rewards.md#warm-start-from-the-models-own-correct-answers)).")
    prompts: int = _f(
        512, "Training prompts sampled (>= 1): drawn from the run's own training rows (its `tasks` or data "
             "files, templated as training templates them) in the run's mix (task weights or "
             "domain_interleave_probs), seeded by `seed`. More than there are rows: all of them.")
    samples_per_prompt: int = _f(
        8, "Replies sampled per prompt (>= 1), by the rollout's engine in a child process of the driver.")
    temperature: float = _f(
        1.0, "Sampling temperature of the warm start's replies (> 0); top_p, top_k and max_new_tokens are "
             "actor_infer's.")
    require_format: bool = _f(
        True, "Keep only replies that also earn the run's format term: for a task with `format_weight` > 0, "
              "exactly one `<answer>...</answer>`. (A reward block's `format_pattern` is part of its reward, so "
              "a correct reply matches it anyway.)")
    kept_per_prompt: int = _f(
        1, "Correct replies kept per prompt (>= 1): distinct texts, in the order they were sampled, each ended "
           "by the model (a reply cut at max_new_tokens is never kept). One per prompt spreads the fine-tuning "
           "over prompts rather than over the easy ones.")
    learning_rate: float = _f(
        1e-5, "Peak learning rate of the warm start's fine-tuning (> 0); the other training_args (warm-up, "
              "schedule, weight decay, clipping) and the strategy are actor_train's.")
    num_train_epochs: int = _f(1, "Passes of the fine-tuning over the kept replies (>= 1).")
    per_device_train_batch_size: Optional[int] = _f(
        None, "Micro-batch of the fine-tuning per rank. Null: actor_train's.")
    gradient_accumulation_steps: Optional[int] = _f(
        None, "Micro-batches per optimizer step of the fine-tuning. Null: actor_train's. Kept replies beyond a "
              "whole number of mini-batches (per_device x accumulation x world_size) are left out.")


@dataclass
class ValidationConfig(SchemaBlock):
    data_args: DataArgs = _sub(DataArgs, "Held-out prompts (e.g. `builtin:arith/val`).")
    generating_args: GeneratingArgs = field(
        default_factory=lambda: GeneratingArgs(temperature=0.0),
        metadata={"help": "Sampling for validation; greedy (temperature 0) by default."})


@dataclass
class CheckpointConfig(SchemaBlock):
    type: str = _f("file_system", "Where checkpoints are written; only a local/shared file system "
                                  "is built.", CHECKPOINT_TYPES)
    output_dir: Optional[str] = _f(
        None, "Checkpoints go to `<output_dir>/checkpoints/step_<N>` under this folder instead of "
              "the top-level output_dir. No timestamp is appended (ROLL appends one, so its "
              "resume never finds the previous run's checkpoints).")


@dataclass
class FaultToleranceConfig(SchemaBlock):
    max_restarts: int = _f(
        3, "How many times each rollout rank and each reward worker may be replaced over a run when it dies or "
           "hangs (`fault/restarts/<role>`); one death more stops the run, and 0 stops it at the first "
           "([crash_safety.md](crash_safety.md#when-a-process-dies)).")
    hang_timeout_s: float = _f(
        300.0, "A rollout rank is hung, not slow, when it does not answer a health probe within this many "
               "seconds, or holds requests while its engine takes no step for this long: it is then killed and "
               "replaced (within `max_restarts`). Must exceed one engine step (hf_infer: one `generate` over "
               "`infer_batch_size` groups). Probed only while the driver waits for the rank.")
    reward_timeout_s: float = _f(
        1800.0, "A reward worker's call (one shard of a step's responses) running longer than this is a hung "
                "worker: it is killed, restarted, and its shard scored again (within `max_restarts`). Set it "
                "above the slowest honest shard (a per-response `timeout_s` bounds rule rewards already).")
    phase_timeout_factor: float = _f(
        10.0, "A training, reference or critic rank that does not answer a health probe for max("
              "`phase_timeout_floor_s`, this x the median time of the same call in this run) is stopped or hung: the"
              " run stops naming it, its phase and the resume command "
              "([crash_safety.md](crash_safety.md#the-fault-matrix)). A call not timed yet: `hang_timeout_s`.")
    phase_timeout_floor_s: float = _f(
        60.0, "The least a training, reference or critic rank's silence is allowed before it is called hung "
              "(see `phase_timeout_factor`): above one GIL-holding native call and a loaded machine's pauses.")
    collective_timeout_s: float = _f(
        600.0, "Training ranks' process-group (gloo/NCCL) timeout, torch's default being 30 min: a collective "
               "waiting this long on a peer raises, naming it. The driver's probe (`phase_timeout_factor`) "
               "usually stops the run first; keep this above the slowest honest collective.")
    auto_resume_on_failure: int = _f(
        0, "How many times `run_pipeline.py` resumes from the last complete checkpoint, in the same process, when a"
           " rank that cannot be replaced mid-step (training, reference, critic) dies; 0 stops the run "
           "([crash_safety.md](crash_safety.md#when-a-process-dies)).")


@dataclass
class DriftAlarmConfig(SchemaBlock):
    enabled: bool = _f(True, "Watch the trainer-vs-engine log-prob gap every step, per task, turn and staleness lag "
                             "(`drift/*` metrics); a breach prints one line ([algorithm.md](algorithm.md#the-drift-alarm)).")
    warn_gap: Optional[float] = _f(
        None, "Mean per-token |trainer - engine| log-prob gap above which a step prints a warning line. Null: by the run's "
              "precision, 1e-3 in fp32 on both sides, 0.1 otherwise ([algorithm.md](algorithm.md#the-drift-alarm)).")
    stop_gap: Optional[float] = _f(
        None, "The gap above which the run stops (non-zero exit) after the step's checkpoint policy; `.inf` (an "
              "override: `inf`) never. "
              "Null: 0.05 in fp32, 0.5 otherwise, never where the sampling keys make the engine report another "
              "quantity ([algorithm.md](algorithm.md#the-drift-alarm)).")


# --------------------------------------------------------------------------------------------
# The agentic pipeline (`pipeline: agentic`): environments, env managers, trajectory rewards
# --------------------------------------------------------------------------------------------
TRAJ_ENV_MANAGER = "roll.pipeline.agentic.env_manager.traj_env_manager.TrajEnvManager"
# ROLL's templates (examples/config/traj_envs.yaml), with its placeholders.
DEFAULT_AGENT_SYSTEM_TEMPLATE = ("You're a helpful assistant. You are a good game player. You are aiming to get "
                                 "high reward in the game.")
DEFAULT_AGENT_TEMPLATE = ("Turn {turn_idx}:\nObservation:\n{observation}\nYou have {actions_left} actions left. "
                          "Max response length: {max_response_length} tokens.\nDecide the next action:\n")


@dataclass
class ToolWrapperConfig(SchemaBlock):
    wrapper_args: Dict[str, Any] = _f(
        {}, "GEM's ToolEnvWrapper arguments: `tool_reward` (added on every tool call), `tool_success_reward` "
            "(on a call that ran without error), `tool_execute_error_reward`, `max_tool_uses` (after that "
            "many calls the text goes to the environment).")
    tool_configs: List[Dict[str, Any]] = _f(
        [], "The tools, each `{tool_id, tool_args}`: `python_code` (code in `<python>`/```python blocks runs "
            "in the project's sandbox; tool_args `timeout`, ...; ROLL's `sandbox_type` is accepted, the "
            "sandbox is always on) or `function` (tool_args `function: pkg.module:func`, a type-hinted "
            "Python function called with hermes-style `<tool_call>{...}</tool_call>`, `timeout`). See "
            "[agentic.md](agentic.md).")


@dataclass
class CustomEnvConfig(SchemaBlock):
    env_type: str = _f("frozen_lake", "Environment: a built-in (`frozen_lake`, `sokoban`, `guess_the_number` / "
                                      "GEM's `game:GuessTheNumber-v0`, `math_python` / ROLL's `roll_math`) or a "
                                      "class path `pkg.module:Class` with GEM's reset/step interface.")
    env_config: Dict[str, Any] = _f(
        {}, "Keyword arguments of the environment's constructor (checked against its signature at "
            "--dry-run). A `seed` here is replaced by the group's seed, as in ROLL.")
    max_steps: int = _f(10, "Turn cap of one episode (ROLL's name; not the top-level max_steps, which counts "
                            "training steps). The episode is truncated after this many agent turns.")
    max_tokens_per_step: int = _f(
        128, "Generated tokens per turn at most; a turn also stops at the model's end of sequence and at "
             "what is left of sequence_length.")
    env_manager_cls: str = _f(
        TRAJ_ENV_MANAGER, "ROLL's env manager class path or our short name. `traj` (ROLL's TrajEnvManager): one "
                          "training sample per trajectory, the whole conversation's token ids, only generated "
                          "tokens in the loss. `step` (ROLL's StepEnvManager): one sample per turn, its context "
                          "the trajectory's token ids so far (never re-tokenised from text, unlike ROLL).")
    agent_system_template: Optional[str] = _f(
        DEFAULT_AGENT_SYSTEM_TEMPLATE, "System message of every episode (null or empty: none).")
    agent_template: str = _f(
        DEFAULT_AGENT_TEMPLATE, "The user message of each turn, Python `str.format` with `{observation}`, "
                                "`{turn_idx}` (1-based), `{actions_left}`, `{max_response_length}` (the turn's "
                                "token cap) and `{suffix}` (the env's info `suffix`, if any). The env's "
                                "`env_instruction` goes before the first one.")
    tool_wrapper: Optional[ToolWrapperConfig] = _f(None, "Tools the agent may call (GEM's ToolEnvWrapper).")
    env_step_timeout_s: float = _f(
        60.0, "An env step (tool calls included) running longer ends its trajectory as a timeout (counted in "
              "`env/timeouts`, the step's reward is error_penalty); the stuck step is interrupted and abandoned.")
    error_penalty: Optional[float] = _f(
        None, "Reward of the step that ends a trajectory because its env raised, hung or returned a malformed "
              "result (null: env_config's `format_penalty`, else 0).")
    use_thread_lock: bool = _f(True, "ROLL's per-env lock; accepted and not needed here (each env is stepped by "
                                     "one thread at a time).")
    agent_runner_cls: Optional[str] = _refused_unless(
        None, "ROLL's agent runner.", "the turn loop is roll_gspo's own (roll_gspo.agentic.rollout); remove it.")
    history_length: Optional[int] = _f(
        None, "ROLL's text-history window of step-wise managers; accepted and ignored: the context here is "
              "always the whole trajectory's token ids (within sequence_length).")


@dataclass
class EnvManagerConfig(SchemaBlock):
    tags: List[str] = _f(["FrozenLake"], "custom_envs entries this manager plays (with num_groups_partition).")
    num_groups_partition: List[int] = _f(
        [], "Env groups per tag, zipped with `tags` (sums to num_env_groups). Empty: equal shares.")
    num_env_groups: int = _f(
        8, "Env groups per batch: each group is group_size episodes of one env with one seed. The batch is "
           "rollout_batch_size (training) or val_batch_size (validation) trajectories, so "
           "num_env_groups * group_size should equal it; the groups are split over tags by "
           "num_groups_partition, scaled to the batch.")
    group_size: int = _f(
        1, "Trajectories per group: the same env, config and seed, so a group starts from identical states "
           "(the GRPO/GSPO group). Validation: 1 (greedy).")
    max_env_num_per_worker: int = _f(
        0, "ROLL: envs per env worker. Here every env steps in the driver's thread pool: this many threads "
           "(0: one per trajectory in flight, at most 64).")
    generating_args: Optional[GeneratingArgs] = _f(
        None, "Sampling of this manager's turns (max_new_tokens: per turn). Null: actor_infer.generating_args. "
              "Validation keeps its own (ROLL copies actor_infer's over both, losing a greedy validation).")
    group_size_redundancy: int = _refused_unless(0, "ROLL's extra episodes per group.",
                                                 "every group here plays exactly group_size episodes.")
    max_traj_per_env: int = _f(-1, "ROLL's cap on episodes per env object; accepted and ignored (a fresh env "
                                    "object plays each episode).")
    format_penalty: float = _f(0.0, "Accepted and ignored, as in ROLL (no code reads it there); the acting "
                                    "penalty is custom_envs.<tag>.env_config.format_penalty.")
    worker_cls: Optional[str] = _f(None, "ROLL's env worker class; accepted and ignored (envs step in the driver).")


@dataclass
class TrainInferISWeightConfig(SchemaBlock):
    enabled: bool = _f(
        False, "Multiply each token's policy loss by the weight exp(old_logp - rollout_logp) between the trainer's "
               "old policy and the rollout engine's, correcting the train-inference mismatch; runs the trainer's "
               "old-log-prob pass ([algorithm.md](algorithm.md#rollout-correction-train-inference-mismatch)).")
    weight_type: str = _f(
        "token", "Level of the weight: `token` (one per token), `geometric` (exp of the mean token log-weight over "
                 "the response: GSPO's length-normalised sequence unit), `sequence` (exp of the sum: the exact "
                 "sequence weight, high variance on long responses).", ["token", "geometric", "sequence", "segment"])
    upper_bound: Optional[float] = _f(
        1.2, "Truncate the weights at this bound, above 1 (TIS). Null: no truncation (unbiased, unbounded "
             "variance). Truncated tokens: `rollout_correction/clipped_fraction`.")
    detach: bool = _f(
        True, "ROLL: no gradient through the weight. Both log-probs are constants of the update here, so the "
              "weight never carries one either way.")


@dataclass
class TrainInferFilterConfig(SchemaBlock):
    enabled: bool = _f(False, "Apply this rejection rule: tokens (agg_type token) or whole responses outside "
                              "the band are left out of the loss (policy, KL and entropy terms) and of its "
                              "normalisers (as verl and ROLL's recompute path: the step size does not move "
                              "with the rejection rate). Counted in `rollout_correction/masked_fraction` "
                              "(tokens) and `masked_seq_fraction` (whole responses).")
    agg_type: str = _f("token", "Level tested: `token`, `geometric` (the response's length-normalised weight / mean"
                                " difference), `sequence` (its product weight / summed difference).",
                       ["token", "geometric", "sequence", "segment"])
    ratio_enabled: bool = _f(True, "Test the weight exp(old_logp - rollout_logp) against [ratio_low, ratio_high].")
    ratio_low: float = _f(0.8, "Lower bound of the weight (>= 0, < 1).")
    ratio_high: float = _f(1.2, "Upper bound of the weight (> 1).")
    diff_enabled: bool = _f(False, "Test the probability difference exp(old_logp) - exp(rollout_logp) against "
                                   "[diff_low, diff_high].")
    diff_low: float = _f(-0.2, "Lower bound of the probability difference (< 0).")
    diff_high: float = _f(0.2, "Upper bound of the probability difference (> 0).")


@dataclass
class TrainInferCorrectionConfig(SchemaBlock):
    is_weight: TrainInferISWeightConfig = _sub(
        TrainInferISWeightConfig, "Importance weights between the trainer's old policy and the rollout engine's "
                                  "(truncated importance sampling).")
    filters: List[TrainInferFilterConfig] = _f(
        [], "Rejection rules applied one after the other (masked importance sampling); the keys of one rule "
            "follow.")


@dataclass
class RolloutCorrectionConfig(SchemaBlock):
    rollout_is: Optional[str] = _f(
        None, "verl's name for train_infer_correction.is_weight: `token` / `sequence` / `geometric` sets "
              "enabled: true and that weight_type; null: no weights.", [None, "token", "sequence", "geometric"])
    rollout_is_threshold: Optional[float] = _f(
        2.0, "verl's name for train_infer_correction.is_weight.upper_bound (> 1; null: no truncation).")
    rollout_rs: Optional[str] = _f(
        None, "verl's rejection sampling: `token` / `sequence` / `geometric` adds one train_infer_correction "
              "filter at that level, keeping weights within [rollout_rs_threshold_lower, "
              "rollout_rs_threshold]; null: none.", [None, "token", "sequence", "geometric"])
    rollout_rs_threshold: Optional[float] = _f(
        None, "Upper bound of the rejection band (> 1); required with rollout_rs.")
    rollout_rs_threshold_lower: Optional[float] = _f(
        None, "Lower bound of the rejection band (< 1); null: 1 / rollout_rs_threshold.")


@dataclass
class RewardNormalizationConfig(SchemaBlock):
    grouping: str = _f("batch", "Sets over which trajectory (or turn) rewards are normalised: `traj_group_id` "
                                "(the group_size episodes of one env seed: GRPO's group), `tags` (per env tag), "
                                "`batch`. Default `batch`, ROLL's; a config that leaves the block out gets a notice.",
                       REWARD_GROUPINGS)
    method: str = _f("identity", "`mean_std`: z-score (a set whose rewards are all equal becomes 0); `mean`: "
                                 "subtract the mean; `identity`: raw rewards. Default `identity`, ROLL's (no "
                                 "baseline: write `grouping: traj_group_id` and `method: mean_std` for GRPO's "
                                 "group z-score).", REWARD_NORM_METHODS)


@dataclass
class RolloutEndpointConfig(SchemaBlock):
    enabled: bool = _f(
        False, "Serve an OpenAI-compatible endpoint (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) in "
               "front of the rollout ranks for the whole run, its address printed at start; `agent` turns it on "
               "([endpoint.md](endpoint.md#serving-it-from-a-run)).")
    host: str = _f("127.0.0.1", "Address it listens on. Anything but a loopback address needs `token`.")
    port: int = _f(0, "Port (0: a free one, printed at start).")
    token: Optional[str] = _f(
        None, "Bearer token every request must send (`Authorization: Bearer <token>`, the openai client's "
              "`api_key`). Null: none (loopback only).")
    model_name: str = _f("policy", "The model name clients send (`model=`) and `/v1/models` lists; another name "
                                   "is a 404.")
    tool_parser: Optional[str] = _f(
        "hermes", "vLLM's tool parser that turns generated text into `tool_calls` when a request has `tools` "
                  "(any name vLLM registers); null: tool calls stay text.")


@dataclass
class AgentConfig(SchemaBlock):
    agent_func: Optional[str] = _f(
        None, "`pipeline: agentic`: an agent as the environment, `pkg.module:function` with `async def "
              "agent(client, task) -> float` on the `openai` client; its requests become the episode's trajectory "
              "and its return value the reward ([endpoint.md](endpoint.md#agents-as-environments)).")
    verifiers_env: Optional[Dict[str, Any]] = _f(
        None, "`pipeline: agentic`: a verifiers 0.4 environment as the agent, instead of `agent_func`: its `[env]` "
              "block as a mapping, `{taskset: {id: TASKSET_ID}}` plus any of its fields; each trace's rubric reward"
              " is its episode's reward ([endpoint.md](endpoint.md#verifiers-environments-issue-38-item-5)).")
    task_file: Optional[str] = _f(
        None, "The agent's tasks: a `.jsonl` file (one JSON value per line) or a `.json` list; each row is one "
              "`task` (after `task_key`). Drawn in order, reshuffled each epoch when `shuffle`.")
    task_key: Optional[str] = _f(None, "Pass `row[task_key]` as the task instead of the whole row (rows must be "
                                       "objects then).")
    shuffle: bool = _f(True, "Shuffle the tasks each epoch (seeded by `seed`; a resumed run draws the same ones).")
    timeout_s: float = _f(
        300.0, "An episode running longer is ended (its requests in flight aborted on the rank) with "
               "`failure_reward`, counted in `agent/timeouts`.")
    failure_reward: float = _f(
        0.0, "Reward of an episode whose agent raised, returned NaN or timed out (counted: `agent/errors`, "
             "`agent/timeouts`); its requests so far still train.")
    max_concurrency: int = _f(0, "Episodes in flight at once at most (0: the whole step's).")


# --------------------------------------------------------------------------------------------
# The pipeline config
# --------------------------------------------------------------------------------------------
@dataclass
class PipelineConfig(SchemaBlock):
    # --- run keys ---
    pipeline: str = _f("rlvr", "Which pipeline `run_pipeline.py` runs: `rlvr` (GSPO/GRPO with "
                               "verifiable rewards), `agentic` (multi-turn episodes against environments "
                               "and tools; [agentic.md](agentic.md)) or `sft` (supervised fine-tuning).", PIPELINES)
    exp_name: str = _f("roll_gspo", "Experiment name, used in log lines and tracker runs.")
    seed: int = _f(42, "Seed of data order, sampling and initialisation.")
    output_dir: str = _f("./output/${exp_name}", "Checkpoints, metrics.jsonl, plots and the final "
                                                 "model go here. Never suffixed with a timestamp, "
                                                 "so a resume finds it.")
    logging_dir: Optional[str] = _f(None, "TensorBoard event files. Null: `<output_dir>/tensorboard`.")
    rollout_dump_dir: Optional[str] = _f(
        None, "Each step's trained samples as `step_<N>.jsonl.gz` (prompt, response, reward and its parts, "
              "advantage, log-prob gap, weight version; agentic episodes turn by turn; [rollouts.md](rollouts.md)). "
              "Null: `<output_dir>/rollouts`. ROLL's key (its agentic pipeline dumps validation there).")
    rollout_data_dir: Optional[str] = field(default=None, metadata={
        "help": "verl's name (`trainer.rollout_data_dir`) for `rollout_dump_dir`.", "alias_of": "rollout_dump_dir",
        "alias_invert": False})
    validation_data_dir: Optional[str] = _f(
        None, "Every validation prompt's reply, extracted answer and correctness as `step_<N>.jsonl.gz` "
              "(verl's `trainer.validation_data_dir`). Null: `<rollout_dump_dir>/val`.")
    rollout_dump_samples: int = _f(
        64, "Trained samples written per step (the batch's first rows, so whole groups; -1: all, 0: no "
            "training samples written). Validation writes every prompt. Costs under 2 % of a step on the "
            "examples ([rollouts.md](rollouts.md)).")
    max_steps: int = _f(100, "Pipeline steps (one rollout batch each).")
    query_filter_max_rounds: int = _f(
        4, "With a rewards.<domain>.query_filter_config: generations per step at most, the first "
           "included. Each round draws as many new prompts as were dropped. When the cap is hit the "
           "batch is topped up with dropped groups (they carry little or no signal) and "
           "`data/filter_cap_hit` is 1.")
    save_steps: int = _f(0, "Checkpoint every N steps, and at the end (0: only at the end).")
    eval_steps: int = _f(0, "Validate every N steps, at step 0 and at the end (0: never).")
    logging_steps: int = _f(1, "Print a metrics line every N steps (metrics.jsonl gets every step).")
    save_total_limit: int = _f(2, "Checkpoints kept on disk; older ones are deleted after a newer "
                                  "one is complete. 0 keeps all.")
    max_ckpt_to_keep: Optional[int] = _alias(
        "save_total_limit", "0 keeps every checkpoint.")
    checkpoint_config: CheckpointConfig = _sub(
        CheckpointConfig, "ROLL's checkpoint destination (`type: file_system`, `output_dir`).")
    fault_tolerance: FaultToleranceConfig = _sub(
        FaultToleranceConfig, "Replacing rollout ranks and reward workers that die or hang, and resuming "
                              "automatically after a training rank died ([crash_safety.md](crash_safety.md)).")
    drift_alarm: DriftAlarmConfig = _sub(
        DriftAlarmConfig, "The train-inference drift alarm: the trainer-vs-engine log-prob gap judged every step "
                          "against warn and stop thresholds ([algorithm.md](algorithm.md#the-drift-alarm)).")
    system_envs: Dict[str, str] = _f(
        {}, "Environment variables set in every worker (all roles, rewards included) before it "
            "builds anything; a role's own `system_envs` wins. The driver keeps its environment. "
            "Values are strings; a YAML integer is taken as its digits.")
    memory_allocator: str = _f(
        "auto", "The malloc of the model roles' workers: `jemalloc` (Ray's; keeps freed pages, ~18% faster training"
                " on CPU), `system` (the C library's), or `auto`: jemalloc for CPU roles of a policy under 100M "
                "parameters, else system ([training_speed.md](training_speed.md)).",
        choices=["auto", "jemalloc", "system"])
    num_nodes: int = _refused_unless(
        1, "ROLL's count of cluster nodes (its resource manager's).",
        "the nodes here are Ray's (a run: every node of its cluster) or --dry-run's --nodes; device_mapping "
        "is checked against those.")
    num_gpus_per_node: int = _f(
        8, "GPUs per node, for `device_mapping`: device id d is GPU d % num_gpus_per_node of node d // "
           "num_gpus_per_node; `--dry-run` plans on nodes of this many GPUs unless `--gpus-per-node` says otherwise"
           " ([placement.md](placement.md#placement-by-device_mapping-rolls-form)).")
    resume_from_checkpoint: Optional[str] = _f(
        None, "`auto`: resume from the newest complete checkpoint in output_dir if any; a path: "
              "that checkpoint (newer ones in output_dir move to `checkpoints/abandoned/`, kept); "
              "null: start fresh (refused if output_dir already has checkpoints, so nothing is "
              "overwritten silently). Resumed steps equal an uninterrupted run's: [crash_safety.md](crash_safety.md).")
    track_with: str = _f(
        "tensorboard", "Metric tracker besides metrics.jsonl (always written). tensorboard: event files "
                       "in logging_dir. wandb / swanlab / mlflow: that library's run (install the "
                       "`trackers` extra; offline: WANDB_MODE=offline, `tracker_kwargs: {mode: local}` "
                       "for swanlab, an mlflow `tracking_uri: file:...`). stdout: every metric printed "
                       "as one JSON line per step. none: metrics.jsonl only.", TRACKERS)
    tracker_kwargs: Dict[str, Any] = _f(
        {}, "Passed to the tracker as keywords: tensorboard `SummaryWriter` (e.g. `flush_secs`), "
            "`wandb.init` (project, entity, mode, tags, ...), `swanlab.init` (project, mode, ...), "
            "mlflow (`tracking_uri`, `experiment_name`, `run_name`, `tags`). Run name and config are "
            "filled from exp_name and the resolved config unless given.")
    pretrain: str = _f("builtin:tiny-arith", "Policy model: a folder in Hugging Face format or a "
                                             "built-in name (`builtin:tiny-arith`).")
    reward_pretrain: Optional[str] = _f(None, "Model for model-based reward workers (unused by the "
                                              "rule rewards).")

    # --- GSPO / rollout keys (ROLL's names) ---
    adv_estimator: str = _f("grpo", estimators.help_text(), ADV_ESTIMATORS)
    gdpo_reward_keys: List[str] = _f(
        ["accuracy", "format_rate"],
        "`adv_estimator: gdpo`: the reward components, by the names a reward worker reports per response, that GDPO"
        " z-scores within each group apart; the default is TaskRewardWorker's correctness and format parts "
        "([algorithm.md](algorithm.md#multi-reward-advantages-adv_estimator-gdpo)).")
    gdpo_reward_weights: Optional[List[float]] = _f(
        None, "`adv_estimator: gdpo` (verl's algorithm.gdpo_reward_weights): one weight per gdpo_reward_keys "
              "entry, multiplying its group z-score before they are summed. Null: all 1.")
    importance_sampling: str = _f(
        "seq", "`seq`: GSPO's length-normalised sequence ratio; `token`: PPO/GRPO per-token ratio; "
               "`gspo-token`: sequence ratio with per-token advantages (equals `seq` when advantages "
               "are per response).", IMPORTANCE_SAMPLING_CHOICES)
    rollout_batch_size: int = _f(64, "Prompts per step (`pipeline: agentic`: trajectories per step, a multiple "
                                     "of train_env_manager.group_size).")
    num_return_sequences_in_group: int = _f(
        8, "Responses per prompt (G). A step trains on rollout_batch_size * G responses. Larger G "
           "gives a better group baseline at proportional rollout cost.")
    prompt_length: int = _f(2048, "Maximum prompt tokens; longer prompts are filtered out and "
                                  "counted (`data/filtered_prompts`).")
    response_length: int = _f(4096, "Maximum generated tokens per response.")
    ppo_epochs: int = _f(1, "Passes over each rollout batch. Optimizer steps per rollout = ppo_epochs * number of "
                            "mini-batches.")
    pg_clip_low: float = _f(3e-4, "Lower clip: ratios below 1 - pg_clip_low are clipped. GSPO "
                                  "paper: 3e-4 (sequence ratios live near 1); GRPO: 0.2.")
    pg_clip_high: float = _f(4e-4, "Upper clip: ratios above 1 + pg_clip_high are clipped. GSPO "
                                   "paper: 4e-4; GRPO (clip-higher): 0.27.")
    dual_clip_loss: bool = _f(False, "Dual clip: for negative advantages, cap the loss at "
                                     "-dual_clip_c * A so one huge ratio cannot dominate.")
    dual_clip_c: float = _f(3.0, "Dual-clip constant c > 1 (3.0 as in the dual-clip PPO paper).")
    # --- the policy loss (roll_gspo.algorithms.policy_losses; docs/algorithm.md "Policy losses") ---
    policy_loss: str = _f(
        "clip", "The policy loss: `clip` is the clipped surrogate on the `importance_sampling` ratio (GSPO with "
                "`seq`); the others are CISPO, SAPO, GMPO, LUSPO, VESPO, verl's clip_cov / kl_cov and ROLL's "
                "pg_variants, and another framework's name stands for its loss and fills the keys it implies "
                "([algorithm.md](algorithm.md#policy-losses-policy_loss)).", POLICY_LOSS_CHOICES)
    pg_variant: Optional[str] = _f(
        None, "ROLL's recipes write `pg_variant` at the top too (an anchor for `${pg_variant}` in exp_name); it "
              "acts as actor_train.pg_variant.", ROLL_PG_VARIANTS)
    cispo_epsilon_low: float = _f(
        0.1, "policy_loss cispo: the IS weight is clipped below at 1 - cispo_epsilon_low (>= 0; 1 or more: no lower "
             "bound, TRL's and MiniMax-M1's form). ROLL's default 0.1; verl reads its clip_ratio_low here.")
    cispo_epsilon_high: float = _f(
        0.1, "policy_loss cispo: the IS weight is clipped above at 1 + cispo_epsilon_high (>= 0). ROLL's default 0.1; "
             "TRL's `epsilon_high` caps the ratio itself (TRL 5.0 is cispo_epsilon_high 4.0 here).")
    cispo_use_unified_mask: bool = _f(
        False, "policy_loss cispo: ROLL's unified mask (MiniMax-M1 eq. 7): tokens with A > 0 and a weight above the "
               "upper bound, or A < 0 and below the lower bound, leave the loss (as PPO's clip would zero them).")
    sapo_temperature_pos: float = _f(1.0, "policy_loss sapo: gate temperature of tokens with A > 0 (> 0; larger: a "
                                          "sharper gate, closer to a hard clip). TRL / verl (tau_pos) default 1.0.")
    sapo_temperature_neg: float = _f(1.05, "policy_loss sapo: gate temperature of tokens with A <= 0 (> 0). TRL / "
                                           "verl (tau_neg) default 1.05.")
    vespo_k_pos: float = _f(2.0, "policy_loss vespo: shape k of the gamma weight phi(w) = e^lambda w^k e^(-lambda w) "
                                 "for responses with A >= 0 (>= 0; TRL's default).")
    vespo_lambda_pos: float = _f(3.0, "policy_loss vespo: rate lambda of phi for A >= 0 (> 0; TRL's default).")
    vespo_k_neg: float = _f(3.0, "policy_loss vespo: shape k of phi for A < 0 (>= 0; TRL's default).")
    vespo_lambda_neg: float = _f(2.0, "policy_loss vespo: rate lambda of phi for A < 0 (> 0; TRL's default).")
    clip_cov_ratio: float = _f(2e-4, "policy_loss clip_cov: share (0, 1] of a micro-batch's valid tokens whose "
                                     "gradient is removed, drawn among the candidates (verl's default 2e-4).")
    clip_cov_lb: float = _f(1.0, "policy_loss clip_cov: a candidate's covariance (A - mean A)(logp - mean logp) "
                                 "lies above this (verl's default 1.0) ...")
    clip_cov_ub: float = _f(5.0, "... and below this (> clip_cov_lb; verl's default 5.0); tokens the PPO clip "
                                 "already clipped are no candidates.")
    kl_cov_ratio: float = _f(2e-4, "policy_loss kl_cov: share (0, 1] of a micro-batch's valid tokens, those of "
                                   "highest covariance, that get the KL penalty (verl's default 2e-4).")
    kl_cov_coef: float = _f(0.1, "policy_loss kl_cov: weight (>= 0) of |logp - old_logp| on the selected tokens "
                                 "(verl's policy_loss.ppo_kl_coef, default 0.1).")
    tis_lower_bound: float = _f(0.0, "policy_loss tis (ROLL): the token IS weight is truncated below at this (>= 0).")
    tis_upper_bound: float = _f(1.0, "policy_loss tis (ROLL): ... and above at this (>= tis_lower_bound).")
    topr_positive_weight: float = _f(
        1.0, "policy_loss topr (ROLL): weight (>= 0) of the positive responses' REINFORCE term. A response is "
             "positive when its advantage is > 0 (ROLL: its score > 0; the same split for 0/1 or +-1 rewards with a "
             "group baseline wherever the loss is not 0).")
    topr_negative_weight: float = _f(
        1.0, "policy_loss topr (ROLL): weight (>= 0) of the other responses' term, whose token ratios are truncated "
             "to [0, 1].")
    kimi15_tau: float = _f(0.1, "policy_loss kimi15 (ROLL): weight tau (>= 0) of tau/2 * (logp - old_logp)^2.")
    use_kl_loss: bool = _f(False, "Add kl_loss_coef * KL(policy || reference) to the loss (starts "
                                  "the reference role). The GSPO paper uses none.")
    kl_loss_coef: float = _f(0.001, "Weight of the KL loss (>= 0).")
    kl_estimator: str = _f("k3", "Per-token KL estimator: k1 (log-ratio), k2 (half squared), k3 "
                                 "(low-variance, always >= 0). k3 clamps the log-ratio logp - ref_logp "
                                 "to [-20, 20] before exp and its value to at most 10 (as verl's "
                                 "low_var_kl does), so one extreme token can neither overflow nor carry "
                                 "a huge gradient; a token beyond either clamp adds no gradient.",
                           KL_ESTIMATORS)
    use_opd: bool = _f(
        False, "On-policy distillation (ROLL's key): the frozen `teacher` role scores each sampled response and "
               "every token's advantage gets -opd_kl_coef * (old_logp - teacher_logp) "
               "([algorithm.md](algorithm.md#on-policy-distillation-use_opd-teacher)).")
    opd_kl_coef: float = _f(
        1.0, "use_opd: weight (>= 0) of the per-token reverse KL in the advantages (ROLL sets it per teacher, "
             "default 1.0; slime's --opd-kl-coef).")
    is_pure_opd: bool = _f(
        False, "Pure on-policy distillation (ROLL's key; its OPD launcher sets it): the advantages are the teacher "
               "term alone, -opd_kl_coef * (old_logp - teacher_logp), no task reward (rewards are still scored and "
               "logged). Needs `teacher`; exclusive with use_opd, as in ROLL.")
    opsd: bool = _f(
        False, "On-policy self-distillation (prime-rl's `opsd`): the teacher scores each response with "
               "`opsd_template` (the row's reference answer) before its prompt; with use_opd or is_pure_opd. The "
               "teacher's model follows the student's when it names none.")
    opsd_template: str = _f(
        "Reference answer: {demonstration}\n",
        "opsd: the privileged context put before the teacher's prompt (only the teacher sees it); "
        "`{demonstration}` is the row's reference answer (`ground_truth`).")
    add_token_level_kl: bool = _f(False, "Subtract init_kl_coef * (old_logp - ref_logp) from each "
                                         "token's reward before advantages (starts the reference).")
    init_kl_coef: float = _f(0.2, "Coefficient of the token-level KL penalty (>= 0).")
    loss_agg_mode: str = _f(
        "seq-mean-token-mean", "How the per-token loss matrix becomes a scalar. "
        "`seq-mean-token-mean` with importance_sampling seq is exactly GSPO's objective; "
        "`token-mean` weights long responses more; `seq-mean-token-sum` favours long responses; "
        "`seq-mean-token-sum-norm` divides by a constant length (Dr.GRPO).", LOSS_AGG_MODES)
    loss_norm_length: Optional[int] = _f(None, "T_norm of `seq-mean-token-sum-norm` (>= 1). Null: response_length.")
    whiten_advantages: bool = _f(False, "Masked z-score of advantages over the batch, "
                                        "(A - mean) / sqrt(var + 1e-8): a batch whose advantages "
                                        "are all equal whitens to 0.")
    advantage_clip: Optional[float] = _f(None, "Clamp advantages to [-c, c] (null: off).")
    reward_clip: Optional[float] = _f(None, "Clamp rewards to [-c, c] after normalisation (null: off).")
    reward_norm: Optional[str] = _f(
        None, "Reward normalisation before the estimator: null, `group` (per prompt), `batch`, `running` (running "
              "statistics, saved in checkpoints).",
        REWARD_NORMS)
    reward_shift: bool = _f(False, "With reward_norm: only subtract the mean.")
    reward_scale: bool = _f(False, "With reward_norm: only divide by the std (with reward_shift false too: the full"
                                   " z-score). A set (group, batch, running window) whose std is <= 1e-6, i.e. all "
                                   "rewards equal, is never divided by it: scaled only it keeps its rewards, "
                                   "centred it becomes 0; such prompt groups are counted in "
                                   "`reward/zero_std_groups`.")
    old_logprob_source: str = _f(
        "auto", "Where the ratio's old log-probs come from: `trainer` recomputes them (one more forward pass, "
                "exact), `rollout` takes the rollout engine's sampled-token log-probs (saves that pass), `auto` "
                "takes `rollout` where those are exact and nothing needs the trainer's pass, else `trainer`; the "
                "run logs which and why ([algorithm.md](algorithm.md#old-log-probs-old_logprob_source)).",
        OLD_LOGPROB_SOURCES)
    old_logprob_auto_max_gap: Optional[float] = _f(
        None, "`old_logprob_source: auto` outside fp32: the mean per-token |trainer - rollout| gap below which the "
              "old log-probs come from the rollout engine, re-measured each step; null: a tenth of pg_clip_low, 0: "
              "never ([algorithm.md](algorithm.md#old-log-probs-old_logprob_source)).")
    train_infer_correction: TrainInferCorrectionConfig = _sub(
        TrainInferCorrectionConfig, "ROLL's rollout correction (train-inference mismatch): importance weights "
                                    "pi_old / pi_rollout on the policy loss (is_weight) and rejection of "
                                    "outliers (filters); needs the trainer's old-log-prob pass "
                                    "([algorithm.md](algorithm.md#rollout-correction-train-inference-mismatch)).")
    rollout_correction: RolloutCorrectionConfig = _sub(
        RolloutCorrectionConfig, "verl's names (`algorithm.rollout_correction`) for train_infer_correction; "
                                 "writing both blocks is an error.")
    model_update_frequency: int = _f(
        1, "Push trained weights to the rollout engine every N steps; rollouts in between come from weights up to "
           "N-1 updates old, which only train_infer_correction corrects "
           "([algorithm.md](algorithm.md#rollout-correction-train-inference-mismatch)).")
    weight_sync_bucket_mb: float = _f(256.0, "Weights are sent to vLLM in buckets of at most this "
                                             "many MB (> 0; bounds the extra memory of a sync).")
    weight_sync_transport: str = _f(
        "auto", "How weight buckets reach the rollout ranks: `auto` takes CUDA IPC or NCCL on GPUs and shared "
                "memory or Ray's object store on CPU, `object_store` always the object store, `collective` a "
                "torch.distributed group of its own; decided per rollout worker, printed by `--dry-run` "
                "([placement.md](placement.md#weight-sync-routes)).",
        WEIGHT_SYNC_TRANSPORTS)
    weight_sync_timeout_s: float = _f(
        600.0, "Deadline (> 0) of each step of a weight sync: forming the collective group, every "
               "broadcast, every rollout rank's load of a bucket. A rollout worker that dies mid-sync, or "
               "leaves a health probe unanswered for `fault_tolerance.hang_timeout_s` while it loads a bucket "
               "(stopped, hung), is named and replaced well before it.")
    vllm_weight_update: str = _f(
        "auto", "How vLLM takes new weights: `auto` fills each layer directly and re-packs it once complete on CPU "
                "with an unquantized model, and uses vLLM's layerwise reload elsewhere; `layerwise` always the "
                "latter ([architecture.md](architecture.md#weight-sync)).",
        VLLM_WEIGHT_UPDATES)
    # --- colocation: roles sharing GPUs (roll_gspo.placement.colocation) ---
    is_offload_states: Optional[bool] = _f(
        None, "Whether roles sharing GPUs free memory between phases (ROLL's switch): vLLM sleeps after generating "
              "and actor_train moves its optimizer states to CPU after training. Null: on exactly when actor_infer "
              "shares a GPU with another role; on CPU nothing is freed ([gpu.md](gpu.md)).")
    offload_train_params: bool = _f(
        False, "With offloading between phases on: move actor_train's weights (DeepSpeed's "
               "lp_params: the full weights under ZeRO 1/2, this rank's shard under ZeRO-3) to CPU too, "
               "after the weight sync, and back before the next log-prob pass. Frees the weights' memory "
               "for vLLM's KV cache during generation at the cost of a copy per step.")
    is_offload_optimizer_states_in_train_step: bool = _refused_unless(
        False, "ROLL's offload of optimizer states during forward/backward inside a training step.",
        "not built; is_offload_states moves them to CPU between phases (outside the training step).")
    # --- Mixture-of-Experts (ignored keys are refused for dense models) ---
    router_replay: bool = _f(
        False, "Routing Replay (MoE only): the experts each token was routed to when the old "
               "log-probs were computed are replayed in every training forward pass (router "
               "weights still come from the current router). The GSPO paper's stabiliser for "
               "token-level GRPO on MoE models, which GSPO does without.")
    moe_aux_loss_coef: float = _f(
        0.0, "Weight of the MoE auxiliary load-balancing loss (Switch Transformer form, 1.0 when "
             "balanced) added to the policy loss (MoE only; 0: off). Its value is logged as "
             "`moe/aux_loss` for MoE models either way.")

    # --- ROLL's algorithm keys (roll_gspo.config.roll.roll_compat) ---
    pg_clip: Optional[float] = _f(
        None, "ROLL's symmetric clip range: when set and use_pg_clip_range is not true, both "
              "pg_clip_low and pg_clip_high take it (writing them too is an error). ROLL's default "
              "0.2 applies there whenever a YAML sets none of these, also under GSPO; here the "
              "defaults are the paper's 3e-4 / 4e-4.")
    use_pg_clip_range: Optional[bool] = _f(
        None, "ROLL: true reads pg_clip_low / pg_clip_high, false reads pg_clip. Here "
              "pg_clip_low / pg_clip_high are always read; true with pg_clip set is an error.")
    norm_mean_type: Optional[str] = _f(
        None, "ROLL's newer reward normalisation: the statistic whose mean is subtracted (null: none); with "
              "norm_std_type it maps onto reward_norm / reward_shift / reward_scale "
              "([roll_compat.md](roll_compat.md)).", NORM_TYPES)
    norm_std_type: Optional[str] = _f(
        None, "ROLL: statistic whose std divides the rewards (null: none). See norm_mean_type.",
        NORM_TYPES)
    entropy_loss_coef: float = _f(
        0.0, "Entropy bonus: the loss gets - entropy_loss_coef * agg(token entropy) (same "
             "loss_agg_mode). > 0 favours exploration.")
    max_len_mask: bool = _f(False, "Leave responses cut at the generation cap (no end of sequence) "
                                   "out of the loss. Counted in `actor/max_len_mask_ratio`.")
    difficulty_mask: bool = _f(
        False, "Leave out of the loss the groups whose mean score is <= difficulty_low_threshold "
               "(too hard) or >= difficulty_high_threshold (too easy). Counted in "
               "`actor/difficulty_mask_ratio`.")
    difficulty_low_threshold: float = _f(0.0, "Lower bound of difficulty_mask (exclusive).")
    difficulty_high_threshold: float = _f(1.0, "Upper bound of difficulty_mask (exclusive).")
    error_max_len_clip: bool = _f(
        False, "As ROLL: keep in the loss only responses scoring exactly 1, and those scoring 0 "
               "shorter than error_max_len_threshold tokens (other scores are left out too). "
               "Counted in `actor/error_len_mask_ratio`.")
    error_max_len_threshold: int = _f(9999999999, "Length threshold of error_max_len_clip (tokens).")
    difficulty_loss_weight: bool = _f(
        False, "Weight each response's loss by 0.5 + 1.5 * difficulty, from the data column "
               "`difficulty` (clamped to [0, 1]); weights are rescaled to mean 1 over the batch. "
               "A data file without the column is an error (ROLL skips silently).")
    length_loss_weight: bool = _f(
        False, "Weight each response's loss by 1.5 - its min-max-normalised length, rescaled to "
               "mean 1 over the rollout batch (ROLL normalises per micro-batch, which makes its "
               "weights depend on per_device_train_batch_size).")
    value_clip: Optional[float] = _f(
        None, "`adv_estimator: gae`: clip of the critic's value loss, 0.5 * max((V - R)^2, (clip(V, V_old - c, "
              "V_old + c) - R)^2) (null: the plain squared error). Without a critic it has no effect, as in ROLL.")
    gamma: float = _f(1.0, "`adv_estimator: gae`: discount of later tokens' rewards, in [0, 1] (ROLL's default 1: "
                           "the response's reward is undiscounted).")
    lambd: float = _f(0.95, "`adv_estimator: gae`: GAE's lambda, in [0, 1]: 1 is the Monte-Carlo return minus "
                            "the value (unbiased, high variance), 0 the one-step TD error (biased by the critic).")
    critic_warmup: int = _f(0, "`adv_estimator: gae`: steps at the start in which only the critic trains (the "
                               "actor's update waits for values worth using); the actor trains from step "
                               "critic_warmup + 1. Must be below max_steps.")
    global_template: Optional[str] = _f(
        None, "ROLL: one chat template for every role's data (training and validation prompts); "
              "a role's data_args.template that differs is an error.", CHAT_TEMPLATES)
    tag_to_template: Dict[str, str] = _f(
        {}, "ROLL's chat template per row tag. One template renders every prompt here (global_template, else "
            "actor_train.data_args.template), so each value names that template.")
    async_generation_ratio: float = _f(
        0.0, "How far rollout runs ahead of training (ROLL's asynchronous pipeline). 0: synchronous; 1: the next "
             "step's rollouts are generated while this step trains (one step stale); an integer k >= 2: rollouts "
             "stay in flight across steps as partial rollouts, none trained more than k policy versions after its "
             "oldest token was sampled ([async.md](async.md)).")
    async_pool_batches: float = _f(
        2.0, "With `async_generation_ratio` k >= 2: how many rollout batches of prompt (agentic: episode) groups "
             "are kept in flight, from 1 (no over-sampling) to k; a step takes the first complete groups and the "
             "rest carry over ([async.md](async.md#the-request-pool-roll_gspostrategiesrequest_poolpy)).")
    is_num_return_sequences_expand: bool = _refused_unless(
        False, "ROLL scheduler detail (G copies of a prompt instead of one request with n = G).",
        "vLLM samples num_return_sequences_in_group responses per prompt in one request here; "
        "the responses have the same distribution, remove the key.")
    rollout_mock: Optional[Dict[str, Any]] = _refused_unless(
        None, "ROLL's rollout dump/replay for precision checks.", "rollout dumping/mocking is "
        "not built.")
    reward_model: Optional[Dict[str, Any]] = _refused_unless(
        None, "ROLL's shared reward-model inference cluster.", "a shared reward-model cluster is "
        "not built; model-based reward workers load their model under rewards.<domain>.")
    # ROLL's LoRA anchors at the top level: they act only through `${lora_target}` etc. in a role's model_args.
    lora_target: Optional[str] = _f(None, "ROLL's top-level LoRA anchor, interpolated as `${lora_target}` into "
                                          "actor_train/actor_infer model_args (where it acts).")
    lora_rank: Optional[int] = _f(None, "ROLL's top-level anchor for model_args.lora_rank (see lora_target).")
    lora_alpha: Optional[int] = _f(None, "ROLL's top-level anchor for model_args.lora_alpha (see lora_target).")
    lora_sync: str = _f(
        "merged", "With LoRA, what the weight sync sends the rollout engine: `merged` the base weights with the "
                  "adapter merged in, `adapter` the adapter alone as a vLLM LoRA request (fewer bytes, slower "
                  "generation) ([lora.md](lora.md#what-is-synced-and-how)).",
        ["merged", "adapter"])

    max_grad_norm: Optional[float] = _f(
        None, "ROLL's pipeline-level gradient clip (its FSDP2 and Megatron strategies read this one, not "
              "training_args'): sets actor_train.training_args.max_grad_norm.")
    # --- the agentic pipeline (docs/agentic.md) ---
    custom_envs: Dict[str, CustomEnvConfig] = field(
        default_factory=dict, metadata={"help": "`pipeline: agentic`: the environments by tag "
                                                "(`custom_envs.<tag>.*`), played by the env managers' `tags`."})
    train_env_manager: EnvManagerConfig = _sub(EnvManagerConfig, "`pipeline: agentic`: the training episodes "
                                                                 "of each step.")
    val_env_manager: EnvManagerConfig = field(
        default_factory=lambda: EnvManagerConfig(generating_args=GeneratingArgs(temperature=0.0)),
        metadata={"help": "`pipeline: agentic`: validation episodes every eval_steps (greedy by default); "
                          "`val/success_rate` is the fraction of them solved."})
    sequence_length: int = _f(
        1024, "`pipeline: agentic`: token budget of one whole trajectory (system prompt, observations, tool "
              "results and every turn). A trajectory that reaches it ends truncated (`traj/truncated`); the "
              "rollout engine's max_model_len. Must fit the model's positions.")
    val_batch_size: int = _f(16, "`pipeline: agentic`: validation trajectories (a multiple of "
                                 "val_env_manager.group_size).")
    reward_normalization: RewardNormalizationConfig = _sub(
        RewardNormalizationConfig, "`pipeline: agentic`: how trajectory (or step) rewards are normalised "
                                   "before the advantage estimator (ROLL's block).")
    step_reward_gamma: float = _f(
        1.0, "`adv_estimator: step_reinforce`: discount of later turns' rewards in each turn's return "
             "G_t = r_t + gamma * G_{t+1}, in [0, 1].")
    batch_adjust_mode: str = _f(
        "copy", "`env_manager_cls: step` (a sample per turn, so the count varies): how the samples become a "
                "multiple of the mini-batch: `copy` repeats some, `delete` drops some, `auto` whichever changes "
                "fewer, `random_sample` as delete; drawn from seed and step ([agentic.md](agentic.md#keys)).",
        ["copy", "delete", "auto", "random_sample"])
    ratio_type: str = _refused_unless(
        "token", "ROLL's importance ratio unit for agentic runs (`segment`: per turn).",
        "per-turn ratios are not built; importance_sampling: seq takes one ratio over the agent tokens of "
        "the whole trajectory (or turn, with env_manager_cls: step).")
    episode_reward_weight: float = _refused_unless(1.0, "GiGPO's episode-level advantage weight.",
                                                   "GiGPO is not built (adv_estimator: grpo, reinforce, "
                                                   "step_reinforce).")
    step_reward_weight: float = _refused_unless(1.0, "GiGPO's step-level advantage weight.",
                                                "GiGPO is not built.")
    render_save_dir: Optional[str] = _f(
        None, "`pipeline: agentic`: each validation's episodes are written here as text transcripts "
              "(`val_step_<N>.jsonl`: tag, seed, reward, success, turns, the decoded conversation). "
              "ROLL saves rendered frames.")

    # --- the rollout endpoint and agents as environments (docs/endpoint.md) ---
    rollout_endpoint: RolloutEndpointConfig = _sub(
        RolloutEndpointConfig, "An OpenAI-compatible endpoint served by the rollout ranks during the run.")
    agent: AgentConfig = _sub(
        AgentConfig, "`pipeline: agentic`: an agent written against the `openai` client as the environment, "
                     "trained through the endpoint.")

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
    critic: Optional[RoleConfig] = field(
        default=None,
        metadata={"help": "`adv_estimator: gae` (PPO): the value model's ranks, ROLL's `critic` block with the keys"
                          " of actor_train (model_args, training_args, strategy_args `deepspeed_train` or "
                          "`fsdp2_train`, world_size, device_mapping, infer_batch_size); its model is the folder's "
                          "causal LM body with a new scalar head (null: `pretrain`) "
                          "([algorithm.md](algorithm.md#ppo-with-a-critic-adv_estimator-gae))."})
    student_train: Optional[RoleConfig] = field(default=None, metadata={
        "help": "ROLL's name for `actor_train` in its pure on-policy distillation YAMLs (written there, "
                "`is_pure_opd` is implied unless use_opd is set, as ROLL's OPD launcher sets it).",
        "alias_of": "actor_train", "alias_invert": False})
    student_infer: Optional[RoleConfig] = field(default=None, metadata={
        "help": "ROLL's name for `actor_infer` in its pure on-policy distillation YAMLs (see student_train).",
        "alias_of": "actor_infer", "alias_invert": False})
    teacher: Optional[RoleConfig] = field(
        default=None,
        metadata={"help": "`use_opd`: the frozen teacher model (ROLL's `teacher` block, the keys of `reference`: "
                          "model_args, strategy_args `hf_infer` or a frozen `deepspeed_train` / `fsdp2_train`, "
                          "world_size, device_mapping, infer_batch_size), scoring the student's sampled tokens "
                          "beside the reference pass; started only with use_opd or is_pure_opd (opsd: its model "
                          "follows the student's)."})
    teachers: Dict[str, RoleConfig] = field(
        default_factory=dict,
        metadata={"help": "ROLL's multi-teacher form: named teacher blocks (ROLL writes them under `teacher:`, read "
                          "here as `teachers`), each with its own opd_kl_coef and tag_included routing rows to it; "
                          "a row's term is the sum over the teachers that score it "
                          "([algorithm.md](algorithm.md#on-policy-distillation-use_opd-teacher))."})
    rewards: Dict[str, RewardConfig] = field(
        default_factory=lambda: {"math_rule": RewardConfig()},
        metadata={"help": "Reward workers per data domain (`rewards.<domain>.*`)."})
    tasks: Dict[str, TaskConfig] = field(
        default_factory=dict,
        metadata={"help": "Tasks generated as prompts and scored by their own rule (roll_gspo.tasks), by key: "
                          "the key is each row's domain, so metrics read `reward/<key>/...` and "
                          "`val/<key>/accuracy`. They replace `actor_train.data_args.file_name` (validation files "
                          "are added to the tasks' validation rows). Empty: prompts come from data files."})
    validation: ValidationConfig = _sub(ValidationConfig, "Held-out evaluation every eval_steps.")
    warm_start: WarmStartConfig = _sub(
        WarmStartConfig, "Rejection-sampling fine-tuning before RL: the policy's own correct replies, then RL.")

    # --- facts derived from the keys (no key of their own) ---
    def policy_parameters(self) -> Optional[int]:
        """The policy's parameter count when its config.json (or a built-in's registered config)
        says; None otherwise (for `memory_allocator: auto`). The reader is the config package's
        (`roll_gspo.config.plan.model_shape` knows model folders and the built-in registry, both above
        the schema), installed when it is imported; without it the size is unknown."""
        reader = _POLICY_SIZE_READERS[-1] if _POLICY_SIZE_READERS else None
        if reader is None:
            return None
        try:
            return reader(self)
        except Exception:  # noqa: BLE001  (an unreadable config: the size is unknown, auto keeps its CPU default)
            return None

    def has_rollout(self) -> bool:
        """An RL pipeline: a rollout engine, its weight sync and the policy loss (rlvr, agentic)."""
        return self.pipeline in ("rlvr", "agentic")

    def max_sequence_tokens(self) -> int:
        """Tokens of the longest sequence the rollout engine and the trainer see."""
        return self.sequence_length if self.pipeline == "agentic" else self.prompt_length + self.response_length

    def needs_reference(self) -> bool:
        """A reference model is started: a KL term needs its log-probs, and the policy is not LoRA-trained
        (then actor_train scores them with its adapter disabled)."""
        return self.needs_reference_log_probs() and not self.actor_train.model_args.uses_lora()

    def uses_teacher(self) -> bool:
        """On-policy distillation: a teacher role is started (use_opd or is_pure_opd with a `teacher`
        block or ROLL's named `teachers`; validation refuses either without one)."""
        return (self.use_opd or self.is_pure_opd) and bool(self.teacher_roles())

    def teacher_roles(self) -> Dict[str, "RoleConfig"]:
        """Every teacher block by its role name: `teacher` for the single block, `teacher.<name>` for each
        of ROLL's named teachers (empty when neither is given)."""
        if self.teachers:
            return {f"teacher.{name}": role for name, role in self.teachers.items()}
        return {"teacher": self.teacher} if self.teacher is not None else {}

    def uses_critic(self) -> bool:
        """PPO: a critic role is started (adv_estimator gae; validation refuses gae without a `critic`
        block and a critic block without gae)."""
        return self.adv_estimator in estimators.names(needs_critic=True) and self.critic is not None

    def critic_mini_batch_size(self) -> int:
        """Sequences per critic optimizer step, across the critic's ranks."""
        critic = self.critic
        if critic is None:
            raise ValueError("critic_mini_batch_size: the config has no critic block")
        args = critic.training_args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * critic.world_size

    def needs_reference_log_probs(self) -> bool:
        """A KL term needs the reference's log-probs (from the reference role, or LoRA's base model)."""
        return self.use_kl_loss or self.add_token_level_kl

    def mini_batch_size(self) -> int:
        """Sequences per optimizer step, across all data-parallel ranks."""
        args = self.actor_train.training_args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.actor_train.world_size


def is_block_type(tp: Any) -> TypeGuard[type]:
    """Whether the annotation `tp` is a block of the schema (a dataclass type, not an instance)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)
