"""MoE policy end to end on the real stack: Ray, vLLM's CPU MoE backend, DeepSpeed ZeRO-2 and
ZeRO-3, two steps each; vLLM's log-probs equal the trainer's after each sync, routing metrics are
logged, Routing Replay and the aux loss run."""
import math

import pytest
import ray
import torch

from roll_gspo.distributed.batch import Batch
from tests.test_pipeline_e2e import write_config

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("zero_stage, update, algorithm", [
    (2, "auto", dict(importance_sampling="seq")),
    # replay under ZeRO-3: the routers' weights are partitioned; the hooks only touch their outputs.
    # With gradient checkpointing, the backward's recomputation must replay too.
    (3, "layerwise", dict(importance_sampling="token", pg_clip_low=0.2, pg_clip_high=0.28, router_replay=True,
                          moe_aux_loss_coef=0.01, gradient_checkpointing=True)),
])
def test_moe_two_steps_vllm_matches_trainer(tmp_path, tiny_moe_model, ray_session, zero_stage, update, algorithm):
    from pipelines.rlvr_pipeline import make_prompt_group_source
    from pipelines.trainer_loop import TrainerLoop

    algorithm = dict(algorithm)
    checkpointing = algorithm.pop("gradient_checkpointing", False)
    cfg = write_config(tmp_path, tiny_moe_model, max_steps=2, vllm_weight_update=update, **algorithm,
                       actor_train={"strategy_args": {"strategy_config": {"zero_optimization": {"stage": zero_stage}}},
                                    "model_args": {"gradient_checkpointing": checkpointing}})
    pipeline = TrainerLoop(cfg, make_prompt_group_source)
    try:
        fixed = Batch(meta={"prompt_ids": [[20, 21, 15, 22], [23, 24, 15], [25, 15, 26, 27, 28]],
                            "response_ids": [[20, 21, 1], [22, 1], [23, 24, 25, 1]]})
        pipeline._add_sequence_tensors(fixed)

        def gap():
            vllm_rows = ray.get(pipeline.actor_infer.workers[0].score.remote(fixed))
            trainer = pipeline.actor_train.dispatch("compute_log_probs", pipeline._view(fixed))["old_log_probs"]
            return max(float((torch.tensor(v) - trainer[i, :len(v)]).abs().max()) for i, v in enumerate(vllm_rows))

        assert gap() < 1e-3
        for step in (1, 2):
            metrics = pipeline.step(step)  # generate, reward, old log-probs + routing, train, sync
            assert gap() < 1e-3, step  # the dense model's tolerance (test_weight_sync_makes_vllm_match_trainer)
            for key in ("moe/expert_volatility", "moe/expert_volatility_train", "moe/load_balance_max_over_mean",
                        "moe/aux_loss", "moe/aux_loss_coef", "rollout/logprob_gap", "actor/grad_norm"):
                assert key in metrics and math.isfinite(metrics[key]), key
            assert 0.0 <= metrics["moe/expert_volatility"] <= 1.0
            assert metrics["moe/load_balance_max_over_mean"] >= 1.0
            assert metrics["moe/aux_loss_coef"] == cfg.moe_aux_loss_coef
            assert metrics["rollout/logprob_gap"] < 1e-3
    finally:
        pipeline.shutdown()
