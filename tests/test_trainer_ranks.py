"""The training role's ranks on the real stack (Ray + DeepSpeed, no rollout): old log-probs with
uneven ZeRO-3 shards finish, a model with dropout has ratio exactly 1 before any update, and the
logged losses are the whole mini-batch's when it is split over ranks and micro-batches. A tiny
model; one reference and one trainer cluster."""
import json
import shutil

import pytest
import ray
import torch
from omegaconf import OmegaConf

from roll_gspo.algorithms import kl_loss, policy_loss
from roll_gspo.config import load_config
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import Cluster
from roll_gspo.models.causal_lm import build_sequences, response_token_log_probs

pytestmark = pytest.mark.e2e
# A regression (ranks waiting for each other forever) fails here instead of hanging the suite.
CALL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def dropout_model(tiny_model, tmp_path_factory):
    """The tiny model with attention dropout 0.5 in its config."""
    folder = tmp_path_factory.mktemp("dropout_model") / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def role_config(tmp_path, model, *, world_size, per_device, accumulation, zero_stage):
    base = {
        "exp_name": "ranks", "output_dir": str(tmp_path / "out"), "pretrain": model, "seed": 1,
        "adv_estimator": "grpo", "importance_sampling": "seq", "rollout_batch_size": 2,
        "num_return_sequences_in_group": 4, "prompt_length": 16, "response_length": 6,
        "pg_clip_low": 3e-3, "pg_clip_high": 4e-3, "use_kl_loss": True, "kl_loss_coef": 0.1,
        "actor_train": {
            "training_args": {"learning_rate": 1e-3, "per_device_train_batch_size": per_device,
                              "gradient_accumulation_steps": accumulation},
            "data_args": {"file_name": ["builtin:arith/train"]},
            "strategy_args": {"strategy_name": "deepspeed_train",
                              "strategy_config": {"zero_optimization": {"stage": zero_stage}}},
            "world_size": world_size, "num_cpus_per_worker": 0.5, "infer_batch_size": 2},
        "actor_infer": {"strategy_args": {"strategy_name": "hf_infer"}, "num_cpus_per_worker": 0.25},
        "reference": {"strategy_args": {"strategy_name": "deepspeed_train",
                                        "strategy_config": {"zero_optimization": {"stage": zero_stage}}},
                      "world_size": world_size, "num_cpus_per_worker": 0.5, "infer_batch_size": 2},
        "rewards": {"math_rule": {"worker_cls": "roll_gspo.workers.rewards.FunctionRewardWorker",
                                  "reward_fn": "tests.reward_fns:digit_fraction", "num_cpus_per_worker": 0.25}},
    }
    path = tmp_path / f"config_{world_size}.yaml"
    OmegaConf.save(OmegaConf.create(base), path)
    return load_config(str(path))


def sequences(rows, seed=0, vocab=100):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (rows,), generator=g)]
    responses = [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (rows,), generator=g)]
    input_ids, attention, prompt_lengths, response_mask = build_sequences(prompts, responses, 0)
    return Batch({"input_ids": input_ids, "attention_mask": attention, "prompt_lengths": prompt_lengths,
                  "response_mask": response_mask})


def call(refs):
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
    assert len(ready) == len(refs), f"ranks did not finish within {CALL_TIMEOUT_S} s (deadlocked?)"
    return ray.get(refs)


def start(name, worker_cls, cfg, role, **kwargs):
    cluster = Cluster(name, worker_cls, role.world_size, role.num_cpus_per_worker, 0, init_args=(cfg,),
                      init_kwargs=kwargs)
    call(cluster.setup_async())
    return cluster


def expected_log_probs(model_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs, _ = response_token_log_probs(model, batch["input_ids"], batch["attention_mask"],
                                                batch["prompt_lengths"], batch["response_mask"].shape[1])
    return log_probs


def test_zero3_uneven_shards_no_dropout_and_split_invariant_losses(tmp_path, dropout_model, ray_session):
    from roll_gspo.workers.actor_train import ActorTrainWorker
    from roll_gspo.workers.reference import ReferenceWorker

    # 5 rows over 2 ranks, 2 per forward pass: rank 0 needs 1 pass, rank 1 needs 2 (ZeRO-3 gathers
    # parameters in every pass, so unequal passes used to deadlock).
    uneven = sequences(5, seed=3)
    expected = expected_log_probs(dropout_model, uneven)
    mask = uneven["response_mask"].bool()
    zero3 = role_config(tmp_path, dropout_model, world_size=2, per_device=2, accumulation=2, zero_stage=3)
    reference = start("ranks_reference", ReferenceWorker, zero3, zero3.reference)
    try:
        ref = Batch.concat(call(reference.dispatch_async("compute_log_probs", uneven)))["ref_log_probs"]
        torch.testing.assert_close(ref[mask], expected[mask], rtol=1e-5, atol=1e-5)
    finally:
        reference.shutdown()

    batch = sequences(8, seed=4)
    g = torch.Generator().manual_seed(5)
    batch["advantages"] = torch.randn(8, 1, generator=g).expand_as(batch["response_mask"]).clone()
    # 2 ranks x 2 micro-batches of 2 rows: one mini-batch of 8 rows, split 4 ways.
    trainer = start("ranks_train", ActorTrainWorker, zero3, zero3.actor_train, total_optimizer_steps=2)
    try:
        old = Batch.concat(call(trainer.dispatch_async("compute_log_probs", uneven)))["old_log_probs"]
        torch.testing.assert_close(old[mask], expected[mask], rtol=1e-5, atol=1e-5)
        old = Batch.concat(call(trainer.dispatch_async("compute_log_probs", batch)))["old_log_probs"]
        batch["old_log_probs"] = old
        batch["ref_log_probs"] = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(6))
        per_rank = call(trainer.dispatch_async("train_step", batch))  # one mini-batch: the first
    finally:
        trainer.shutdown()

    valid = batch["response_mask"]
    _, want_pg = policy_loss(batch["old_log_probs"], batch["old_log_probs"], batch["advantages"], valid,
                             clip_low=3e-3, clip_high=4e-3)
    _, want_kl = kl_loss(batch["old_log_probs"], batch["ref_log_probs"], valid)
    for metrics in per_rank:
        # Dropout off in every RL forward pass: the first mini-batch sees ratio 1 exactly.
        assert metrics["actor/ratio_min"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["actor/clipfrac"] == 0.0
        # The whole mini-batch's losses, not divided by gradient_accumulation_steps x world_size.
        assert metrics["actor/pg_loss"] == pytest.approx(want_pg["actor/pg_loss"], rel=1e-4, abs=1e-6)
        assert metrics["actor/kl_loss"] == pytest.approx(want_kl["actor/kl_loss"], rel=1e-4, abs=1e-6)
        assert metrics["actor/kl_mean"] == pytest.approx(want_kl["actor/kl_mean"], rel=1e-4)


def test_moe_zero3_uneven_shards_score_record_and_train(tmp_path, tiny_moe_model, ray_session):
    """The MoE path (routing recorded with the old log-probs) keeps uneven ZeRO-3 ranks in step
    too: 5 rows over 2 ranks, 2 rows per pass; then a step with routing metrics on 4 rows."""
    from roll_gspo.workers.actor_train import ActorTrainWorker

    uneven = sequences(5, seed=3)
    expected = expected_log_probs(tiny_moe_model, uneven)
    mask = uneven["response_mask"].bool()
    zero3 = role_config(tmp_path, tiny_moe_model, world_size=2, per_device=2, accumulation=1, zero_stage=3)
    trainer = start("ranks_moe", ActorTrainWorker, zero3, zero3.actor_train, total_optimizer_steps=2)
    try:
        scored = Batch.concat(call(trainer.dispatch_async("compute_log_probs", uneven)))
        torch.testing.assert_close(scored["old_log_probs"][mask], expected[mask], rtol=1e-5, atol=1e-5)
        assert scored["routed_experts"].shape[:2] == uneven["input_ids"].shape
        batch = sequences(4, seed=4)
        batch["old_log_probs"] = batch["ref_log_probs"] = expected_log_probs(tiny_moe_model, batch)
        batch["routed_experts"] = Batch.concat(call(trainer.dispatch_async("compute_log_probs", batch)))["routed_experts"]
        batch["advantages"] = torch.randn(4, 1, generator=torch.Generator().manual_seed(5)).expand_as(
            batch["response_mask"]).clone()
        per_rank = call(trainer.dispatch_async("train_step", batch))
    finally:
        trainer.shutdown()
    assert all(0.0 <= metrics["moe/expert_volatility"] <= 1.0 for metrics in per_rank)
