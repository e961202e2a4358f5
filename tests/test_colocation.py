"""Colocation (roll_gspo.placement.colocation): which roles share the rollout's GPUs, vLLM's memory share,
sleep/offload keys and their refusals, the CPU skip line, the GPU recipe's dry run, and
(subprocess) DeepSpeed's state offload round trip on CPU. Fast except the e2e run at the end."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from roll_gspo.placement.colocation import (colocation, cpu_skip_message, offload_between_phases, sleep_level,
    start_rollout_first)
from roll_gspo.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def load(tmp_path):
    def load(**changes):
        path = tmp_path / "c.yaml"
        base = OmegaConf.create({"actor_train": {"data_args": {"file_name": ["builtin:arith/train"]}},
                                 "rollout_batch_size": 8, "num_gpus_per_node": 1})
        OmegaConf.save(OmegaConf.merge(base, OmegaConf.create(changes)), path)
        return load_config(str(path))
    return load


def engine(cfg):
    return cfg.actor_infer.strategy_args.strategy_config


def test_overlapping_maps_colocate_and_vllm_reserves_its_share(load):
    cfg = load(actor_train={"device_mapping": "[0]"}, actor_infer={"device_mapping": "[0]"})
    placement = colocation(cfg)
    assert placement.colocated and placement.shared_with == ["actor_train"] and placement.share == 0.5
    assert offload_between_phases(cfg) and engine(cfg)["gpu_memory_utilization"] == 0.5
    assert start_rollout_first(cfg)  # vLLM sizes its KV cache before the trainer allocates
    # The sft pipeline has no rollout to offload around, whatever the mappings say.
    assert not offload_between_phases(load(pipeline="sft", actor_train={"device_mapping": "[0]"},
                                           actor_infer={"device_mapping": "[0]"}))
    # Three ranks on one GPU (the reference with a KL loss): a third each, rounded down.
    cfg = load(use_kl_loss=True, actor_train={"device_mapping": "[0]"}, actor_infer={"device_mapping": "[0]"},
               reference={"device_mapping": "[0]"})
    assert engine(cfg)["gpu_memory_utilization"] == 0.3333
    # Disjoint maps share nothing: vLLM keeps its own default and nobody sleeps.
    cfg = load(num_gpus_per_node=2, actor_train={"device_mapping": "[0]"}, actor_infer={"device_mapping": "[1]"})
    assert not colocation(cfg).colocated and not offload_between_phases(cfg)
    assert "gpu_memory_utilization" not in engine(cfg)
    # An explicit value within the share is kept; is_offload_states: false is obeyed.
    cfg = load(is_offload_states=False, actor_train={"device_mapping": "[0]"},
               actor_infer={"device_mapping": "[0]", "strategy_args": {"strategy_config": {"gpu_memory_utilization": 0.4}}})
    assert engine(cfg)["gpu_memory_utilization"] == 0.4 and not offload_between_phases(cfg)


def test_roll_recipe_reserving_more_than_an_equal_split_runs_with_offloading(load):
    """ROLL's GSPO example (tests/data/roll/example_gspo.yaml) puts vLLM at 0.8 on GPUs it shares
    with actor_train and the reference: it relies on the others leaving the GPU while vLLM is
    awake, which offloading does here too; without offloading the same value is refused."""
    roll_like = dict(num_gpus_per_node=8, use_kl_loss=True,
                     actor_train={"device_mapping": "list(range(0,16))", "model_args": {"dtype": "bf16"},
                                  "strategy_args": {"strategy_config": {"zero_optimization": {"stage": 3}}}},
                     actor_infer={"device_mapping": "list(range(0,12))", "model_args": {"dtype": "bf16"},
                                  "strategy_args": {"strategy_config": {"gpu_memory_utilization": 0.8}}},
                     reference={"device_mapping": "list(range(0,16))"})
    cfg = load(**roll_like)
    assert colocation(cfg).shared_with == ["actor_train", "reference"] and offload_between_phases(cfg)
    assert engine(cfg)["gpu_memory_utilization"] == 0.8
    with pytest.raises(ConfigError, match=r"GPU 0 holds actor_infer x1, actor_train x1, reference x1, all resident"):
        load(is_offload_states=False, **roll_like)


def test_fractional_gpus_colocate_with_ray_fractions_as_shares(load):
    cfg = load(actor_train={"num_gpus_per_worker": 0.5}, actor_infer={"num_gpus_per_worker": 0.5})
    assert colocation(cfg).shared_with == ["actor_train"] and engine(cfg)["gpu_memory_utilization"] == 0.5
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization = 0.6 is more than the 0.5 of a GPU"):
        load(actor_train={"num_gpus_per_worker": 0.5},
             actor_infer={"num_gpus_per_worker": 0.5, "strategy_args": {"strategy_config": {"gpu_memory_utilization": 0.6}}})
    # CPU rollout: nothing shared, nothing filled, offloading off unless asked for.
    cfg = load()
    assert not colocation(cfg).on_gpu and not offload_between_phases(cfg) and "gpu_memory_utilization" not in engine(cfg)
    assert not start_rollout_first(cfg)


@pytest.mark.parametrize("changes, message", [
    (dict(is_offload_states=False, actor_train={"device_mapping": "[0]"},
          actor_infer={"device_mapping": "[0]", "strategy_args": {"strategy_config": {"gpu_memory_utilization": 0.9}}}),
     r"gpu_memory_utilization = 0.9: GPU 0 holds actor_infer x1, actor_train x1, all resident .* sums to 1.4 > 1"),
    (dict(actor_train={"device_mapping": "[0]"},
          actor_infer={"device_mapping": "[0]", "strategy_args": {"strategy_config": {"gpu_memory_utilization": 1.5}}}),
     r"gpu_memory_utilization = 1.5: must be a number in \(0, 1\]"),
    (dict(actor_infer={"strategy_args": {"strategy_config": {"sleep_level": 3}}}), r"sleep_level = 3: must be 1"),
    (dict(is_offload_states=True, model_update_frequency=2,
          actor_infer={"strategy_args": {"strategy_config": {"sleep_level": 2}}}),
     r"sleep_level = 2 discards vLLM's weights .* model_update_frequency = 2"),
    (dict(actor_infer={"strategy_args": {"strategy_name": "hf_infer", "strategy_config": {"sleep_level": 1}}}),
     r"sleep_level: only the vllm rollout strategy sleeps"),
    (dict(actor_infer={"strategy_args": {"strategy_config": {"enable_sleep_mode": True}}}),
     r"enable_sleep_mode = true: vLLM has no sleep mode on CPU"),
    (dict(actor_train={"device_mapping": "[0]"},
          actor_infer={"device_mapping": "[0]", "strategy_args": {"strategy_config": {"enable_sleep_mode": False}}}),
     r"enable_sleep_mode = false contradicts sleeping between phases \(is_offload_states is null: on"),
    (dict(offload_train_params=True), r"offload_train_params = true does nothing without offloading"),
    (dict(is_offload_states=True, actor_train={"model_args": {"dtype": "bf16"}}),
     r"is_offload_states \(= true\) with actor_train.model_args.dtype = bf16 needs ZeRO stage >= 1"),
    (dict(is_offload_optimizer_states_in_train_step=True), r"is_offload_optimizer_states_in_train_step"),
    (dict(pipeline="sft", is_offload_states=True), r"the sft pipeline has no rollout phase"),
])
def test_colocation_keys_refused_naming_the_key(load, changes, message):
    with pytest.raises(ConfigError, match=message):
        load(**changes)


def test_cpu_run_says_once_that_sleep_and_offload_are_skipped(load, caplog, monkeypatch):
    from pipelines.setup import log_colocation
    from roll_gspo.config.plan.run_plan import build_run_plan

    monkeypatch.delenv("ROLL_GSPO_OFFLOAD_ON_CPU", raising=False)
    cfg = load(is_offload_states=True)
    with caplog.at_level(logging.INFO, logger="roll_gspo"):
        assert log_colocation(cfg, build_run_plan(cfg)) is True
    lines = [r.getMessage() for r in caplog.records if "is_offload_states" in r.getMessage()]
    assert len(lines) == 1 and "run on CPU" in lines[0] and "skipped" in lines[0]
    assert cpu_skip_message(load()) is None  # nothing asked for, nothing said
    gpu = load(actor_train={"device_mapping": "[0]"}, actor_infer={"device_mapping": "[0]"})
    assert cpu_skip_message(gpu) is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="roll_gspo"):
        log_colocation(gpu, build_run_plan(gpu))
    assert "vLLM sleeps (level 1)" in caplog.text and "gpu_memory_utilization 0.5" in caplog.text


def test_one_gpu_recipe_colocates_both_roles_on_half_a_gpu(tmp_path):
    """configs/gpu/qwen2.5-0.5b_1gpu.yaml (its dry run on the cluster it names is
    tests/test_placement_plan.py's) against a folder holding only Qwen2.5-0.5B's config.json."""
    (tmp_path / "config.json").write_text((REPO / "tests" / "data" / "model_configs" / "Qwen2.5-0.5B.json").read_text())
    cfg = load_config(str(REPO / "configs" / "gpu" / "qwen2.5-0.5b_1gpu.yaml"), [f"pretrain={tmp_path}"])
    assert colocation(cfg).shared_with == ["actor_train"] and engine(cfg)["gpu_memory_utilization"] == 0.5
    assert offload_between_phases(cfg) and sleep_level(cfg) == 1 and start_rollout_first(cfg)


OFFLOAD_ROUND_TRIP = r"""
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  ROLL_GSPO_OFFLOAD_ON_CPU="1")
from omegaconf import OmegaConf
from roll_gspo.config import load_config
from roll_gspo.strategies.deepspeed_strategy import DeepSpeedStrategy

def weights(engine):
    # under ZeRO-3 a parameter is a placeholder; this rank's shard is its ds_tensor
    return {n: getattr(p, "ds_tensor", p) for n, p in engine.module.named_parameters()}

def snapshot(strategy):
    # every byte the optimizer step reads or writes: weights, fp32 partitions, Adam's states
    engine = strategy.engine
    out = {f"w.{n}": t.detach().clone() for n, t in weights(engine).items()}
    zero = engine.optimizer
    for i, flat in enumerate(getattr(zero, "fp32_partitioned_groups_flat", None)
                             or getattr(zero, "single_partition_of_fp32_groups", [])):
        out[f"hp.{i}"] = flat.detach().clone()
    inner = getattr(zero, "optimizer", zero)
    for i, state in enumerate(inner.state.values()):
        for k, v in state.items():
            if torch.is_tensor(v):
                out[f"opt.{i}.{k}"] = v.detach().clone()
    return out

def train(strategy, steps, offload):
    torch.manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(3, 30, (2, 12))
        if offload:
            strategy.offloader.reload()
        loss = strategy.engine(input_ids=ids, labels=ids).loss
        strategy.backward_and_step(loss)
        if offload:
            before = snapshot(strategy)
            strategy.offloader.offload(params=True)
            strategy.offloader.reload()
            after = snapshot(strategy)
            assert before.keys() == after.keys() and len(before) > 0
            for k in before:
                assert torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype, k
            strategy.offloader.offload(params=False)
    return {n: t.detach().clone() for n, t in weights(strategy.engine).items()}

def old_log_probs(strategy, role):
    # the trainer's old-log-prob pass, on a rank without its Ray set-up
    from roll_gspo.workers.actor_train import ActorTrainWorker
    from tests.test_dynamic_batching import sequences
    worker = ActorTrainWorker.__new__(ActorTrainWorker)
    worker.role, worker.strategy, worker.engine, worker.temperature, worker.moe = role, strategy, strategy.engine, 1.0, None
    return worker.compute_log_probs(sequences(6, seed=1, vocab=30))["old_log_probs"]

def deepspeed_offloaded(strategy):
    return sorted(s.value for s in getattr(strategy.engine.optimizer, "offloaded_states", ()))

path = os.path.join(sys.argv[4], "c.yaml")
for stage in map(int, sys.argv[3].split(",")):  # stage 3 last: its HfDeepSpeedConfig stays alive
    OmegaConf.save(OmegaConf.create({"pretrain": sys.argv[1], "actor_train": {
        "data_args": {"file_name": ["builtin:arith/train"]}, "training_args": {"learning_rate": 1e-2},
        "strategy_args": {"strategy_config": {"zero_optimization": {"stage": stage}}}}}), path)
    role = load_config(path).actor_train
    plain = DeepSpeedStrategy(role, train=True, seed=0)
    moved = DeepSpeedStrategy(role, train=True, seed=0, offload=True)
    assert moved.offloader.active
    a, b = train(plain, 2, False), train(moved, 2, True)
    assert all(torch.equal(a[k], b[k]) for k in a), f"training with offload differs (stage {stage})"
    moved.offloader.offload(params=True)
    assert sorted(moved.offloader.offloaded) == sorted(["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer", "lp_params"])
    held_by_deepspeed = deepspeed_offloaded(moved)
    # offload_train_params: the old-log-prob pass brings back the weights alone, the rest waits for training
    assert torch.equal(old_log_probs(plain, role), old_log_probs(moved, role))
    assert sorted(moved.offloader.offloaded) == sorted(["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer"])
    assert deepspeed_offloaded(moved) == [s for s in held_by_deepspeed if s != "lp_params"]
    a, b = train(plain, 1, False), train(moved, 1, True)
    assert all(torch.equal(a[k], b[k]) for k in a), f"training after a weights-only reload differs (stage {stage})"
    print("OK", stage)
if stage == 3:  # ZeRO-Offload: the optimizer side lives on the host already and must stay there
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(path), OmegaConf.create({"actor_train": {"strategy_args": {
        "strategy_config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}}})), path)
    host = DeepSpeedStrategy(load_config(path).actor_train, train=True, seed=0, offload=True)
    c = train(host, 2, True)
    host.offloader.offload(params=True)
    assert sorted(host.offloader.offloaded) == ["contiguous_grad_buffer", "lp_grads", "lp_params"]
    print("OK zero-offload")
"""


@pytest.mark.e2e
def test_deepspeed_offload_round_trip_is_exact_on_cpu(tmp_path, tiny_model):
    """DeepSpeed's state offload runs on its CPU accelerator (ROLL_GSPO_OFFLOAD_ON_CPU=1 makes it
    copy CPU to CPU), under ZeRO 0, 2 and 3 (and ZeRO-3 with ZeRO-Offload): every state is
    byte-identical after a round trip, and two optimizer steps with a round trip after each
    equal two without. With the weights offloaded too, the old-log-prob pass brings back the
    weights alone (the optimizer side waits for the training pass) and scores, then trains, as
    without offloading."""
    from roll_gspo.distributed.cluster import free_port

    script = tmp_path / "round_trip.py"
    script.write_text(OFFLOAD_ROUND_TRIP)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, str(script), tiny_model, str(free_port()), "0,2,3", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = [line for line in done.stdout.splitlines() if line.startswith("OK")]
    assert results == ["OK 0", "OK 2", "OK 3", "OK zero-offload"], done.stdout[-2000:]


@pytest.mark.e2e
def test_colocated_run_on_cpu_sleeps_offloads_and_syncs_exactly(tmp_path, tiny_model, ray_session, monkeypatch):
    """The GPU path's calls on CPU (ROLL_GSPO_OFFLOAD_ON_CPU=1; they free nothing here): vLLM sleeps
    at level 2 after generating and wakes for the sync, the trainer's states and weights go to
    CPU and back; after the sync vLLM scores fixed sequences as the trainer does."""
    import ray
    import torch

    from pipelines.rlvr_pipeline import make_prompt_group_source
    from pipelines.trainer_loop import TrainerLoop
    from roll_gspo.distributed.batch import Batch
    from tests.test_pipeline_e2e import write_config

    monkeypatch.setenv("ROLL_GSPO_OFFLOAD_ON_CPU", "1")  # the driver's view; workers get system_envs
    cfg = write_config(tmp_path, tiny_model, is_offload_states=True, offload_train_params=True,
                       system_envs={"ROLL_GSPO_OFFLOAD_ON_CPU": "1"},
                       actor_infer={"strategy_args": {"strategy_config": {"sleep_level": 2}}})
    pipeline = TrainerLoop(cfg, make_prompt_group_source)
    try:
        infer, train = pipeline.actor_infer.workers[0], pipeline.actor_train.workers[0]

        def engine_state():
            return ray.get(infer.__ray_call__.remote(
                lambda w: (w.strategy.sleeper.active, w.strategy.sleeper.state, w.strategy.llm.llm_engine.is_sleeping())))

        def trainer_offloaded():
            return sorted(ray.get(train.__ray_call__.remote(lambda w: w.strategy.offloader.offloaded)))

        everything = sorted(["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer", "lp_params"])
        assert engine_state() == (True, "awake", False) and trainer_offloaded() == everything
        for step in (1, 2):
            metrics = pipeline.step(step)
            assert engine_state() == (True, "awake", False)  # slept after generating, woken by the sync
            assert trainer_offloaded() == everything
            for key in ("memory/actor_infer_generate_gb", "memory/actor_infer_sleep_gb", "memory/actor_train_train_gb",
                        "memory/actor_train_offload_gb", "time/offload_s"):
                assert metrics[key] > 0, key
        assert metrics["rollout/logprob_gap"] < 1e-3  # step 2 sampled from the weights synced after a wake
        pipeline.actor_infer.execute_all("offload_states")
        assert engine_state() == (True, "asleep", True)
        pipeline.sync_weights()  # wake the weights, load, wake the KV cache
        fixed = Batch(meta={"prompt_ids": [[20, 21, 15, 22], [23, 24, 15]], "response_ids": [[20, 21, 1], [22, 1]]})
        pipeline._add_sequence_tensors(fixed)
        vllm = [torch.tensor(r) for r in ray.get(infer.score.remote(fixed))]
        trainer = pipeline.actor_train.dispatch("compute_log_probs", pipeline._view(fixed))["old_log_probs"]
        assert trainer_offloaded() == sorted(set(everything) - {"lp_params"})  # the optimizer side waits for training
        for i, v in enumerate(vllm):
            assert torch.allclose(v, trainer[i, :len(v)], atol=1e-3), (v, trainer[i])
    finally:
        pipeline.shutdown()
