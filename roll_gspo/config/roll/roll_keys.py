"""Every key of ROLL's RLVR YAMLs and where it lands here: the data of the "ROLL keys" table in
docs/config_reference.md (roll_gspo.config.load.config_reference.render_roll_table)."""
from __future__ import annotations

from typing import Dict, Optional

# --------------------------------------------------------------------------------------------
# Every key of ROLL's RLVR YAMLs (example_gspo.yaml, the qwen2.5-7B-rlvr_megatron/*.yaml configs
# before and after v0.3.0, the deepspeed_zero*.yaml presets) and where it lands here. Keys that
# are fields of the schema are described from it (docs: reference.render_roll_table); the
# others carry their note here. `<role>` is actor_train / actor_infer / reference / validation.
# --------------------------------------------------------------------------------------------
ROLL_KEY_NOTES: Dict[str, Optional[str]] = {
    "defaults": "Hydra composition; ROLL's `../config/deepspeed_zero*@_here_` entries resolve to "
                "configs/deepspeed_zero*.yaml when the YAML has no `../config/` folder of its own.",
    "hydra.run.dir / hydra.output_subdir": "Checked by Hydra, then accepted only at ROLL's values "
                                           "(`.` / null: what run_pipeline.py does, which never runs "
                                           "under @hydra.main); other hydra keys are refused, except "
                                           "hydra.searchpath, which acts.",
    "deepspeed_zero / deepspeed_zero2 / deepspeed_zero2_cpuoffload / deepspeed_zero3 / "
    "deepspeed_zero3_cpuoffload": "Top-level blocks of the presets: interpolation anchors "
                                  "(`${deepspeed_zero3}`), removed after resolution.",
    "exp_name": None, "seed": None, "logging_dir": "TensorBoard folder here (ROLL: text logs; its "
    "TensorBoard folder is tracker_kwargs.log_dir, which is read into logging_dir).",
    "output_dir": None, "system_envs": None, "checkpoint_config.type": None,
    "checkpoint_config.output_dir": None, "track_with": None, "tracker_kwargs": None,
    "num_gpus_per_node": None, "max_steps": None, "save_steps": None, "logging_steps": None,
    "eval_steps": None, "resume_from_checkpoint": "`false` / `true` are accepted as null / `auto`.",
    "max_ckpt_to_keep": None, "rollout_batch_size": None, "prompt_length": None,
    "response_length": None, "num_return_sequences_in_group": None, "ppo_epochs": None,
    "adv_estimator": "gae (PPO with the `critic` block), reinforce, grpo and rloo act.",
    "gamma": None, "lambd": None, "critic_warmup": None,
    "critic": "ROLL's value-model role (adv_estimator: gae); its keys are actor_train's (`<role>.*`).",
    "importance_sampling": None, "use_kl_loss": None, "kl_loss_coef": None, "loss_agg_mode": None,
    "value_clip": None, "reward_clip": None, "advantage_clip": None, "dual_clip_loss": None,
    "pg_clip": None, "use_pg_clip_range": None, "pg_clip_low": None, "pg_clip_high": None,
    "entropy_loss_coef": None, "norm_mean_type": None, "norm_std_type": None,
    "reward_norm": "ROLL's RLVR config has no such field and silently drops it (with "
                   "reward_shift / reward_scale); here they act.",
    "reward_shift": None, "reward_scale": None, "max_len_mask": None, "difficulty_mask": None,
    "difficulty_low_threshold": None, "difficulty_high_threshold": None, "error_max_len_clip": None,
    "difficulty_loss_weight": None, "length_loss_weight": None, "add_token_level_kl": None,
    "whiten_advantages": None, "global_template": None, "async_generation_ratio": None,
    "train_infer_correction": None,
    "is_num_return_sequences_expand": None, "rollout_mock": None, "reward_model": None,
    "lora_target / lora_rank / lora_alpha": "Top-level anchors, acting through `${lora_*}` in model_args "
                                            "(docs/lora.md).",
    **{f"<role>.model_args.{key}": None for key in (
        "lora_target", "lora_rank", "lora_alpha", "lora_dropout", "additional_target", "adapter_name_or_path")},
    "pretrain": None, "reward_pretrain": None,
    "<role>.model_args.model_name_or_path": None, "<role>.model_args.attn_implementation": None,
    "<role>.model_args.disable_gradient_checkpointing": None, "<role>.model_args.dtype": None,
    "<role>.model_args.model_type": None, "<role>.model_args.ulysses_size": None,
    "<role>.training_args.learning_rate": None, "<role>.training_args.weight_decay": None,
    "<role>.training_args.per_device_train_batch_size": None,
    "<role>.training_args.gradient_accumulation_steps": None, "<role>.training_args.warmup_steps": None,
    "<role>.training_args.num_train_epochs": "Read by the SFT pipeline; RLVR runs max_steps.",
    "<role>.data_args.template": None, "<role>.data_args.file_name": None,
    "<role>.data_args.domain_interleave_probs": "Per-domain mix of each rollout batch (placement and "
                                                "mixing runtime; see its entry in the reference).",
    "<role>.data_args.dataset_dir": None, "<role>.data_args.messages": None,
    "<role>.data_args.interleave_probs": None, "<role>.data_args.preprocessing_num_workers": None,
    "<role>.generating_args.max_new_tokens": None, "<role>.generating_args.top_p": None,
    "<role>.generating_args.top_k": None, "<role>.generating_args.num_beams": None,
    "<role>.generating_args.temperature": None, "<role>.generating_args.num_return_sequences": None,
    "<role>.strategy_args.strategy_name": "deepspeed_train, deepspeed_infer, fsdp2_train, fsdp2_infer, vllm, "
                                          "hf_infer act; megatron_train/megatron_infer/sglang are refused "
                                          "naming the strategy to use and the keys to change.",
    "<role>.strategy_args.strategy_config": None,
    # ROLL's FSDP2 keys (fsdp2_train / fsdp2_infer), described from schema.FSDP2StrategyConfig.
    **{f"<role>.strategy_args.strategy_config.{key}": None for key in (
        "fsdp_size", "param_dtype", "reduce_dtype", "enable_mix_precision", "reshard_after_forward",
        "offload_policy", "reduce_scatter_during_grad_accumulation", "wrap_policy", "async_save_ckpt",
        "save_only_model", "use_batched_model_update", "apply_expert_patch", "apply_tiled_mlp",
        "tiled_num_shards", "model_type")},
    "<role>.device_mapping": "ROLL's GPU list of a role (placement runtime; see its entry in the "
                             "reference). ROLL `eval`s the string; here it is parsed.",
    "<role>.infer_batch_size": None, "<role>.use_dynamic_batching_in_train": None,
    "<role>.use_dynamic_batching_in_infer": None, "<role>.max_tokens_per_microbatch_in_train": None,
    "<role>.max_tokens_per_microbatch_in_infer": None, "<role>.sequence_length_round_in_train": None,
    "<role>.sequence_length_round_in_infer": None, "<role>.use_sequence_packing": None,
    "<role>.sequence_packing_args": None, "<role>.system_envs": None,
    "pg_variant": None, "<role>.pg_variant": None, "<role>.worker_cls": None, "<role>.topr_positive_weight": None,
    "<role>.topr_negative_weight": None,
    "rewards.<domain>.worker_cls": "ROLL's class paths map onto this project's workers "
                                   "(roll_compat.ROLL_REWARD_WORKERS); one without a worker here "
                                   "fails --dry-run naming the available ones.",
    "rewards.<domain>.tag_included": None, "rewards.<domain>.world_size": None,
    "rewards.<domain>.infer_batch_size": None, "rewards.<domain>.model_args": None,
    "rewards.<domain>.data_args": None, "rewards.<domain>.generating_args": None,
    "rewards.<domain>.strategy_args": None,
    "rewards.<domain>.device_mapping": "As <role>.device_mapping.",
    "rewards.<domain>.reward_type / response_length_penalty_coef / use_local / judge_prompt / "
    "judge_model_type / query_filter_config": "Options of the reward workers and of dynamic "
                                              "sampling (see their entries in the reference).",
}
