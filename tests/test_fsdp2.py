"""`fsdp2_train` / `fsdp2_infer` (torch FSDP2 over gloo): the same loss,
gradients and updates as DeepSpeed ZeRO-2 on the same batch, through the trainer's own
`train_step` (2 ranks, 2 micro-batches each, padding passes, uneven scoring shards); bf16 on fp32
master weights in both engines; an exact resume from a checkpoint; HSDP; ROLL's FSDP2 keys checked like the rest of the config; and a
2-step pipeline run with vLLM whose weight sync leaves trainer and rollout log-probs together.

Ranks are plain processes (torch.multiprocessing, gloo), no Ray, except in the e2e run."""
import json
import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from roll_gspo.config import ConfigError
from roll_gspo.schema.config import PipelineConfig
from roll_gspo.distributed.batch import Batch
from tests.test_dynamic_batching import sequences

# --------------------------------------------------------------------------------------------
# Ranks without Ray: each runs `target(rank, world, out_dir, *args)` and writes what it found
# --------------------------------------------------------------------------------------------
def _rank_entry(rank, world, port, target, out_dir, args, env, cwd):
    os.environ.clear()  # the caller's environment and folder now, not the fork server's at its start
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(target(rank, world, out_dir, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


# The ranks fork from one server process that imported the training stack once per test session,
# instead of each spawned rank importing torch, transformers and DeepSpeed afresh (~5 s a rank on
# 2 cores; 10 ranks in this file and test_lora). Each rank still is a fresh process of its own.
# tests.conftest first: it has DeepSpeed imported without mlflow (roll_gspo.utils.imports), as in the ranks.
RANK_PRELOAD = ["tests.conftest", "torch", "transformers", "deepspeed", "peft", "roll_gspo.workers.actor_train",
                "roll_gspo.strategies.deepspeed_strategy", "roll_gspo.strategies.fsdp2_strategy", "tests.test_fsdp2"]


def run_ranks(world, target, out_dir, *args):
    """Start `world` ranks running `target`; returns each rank's result."""
    from roll_gspo.distributed.cluster import free_port

    mp.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)  # read when the server starts (first call)
    mp.start_processes(_rank_entry, args=(world, free_port(), target, str(out_dir), args, dict(os.environ),
                                          os.getcwd()), nprocs=world, join=True, start_method="forkserver")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def pipeline_config(model, strategy_name, strategy_config, **role_keys):
    """A config whose actor_train runs `strategy_name`: 2 rows per micro-batch, 2 per step."""
    cfg = PipelineConfig()
    cfg.importance_sampling, cfg.pg_clip_low, cfg.pg_clip_high, cfg.ppo_epochs = "token", 0.2, 0.28, 1
    cfg.loss_agg_mode, cfg.loss_norm_length = "token-mean", 12
    role = cfg.actor_train
    role.model_args.model_name_or_path = model
    role.strategy_args.strategy_name, role.strategy_args.strategy_config = strategy_name, strategy_config
    role.training_args.learning_rate, role.training_args.max_grad_norm = 1e-3, 1.0
    role.training_args.per_device_train_batch_size, role.training_args.gradient_accumulation_steps = 2, 2
    role.infer_batch_size = 2
    for key, value in role_keys.items():
        setattr(role, key, value) if hasattr(role, key) else setattr(role.model_args, key, value)
    return cfg


def bare_worker(cfg, strategy, rank):
    """The trainer's worker around `strategy`, without its Ray set-up."""
    from roll_gspo.workers.actor_train import ActorTrainWorker

    worker = ActorTrainWorker.__new__(ActorTrainWorker)
    worker.cfg, worker.role, worker.rank, worker.temperature = cfg, cfg.actor_train, rank, 1.0
    worker.moe, worker.offload, worker.weight_sender = None, False, None
    worker.strategy, worker.engine = strategy, strategy.engine
    return worker


def full_weights(strategy):
    """{name: whole weight} on rank 0 (collective)."""
    return {name: tensor for bucket in strategy.iter_weight_buckets(1 << 30) for name, tensor in bucket}


def record_step_gradients(strategy):
    """Every whole gradient (by name) at each optimizer step, taken just before it."""
    steps = []
    named = list(strategy.module.named_parameters())
    if hasattr(strategy, "zero_stage"):  # DeepSpeed: engine.step() steps at the accumulation boundary
        from deepspeed.utils import safe_get_full_grad

        engine, original = strategy.engine, strategy.engine.step

        def step(*args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                steps.append({n: safe_get_full_grad(p).clone() for n, p in named})
            return original(*args, **kwargs)
        engine.step = step
    else:
        original = strategy.step

        def step():
            steps.append({n: p.grad.full_tensor().clone() for n, p in named})
            original()
        strategy.step = step
    return steps


def training_batch(rows, seed):
    batch = sequences(rows, seed=seed, vocab=30)
    batch.tensors.pop("ref_log_probs")
    return batch


# --------------------------------------------------------------------------------------------
# 1. FSDP2 = ZeRO-1 = ZeRO-2: old log-probs, losses, gradients, updates
# --------------------------------------------------------------------------------------------
VARIANTS = {
    "zero2": ("deepspeed_train", {"zero_optimization": {"stage": 2}}, {}),
    # ZeRO-1 reduces once per optimizer step (ZeRO-2 after every pass): the same training, token-budget
    # micro-batches and their padding passes included.
    "zero1": ("deepspeed_train", {"zero_optimization": {"stage": 1, "contiguous_gradients": False}},
              {"use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": 40}),
    # ZeRO-0 (the CPU examples' stage): plain data parallelism, one all-reduce at the step and a
    # whole optimizer on each rank; token-budget micro-batches with padding passes too.
    "zero0": ("deepspeed_train", {"zero_optimization": {"stage": 0}},
              {"use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": 40}),
    "fsdp2": ("fsdp2_train", {"fsdp_size": 16, "param_dtype": "fp32", "reduce_dtype": "float32",
                              "reshard_after_forward": True, "offload_policy": False,
                              "use_batched_model_update": False}, {}),
    # Full gradients accumulated on each rank, parameters kept gathered, recomputed activations,
    # token-budget micro-batches (uneven counts over the ranks: padding passes).
    "fsdp2_no_sync": ("fsdp2_train", {"reduce_scatter_during_grad_accumulation": False,
                                      "reshard_after_forward": False},
                      {"gradient_checkpointing": True, "use_dynamic_batching_in_train": True,
                       "max_tokens_per_microbatch_in_train": 40}),
}


def _train_variant(rank, world, model, variant, moe=False):
    """Old log-probs of an uneven shard, then one train_step (2 mini-batches) under `variant`."""
    from roll_gspo.workers.actor_train import train_strategy_class

    strategy_name, strategy_config, role_keys = variant
    cfg = pipeline_config(model, strategy_name, strategy_config, **role_keys)
    cfg.router_replay, cfg.moe_aux_loss_coef = moe, 0.01 if moe else 0.0
    strategy = train_strategy_class(strategy_name)(cfg.actor_train, train=True, total_optimizer_steps=4, seed=0)
    worker = bare_worker(cfg, strategy, rank)
    if moe:
        worker.moe = worker._attach_moe_routing()
    grads = record_step_gradients(strategy)
    batch = training_batch(16, seed=4).chunk(world)[rank]  # 8 rows a rank: 2 mini-batches of 4
    uneven = sequences(5, seed=3, vocab=30).chunk(world)[rank]  # 2 and 3 rows: 1 and 2 scoring passes
    scored = worker.compute_log_probs(uneven)["old_log_probs"]
    if moe:  # the experts the old policy chose, replayed in training
        batch["routed_experts"] = worker.compute_log_probs(batch)["routed_experts"]
    metrics = worker.train_step(batch)
    return {"scored": scored, "metrics": metrics, "grads": grads, "weights": full_weights(strategy),
            "steps": worker.optimizer_steps()}


def _compare_rank(rank, world, out_dir, model, moe_model):
    found = {name: _train_variant(rank, world, model, variant) for name, variant in VARIANTS.items()}
    for name in ("zero2", "fsdp2"):  # a Mixture-of-Experts policy: routing hooks on FSDP2's module
        found[f"moe_{name}"] = _train_variant(rank, world, moe_model, VARIANTS[name], moe=True)
    return found


def assert_same_training(ranks, name, want_name):
    want = ranks[0][want_name]
    for rank in ranks:  # scoring shards of 2 and 3 rows: FSDP2's forward passes pair up
        mask = rank[name]["scored"] != 0
        torch.testing.assert_close(rank[name]["scored"][mask], rank[want_name]["scored"][mask], rtol=1e-5, atol=1e-5)
    got = ranks[0][name]
    assert got["steps"] == want["steps"] == 2 and len(got["grads"]) == len(want["grads"]) == 2
    keys = [k for k in want["metrics"] if k.startswith(("actor/", "moe/")) and k != "actor/padding_frac"]
    assert "actor/grad_norm" in keys and "actor/pg_loss" in keys
    for key in keys:
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-4, abs=1e-6), (name, key)
    for step, (got_grads, want_grads) in enumerate(zip(got["grads"], want["grads"])):
        assert got_grads.keys() == want_grads.keys()
        for key in want_grads:
            torch.testing.assert_close(got_grads[key], want_grads[key], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} step {step} {key}: {m}")
    for key, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")


def test_fsdp2_matches_zero2_loss_gradients_and_updates(tmp_path, tiny_model, tiny_moe_model):
    ranks = run_ranks(2, _compare_rank, tmp_path, tiny_model, tiny_moe_model)
    for name in ("zero1", "zero0", "fsdp2", "fsdp2_no_sync"):
        assert_same_training(ranks, name, "zero2")
    padding = {name: ranks[0][name]["metrics"]["actor/padding_frac"] for name in ("fsdp2", "fsdp2_no_sync")}
    assert padding["fsdp2_no_sync"] < padding["fsdp2"]  # the token budget really split otherwise
    assert_same_training(ranks, "moe_fsdp2", "moe_zero2")
    assert "moe/aux_loss" in ranks[0]["moe_fsdp2"]["metrics"]


# --------------------------------------------------------------------------------------------
# 1b. bf16 trains on fp32 master weights, in DeepSpeed at ZeRO-0, ZeRO-1 and ZeRO-2 and in FSDP2
# --------------------------------------------------------------------------------------------
BF16_ENGINES = {"zero0": ("deepspeed_train", {"zero_optimization": {"stage": 0}}),
                "zero1": ("deepspeed_train", {"zero_optimization": {"stage": 1}}),
                "zero2": ("deepspeed_train", {"zero_optimization": {"stage": 2}}),
                "fsdp2": ("fsdp2_train", {})}


def _master_weights(strategy):
    """The optimizer's copy of the weights: DeepSpeed's fp32 groups (ZeRO-0: its bf16 optimizer's,
    ZeRO-1/2: the partitions'), FSDP2's sharded parameters."""
    optimizer = getattr(strategy.engine, "optimizer", None)
    for name in ("fp32_groups", "single_partition_of_fp32_groups"):
        groups = getattr(optimizer, name, None)
        if groups:
            return [t for group in groups for t in (group if isinstance(group, list) else [group])]
    return [p.detach().to_local() for p in strategy.module.parameters()]


def _bf16_rank(rank, world, out_dir, model):
    from roll_gspo.workers.actor_train import train_strategy_class

    found = {}
    for name, (strategy_name, strategy_config) in BF16_ENGINES.items():
        cfg = pipeline_config(model, strategy_name, strategy_config, dtype="bf16")
        strategy = train_strategy_class(strategy_name)(cfg.actor_train, train=True, total_optimizer_steps=4, seed=0)
        compute = {p.dtype for p in strategy.module.parameters()} if strategy_name == "deepspeed_train" else \
            {strategy.compute_dtype}
        metrics = bare_worker(cfg, strategy, rank).train_step(training_batch(8, seed=4))
        masters = _master_weights(strategy)
        found[name] = {"compute": compute, "master": {t.dtype for t in masters},
                       "grad_norm": metrics.get("actor/grad_norm"),
                       # values bf16 cannot hold: DeepSpeed's copy starts from the bf16 weights, so only
                       # the updates, kept in fp32, make it finer
                       "finer_than_bf16": any(bool((t != t.bfloat16().float()).any()) for t in masters)}
    return found


def test_bf16_computes_in_bf16_and_updates_fp32_master_weights(tmp_path, tiny_model):
    found = run_ranks(1, _bf16_rank, tmp_path, tiny_model)[0]
    for name, engine in found.items():
        assert engine["compute"] == {torch.bfloat16}, name
        assert engine["master"] == {torch.float32}, name
        assert engine["finer_than_bf16"], name  # a bf16-only optimizer would hold bf16 values
        assert engine["grad_norm"] is not None and math.isfinite(engine["grad_norm"]) and engine["grad_norm"] > 0, name


# --------------------------------------------------------------------------------------------
# 2. Checkpoint: a resumed run continues bit for bit; the HF folder holds the weights
# --------------------------------------------------------------------------------------------
def _local_state(strategy):
    """This rank's shards of the weights and of Adam's states, by name."""
    state = {f"param/{n}": p.detach().to_local().clone() for n, p in strategy.module.named_parameters()}
    names = {id(p): n for n, p in strategy.module.named_parameters()}
    for param, values in strategy.optimizer.state.items():
        for key, value in values.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            state[f"adam/{names[id(param)]}/{key}"] = local.clone()
    return state


def _resume_rank(rank, world, out_dir, model):
    from roll_gspo.strategies.fsdp2_strategy import FSDP2Strategy
    from transformers import AutoModelForCausalLM

    os.environ["ROLL_GSPO_OFFLOAD_ON_CPU"] = "1"  # the colocation moves run (CPU to CPU) in the first run
    cfg = pipeline_config(model, "fsdp2_train", {})
    batches = [training_batch(16, seed=10 + i).chunk(world)[rank] for i in range(3)]
    folder = os.path.join(out_dir, "checkpoint")
    os.makedirs(folder, exist_ok=True)
    first = FSDP2Strategy(cfg.actor_train, train=True, total_optimizer_steps=6, seed=0, offload=True)
    assert first.offloader.active
    worker = bare_worker(cfg, first, rank)
    worker.offload = cfg.offload_train_params = True  # optimizer side and weights to CPU after each step
    for batch in batches[:2]:
        worker.train_step(batch)
    assert "lp_params" in first.offloader.offloaded
    first.save_checkpoint(folder)
    first.save_hf_model(os.path.join(out_dir, "hf"), model)
    saved = full_weights(first)
    worker.train_step(batches[2])
    uninterrupted = _local_state(first)

    resumed = FSDP2Strategy(cfg.actor_train, train=True, total_optimizer_steps=6, seed=0)
    resumed.load_checkpoint(folder)
    assert resumed.global_steps == 4 and resumed.learning_rate() == first.learning_rate()
    bare_worker(cfg, resumed, rank).train_step(batches[2])
    found = {"same": {k: torch.equal(v, _local_state(resumed)[k]) for k, v in uninterrupted.items()},
             "steps": (first.global_steps, resumed.global_steps)}
    if rank == 0:
        hf = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "hf"), dtype=torch.float32).state_dict()
        found["hf_equal"] = all(torch.equal(hf[k], saved[k]) for k in saved)
    return found


def test_checkpoint_resume_is_exact_and_offload_changes_nothing(tmp_path, tiny_model):
    ranks = run_ranks(2, _resume_rank, tmp_path, tiny_model)
    for rank in ranks:
        assert rank["steps"] == (6, 6)
        differing = [k for k, same in rank["same"].items() if not same]
        assert not differing and any(k.endswith("exp_avg_sq") for k in rank["same"]), differing
    assert ranks[0]["hf_equal"]
    assert os.listdir(tmp_path / "checkpoint" / "fsdp2")


# --------------------------------------------------------------------------------------------
# 3. HSDP (fsdp_size 2 of 4 ranks) = FSDP over 4; the frozen fsdp2_infer engine scores alike
# --------------------------------------------------------------------------------------------
def _hsdp_rank(rank, world, out_dir, model):
    from roll_gspo.strategies.fsdp2_strategy import FSDP2Strategy

    batch = training_batch(16, seed=5).chunk(world)[rank]
    found = {}
    for name, size in (("fsdp", 1), ("hsdp", 2)):
        cfg = pipeline_config(model, "fsdp2_train", {"fsdp_size": size})
        strategy = FSDP2Strategy(cfg.actor_train, train=True, seed=0)
        grads = record_step_gradients(strategy)
        bare_worker(cfg, strategy, rank).train_step(batch)
        found[name] = {"grads": grads, "mesh": tuple(strategy.model.model.embed_tokens.weight.device_mesh.shape)}
    frozen = FSDP2Strategy(pipeline_config(model, "fsdp2_infer", {}).actor_train, train=False, seed=0)
    found["frozen_scores"] = bare_worker(pipeline_config(model, "fsdp2_infer", {}), frozen, rank).compute_log_probs(
        sequences(5, seed=3, vocab=30).chunk(world)[rank])["old_log_probs"]
    return found


def test_hsdp_equals_fsdp_and_the_frozen_engine_scores(tmp_path, tiny_model):
    from roll_gspo.models.causal_lm import load_causal_lm, response_token_log_probs

    ranks = run_ranks(4, _hsdp_rank, tmp_path, tiny_model)
    assert ranks[0]["fsdp"]["mesh"] == (4,) and ranks[0]["hsdp"]["mesh"] == (2, 2)
    for want, got in zip(ranks[0]["fsdp"]["grads"], ranks[0]["hsdp"]["grads"]):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)
    scored = Batch.concat([Batch({"lp": r["frozen_scores"]}) for r in ranks])["lp"]
    uneven = sequences(5, seed=3, vocab=30)
    with torch.no_grad():
        want, _ = response_token_log_probs(load_causal_lm(tiny_model).eval(), uneven["input_ids"],
                                           uneven["attention_mask"], uneven["prompt_lengths"],
                                           uneven["response_mask"].shape[1])
    mask = uneven["response_mask"].bool()
    torch.testing.assert_close(scored[mask], want[mask], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# 4. ROLL's FSDP2 keys: checked like every block, refused with their reason
# --------------------------------------------------------------------------------------------
def fsdp2_yaml(tmp_path, strategy_config, world_size=2, strategy_name="fsdp2_train"):
    from omegaconf import OmegaConf

    from roll_gspo.config import load_config

    data = {"pretrain": "builtin:tiny-arith", "output_dir": str(tmp_path / "out"), "use_kl_loss": True,
            "actor_train": {"data_args": {"file_name": ["builtin:arith/train"]}, "world_size": world_size,
                            "strategy_args": {"strategy_name": strategy_name, "strategy_config": strategy_config}},
            "reference": {"strategy_args": {"strategy_name": "fsdp2_infer",
                                            "strategy_config": {"reduce_dtype": "float32", "fsdp_size": 4}}}}
    path = tmp_path / "fsdp2.yaml"
    OmegaConf.save(OmegaConf.create(data), path)
    return load_config(str(path))


def test_roll_fsdp2_keys_load_and_act(tmp_path, caplog):
    from roll_gspo.config.plan.fsdp2 import parse_fsdp2_config

    recipe = {"fsdp_size": 16, "param_dtype": "fp32", "reduce_dtype": "float32", "reshard_after_forward": True,
              "offload_policy": False, "use_batched_model_update": False, "enable_mix_precision": True,
              "wrap_policy": {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}}
    with caplog.at_level("WARNING", logger="roll_gspo.config"):
        cfg = fsdp2_yaml(tmp_path, recipe)
    assert cfg.actor_train.strategy_args.strategy_config == recipe
    # The reference reduces no gradients: its reduce_dtype is accepted with a notice (ROLL ignores it too).
    assert any("reference.strategy_args.strategy_config.reduce_dtype = 'float32' is ignored by a frozen engine"
               in r.message for r in caplog.records)
    options = parse_fsdp2_config(recipe)
    assert options.fsdp_size == 16 and options.reshard_after_forward is True
    assert options.wrap_policy.transformer_layer_cls_to_wrap == ["Qwen2DecoderLayer"]


@pytest.mark.parametrize("strategy_config, message", [
    ({"fsdp_size": "16"}, "actor_train.strategy_args.strategy_config.fsdp_size: expected int, got str '16'"),
    ({"reshard_after_forward": "yes"}, "strategy_config.reshard_after_forward: expected bool or null"),
    ({"param_dtype": "int8"}, "strategy_config.param_dtype: invalid value 'int8'"),
    ({"offload_policy": 1}, "strategy_config.offload_policy: expected bool, got int 1"),
    ({"wrap_policy": {"wrap_embedding": True}},
     "unknown key 'actor_train.strategy_args.strategy_config.wrap_policy.wrap_embedding'; did you mean "
     "'actor_train.strategy_args.strategy_config.wrap_policy.wrap_embeddings'?"),
    ({"fsdp_sise": 2}, "unknown key 'actor_train.strategy_args.strategy_config.fsdp_sise'; did you mean"),
    ({"cpu_offload": True}, "unknown key 'actor_train.strategy_args.strategy_config.cpu_offload'"),
    ({"zero_optimization": {"stage": 3}}, "unknown key 'actor_train.strategy_args.strategy_config.zero_optimization'"),
    ({"async_save_ckpt": True}, "strategy_config.async_save_ckpt = True is refused: checkpoints are written "
                                "synchronously"),
    ({"apply_tiled_mlp": True, "tiled_num_shards": 8}, "tiled_num_shards = 8 is refused: it sizes TiledMLP"),
    ({"wrap_policy": {"moe_experts": ["Qwen3MoeMLP"]}}, "wrap_policy.moe_experts = ['Qwen3MoeMLP'] is refused"),
    ({"param_dtype": "bf16"}, "param_dtype = 'bf16' contradicts actor_train.model_args.dtype = 'fp32'"),
])
def test_bad_fsdp2_keys_are_named(tmp_path, strategy_config, message):
    with pytest.raises(ConfigError) as info:
        fsdp2_yaml(tmp_path, strategy_config)
    assert message in str(info.value)


def test_hsdp_size_must_divide_the_ranks_and_a_frozen_engine_cannot_train(tmp_path):
    with pytest.raises(ConfigError, match=r"fsdp_size = 3: HSDP needs actor_train.world_size \(4\) to be a multiple"):
        fsdp2_yaml(tmp_path, {"fsdp_size": 3}, world_size=4)
    assert fsdp2_yaml(tmp_path, {"fsdp_size": 2}, world_size=4).actor_train.world_size == 4
    with pytest.raises(ConfigError, match="fsdp2_infer is a frozen engine; use fsdp2_train"):
        fsdp2_yaml(tmp_path, {}, strategy_name="fsdp2_infer")


# --------------------------------------------------------------------------------------------
# 5. End to end: 2 steps with vLLM rollout, FSDP2 trainer and FSDP2 reference
# --------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_pipeline_with_fsdp2_trainer_and_reference(tmp_path, tiny_model, ray_session):
    from roll_gspo.lifecycle.checkpoint import complete_checkpoints
    from tests.test_pipeline_e2e import check_training_happened, run, write_config

    # strategy_config null replaces write_config's DeepSpeed block (null means {}).
    fsdp2 = {"strategy_name": "fsdp2_train", "strategy_config": None}
    cfg = write_config(tmp_path, tiny_model, save_steps=1, use_kl_loss=True, kl_loss_coef=0.01,
                       actor_train={"strategy_args": fsdp2},
                       reference={"strategy_args": {"strategy_name": "fsdp2_infer", "strategy_config": {}},
                                  "world_size": 2, "num_cpus_per_worker": 0.25})
    assert cfg.actor_train.strategy_args.strategy_config == {}
    records = run(cfg)
    check_training_happened(cfg, records, tiny_model)
    assert "actor/kl_loss" in records[-1]
    # After step 1's weight sync, vLLM samples step 2 with the trainer's weights (fp32 both sides).
    assert records[1]["rollout/logprob_gap"] < 1e-3
    assert [os.path.basename(p) for p in complete_checkpoints(cfg.output_dir)] == ["step_1", "step_2"]
    state = json.load(open(os.path.join(complete_checkpoints(cfg.output_dir)[-1], "pipeline_state.json")))
    assert state["step"] == 2
