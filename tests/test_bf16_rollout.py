"""bf16 on both sides (examples/example_gspo_smollm2.yaml on a CPU with bf16 instructions): DeepSpeed
trains in bf16, vLLM samples in bf16, and their kernels disagree. Each step (each weight sync)
reports the trainer-vs-rollout gap, `auto` then takes the trainer's old log-probs, and the rollout
correction weights the loss. test_rollout_correction.py covers bf16 vLLM against an fp32 trainer."""
import json
import math

import pytest


@pytest.mark.e2e
def test_bf16_trainer_and_vllm_report_the_gap_each_step_and_correct_it(tmp_path, tiny_model, ray_session):
    from omegaconf import OmegaConf

    from pipelines.rlvr_pipeline import run_rlvr
    from roll_gspo.config import load_config

    config = {
        "exp_name": "bf16", "output_dir": str(tmp_path / "out"), "pretrain": tiny_model, "seed": 1,
        "max_steps": 2, "eval_steps": 0, "save_steps": 0, "track_with": "none", "adv_estimator": "grpo",
        "importance_sampling": "seq", "rollout_batch_size": 4, "num_return_sequences_in_group": 2,
        "prompt_length": 16, "response_length": 6, "pg_clip_low": 3e-3, "pg_clip_high": 4e-3,
        # the example's correction: GSPO's unit (geometric), truncated at 1.2; old_logprob_source auto
        "train_infer_correction": {"is_weight": {"enabled": True, "weight_type": "geometric", "upper_bound": 1.2}},
        "actor_train": {"model_args": {"dtype": "bf16"},
                        "training_args": {"learning_rate": 1e-3, "per_device_train_batch_size": 8,
                                          "gradient_accumulation_steps": 1},
                        "data_args": {"file_name": ["builtin:arith/train"]}, "world_size": 1,
                        "num_cpus_per_worker": 0.5},
        "actor_infer": {"model_args": {"dtype": "bf16"},
                        "strategy_args": {"strategy_name": "vllm",
                                          "strategy_config": {"max_model_len": 32, "enforce_eager": True,
                                                              "dtype": "bfloat16"}},
                        "num_cpus_per_worker": 0.5},
        "rewards": {"math_rule": {"worker_cls": "roll_gspo.workers.rewards.FunctionRewardWorker",
                                  "reward_fn": "tests.reward_fns:digit_fraction", "num_cpus_per_worker": 0.25}},
    }
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(config), path)
    run_rlvr(load_config(str(path)))
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:  # every step: new weights synced, gap measured on them before the update
        assert "sync/seconds" in record
        assert record["rollout/logprob_gap"] > 0  # bf16 kernels differ (fp32 on both sides: ~1e-5)
        assert record["drift/gap"] < 0.1 and record["drift/breaches"] == 0  # bf16's drift: no alarm
        assert record["rollout/old_logprobs_from_rollout"] == 0.0  # the correction needs the trainer's pass
        assert record["rollout_correction/k3_kl"] >= 0 and "rollout_correction/clipped_fraction" in record
        assert record["rollout_correction/weight_max"] <= 1.2 + 1e-6
        assert math.isfinite(record["actor/pg_loss"])
