"""LoRA: ROLL's keys in model_args (defaults, actor_infer derived from actor_train, bad input
refused at --dry-run with the model's linear modules named); adapter-only training on DeepSpeed ZeRO-3
and FSDP2 with the reference as the adapter-disabled model, an exact resume from a small checkpoint and
a final model that is the merge of base and adapter; both syncs into vLLM (merged weights, the adapter
as a LoRA request) scoring as the trainer does; the placement plan's memory of a LoRA trainer; and one
LoRA run end to end with a KL term, colocation's sleep and offload, checkpoints and the final model.

Ranks of the strategy test are plain processes (torch.multiprocessing, gloo), no Ray."""
import dataclasses
import json
import math
import os

import pytest
import torch

from tests.test_fsdp2 import bare_worker as _bare_worker, full_weights, pipeline_config, run_ranks, training_batch

LORA = {"lora_target": "all-linear"}


def bare_worker(cfg, strategy, rank):
    """tests.test_fsdp2's trainer worker without Ray, without the rollout correction."""
    worker = _bare_worker(cfg, strategy, rank)
    worker.correction = getattr(worker, "correction", None)
    return worker


def lora_config(tmp_path, model, **changes):
    """tests.test_pipeline_e2e's small config with LoRA on actor_train (`changes` merged over it)."""
    from tests.test_pipeline_e2e import write_config

    train = changes.pop("actor_train", {})
    train = {**train, "model_args": {**LORA, **train.get("model_args", {})}}
    return write_config(tmp_path, model, actor_train=train, **changes)


# --------------------------------------------------------------------------------------------
# 1. Keys: ROLL's defaults, actor_infer derived, what the pipeline starts
# --------------------------------------------------------------------------------------------
def test_roll_defaults_and_actor_infer_derived(tmp_path, tiny_model):
    cfg = lora_config(tmp_path, tiny_model, use_kl_loss=True)
    train, infer = cfg.actor_train.model_args, cfg.actor_infer.model_args
    assert (train.lora_rank, train.lora_alpha, train.lora_dropout) == (8, 16, 0.0)  # ROLL: 8 and 2 x rank
    assert (infer.lora_target, infer.lora_rank, infer.lora_alpha) == ("all-linear", 8, 16)
    # A KL term without a reference model: actor_train scores it with the adapter disabled.
    assert cfg.needs_reference_log_probs() and not cfg.needs_reference()
    from roll_gspo.placement.cluster_plan import gpu_roles

    assert "reference" not in gpu_roles(cfg)
    # ROLL's recipes repeat the keys on actor_infer, the targets in other words: accepted.
    cfg = lora_config(tmp_path, tiny_model, actor_train={"model_args": {"lora_rank": 64}},
                      actor_infer={"model_args": {"lora_target": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                                  "lora_rank": 64}})
    from roll_gspo.config import preflight

    preflight(cfg)
    assert (cfg.actor_train.model_args.lora_alpha, cfg.actor_infer.model_args.lora_alpha) == (128, 128)
    full = lora_config(tmp_path, tiny_model, use_kl_loss=True, actor_train={"model_args": {"lora_target": None}})
    assert full.needs_reference() and not full.actor_infer.model_args.uses_lora()
    from roll_gspo.config import load_config

    example = load_config(os.path.join(os.path.dirname(__file__), "..", "examples", "example_gspo_lora.yaml"))
    assert (example.actor_infer.model_args.lora_target, example.actor_infer.model_args.lora_rank) == ("all-linear", 8)


def _adapter_folder(folder, tensors, config=None):
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    json.dump(config or {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]},
              open(os.path.join(folder, "adapter_config.json"), "w"))
    return str(folder)


BAD_INPUT = {
    "no_such_module": (["actor_train.model_args.lora_target='q_proj,qkv'"],
                       "actor_train.model_args.lora_target names 'qkv', which no module of the model is called; the "
                       "model's linear modules: q_proj (x2), k_proj (x2), v_proj (x2), o_proj (x2), gate_proj (x2), "
                       "up_proj (x2), down_proj (x2), lm_head"),
    "not_linear": (["actor_train.model_args.lora_target=mlp"], "only linear layers take adapters here"),
    "tied_head": (["actor_train.model_args.lora_target=lm_head"], "whose weight is the input embedding's"),
    "bad_regex": (["actor_train.model_args.lora_target='(q_proj'"], "not a valid regex"),
    "rank_zero": (["actor_train.model_args.lora_rank=0"], "actor_train.model_args.lora_rank: must be >= 1"),
    "hf_infer_adapter": (["lora_sync=adapter", "actor_infer.strategy_args.strategy_name=hf_infer"],
                         "lora_sync: adapter loads the adapter into vLLM's LoRA support, but actor_infer runs "
                         "'hf_infer'"),
    "adapter_sync_sleep2": (["lora_sync=adapter", "is_offload_states=true",
                             "+actor_infer.strategy_args.strategy_config.sleep_level=2"],
                            "level 2 drops the base weights, which an adapter sync never sends again"),
    "infer_contradicts": (["actor_infer.model_args.lora_rank=4"],
                          "actor_infer.model_args.lora_rank = 4 contradicts actor_train.model_args.lora_rank = 8"),
    "infer_other_targets": (["actor_infer.model_args.lora_target=q_proj"], "selects other modules than"),
    "reference_adapter": (["reference.model_args.lora_target=q_proj"], "the reference is the base model"),
    "adapter_missing": (["actor_train.model_args.adapter_name_or_path={tmp}/nowhere"], "no such folder"),
    "adapter_other_size": (["actor_train.model_args.adapter_name_or_path={small}"],
                           "'model.layers.0.self_attn.q_proj' has in_features 128: the adapter was trained on a "
                           "model of another size"),
    "adapter_other_model": (["actor_train.model_args.adapter_name_or_path={deep}"],
                            "which the model does not have: the adapter was trained on another model"),
    "adapter_contradicts": (["actor_train.model_args.adapter_name_or_path={fits}", "actor_train.model_args.lora_rank=4"],
                            "the adapter has lora_rank 8 (adapter_config.json), but actor_train.model_args.lora_rank = 4"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_lora_input_fails_dry_run_naming_the_key(case, tmp_path, tiny_model, capsys):
    from roll_gspo.cli import main

    name = "base_model.model.model.layers.{}.self_attn.q_proj.lora_A.weight"
    folders = {"tmp": str(tmp_path),
               "small": _adapter_folder(tmp_path / "small", {name.format(0): torch.zeros(8, 64)}),
               "deep": _adapter_folder(tmp_path / "deep", {name.format(7): torch.zeros(8, 128)}),
               "fits": _adapter_folder(tmp_path / "fits", {name.format(0): torch.zeros(8, 128)})}
    lora_config(tmp_path, tiny_model)  # writes tmp_path/config.yaml
    overrides, message = BAD_INPUT[case]
    code = main(["--config", str(tmp_path / "config.yaml"), "--dry-run", *[o.format(**folders) for o in overrides]])
    err = capsys.readouterr().err
    assert code == 1 and message in err, err


def test_target_forms_on_a_model(tiny_model):
    from roll_gspo.config.checks.lora import weightless_model
    from roll_gspo.config.plan.lora_targets import peft_target_modules, resolve_lora_targets

    model = weightless_model(tiny_model)
    every = resolve_lora_targets(model, "all-linear", "k")
    assert len(every) == 14 and not any("lm_head" in n for n in every)  # 7 per layer, the LM head left out
    assert resolve_lora_targets(model, r".*layers\.1\.self_attn\.(q|v)_proj", "k") == [
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert peft_target_modules(model, "all-linear", "k") == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert peft_target_modules(model, r".*layers\.1\.self_attn\.q_proj", "k") == ["model.layers.1.self_attn.q_proj"]
    with pytest.raises(ValueError, match="not built"):
        resolve_lora_targets(model, "all-embedding", "k")


def test_plan_memory_knows_lora(tiny_model):
    """The estimate's adapter size is PEFT's own count, and a LoRA trainer's gradients and Adam's
    states are the adapter's alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from roll_gspo.placement.memory import lora_parameters, shape_of_model_folder, training_memory

    shape = shape_of_model_folder(tiny_model)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(
        r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    assert lora_parameters(shape, "all-linear", 16) == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert lora_parameters(shape, "q_proj,v_proj", 16) == lora_parameters(shape, r".*\.(q|v)_proj", 16) > 0
    full = training_memory(shape, dtype="bf16", zero_stage=0, world_size=1, micro_batch=1, seq_len=64)
    adapter = lora_parameters(shape, "all-linear", 8)
    lora = training_memory(shape, dtype="bf16", zero_stage=0, world_size=1, micro_batch=1, seq_len=64, trainable=adapter)
    assert lora["gradients"] == 2 * adapter and lora["optimizer"] == 12 * adapter < full["optimizer"] / 10
    assert lora["weights"] == full["weights"] + 2 * adapter and lora["activations"] == full["activations"]


# --------------------------------------------------------------------------------------------
# 2. Training engines: adapter only, reference = adapter disabled, exact resume, small checkpoint
# --------------------------------------------------------------------------------------------
ENGINES = {"zero3": ("deepspeed_train", {"zero_optimization": {"stage": 3}}),
           "fsdp2": ("fsdp2_train", {})}


def _adapter_state(strategy):
    """The adapter's whole tensors (rank 0) and this rank's optimizer states."""
    adapter = {n: t for bucket in strategy.iter_weight_buckets(1 << 30, adapter=True) for n, t in bucket}
    optimizer = strategy.optimizer.state_dict()
    if "state" in optimizer:  # torch AdamW (FSDP2): its DTensor shards
        states = [v.to_local() if hasattr(v, "to_local") else v
                  for s in optimizer["state"].values() for v in s.values() if torch.is_tensor(v)]
    else:  # DeepSpeed ZeRO-3: this rank's fp32 partitions and Adam's moments of them
        states = list(strategy.optimizer.fp32_partitioned_groups_flat)
        states += [v for s in strategy.optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return adapter, [s.detach().clone() for s in states]


def _train_and_resume(rank, world, out_dir, model, engine):
    strategy_name, strategy_config = ENGINES[engine]
    if strategy_name == "fsdp2_train":
        from roll_gspo.strategies.fsdp2_strategy import FSDP2Strategy as Strategy
    else:
        from roll_gspo.strategies.deepspeed_strategy import DeepSpeedStrategy as Strategy
    cfg = pipeline_config(model, strategy_name, strategy_config, lora_target="all-linear", lora_rank=4, lora_alpha=8)
    batches = [training_batch(8, seed=20 + i).chunk(world)[rank] for i in range(3)]
    folder = os.path.join(out_dir, f"{engine}_checkpoint")
    os.makedirs(folder, exist_ok=True)
    first = Strategy(cfg.actor_train, train=True, total_optimizer_steps=6, seed=0)
    worker = bare_worker(cfg, first, rank)
    before = full_weights(first)
    reference = worker.compute_log_probs(batches[0], adapter_disabled=True)["ref_log_probs"]
    for batch in batches[:2]:
        worker.train_step(batch)
    first.save_checkpoint(folder)
    first.save_hf_model(os.path.join(out_dir, f"{engine}_hf"), model)
    found = {"reference_after": worker.compute_log_probs(batches[0], adapter_disabled=True)["ref_log_probs"],
             "reference_before": reference, "policy": worker.compute_log_probs(batches[0])["old_log_probs"],
             "batch": batches[0], "merged": full_weights(first), "base": before}
    worker.train_step(batches[2])
    uninterrupted = _adapter_state(first)
    resumed = Strategy(cfg.actor_train, train=True, total_optimizer_steps=6, seed=0)
    resumed.load_checkpoint(folder)
    bare_worker(cfg, resumed, rank).train_step(batches[2])
    again = _adapter_state(resumed)
    found["adapter_same"] = all(torch.equal(uninterrupted[0][k], again[0][k]) for k in uninterrupted[0])
    found["optimizer_same"] = (len(uninterrupted[1]) == len(again[1]) > 0
                               and all(torch.equal(a, b) for a, b in zip(uninterrupted[1], again[1])))
    found["adapter_names"] = sorted(uninterrupted[0])
    return found


def _both_engines(rank, world, out_dir, model):
    # FSDP2 first: ZeRO-3's HfDeepSpeedConfig, alive while its engine is, makes transformers partition loads.
    return {engine: _train_and_resume(rank, world, out_dir, model, engine) for engine in ("fsdp2", "zero3")}


def test_adapter_trains_alone_and_resumes_exactly(tmp_path, tiny_model):
    """ZeRO-3 and FSDP2, 2 ranks each: only the adapter moves, the reference (adapter disabled) is the
    base model, a resume from the small checkpoint is bit-exact, and final_model (merged) and
    final_model/adapter (PEFT) score as the trainer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from roll_gspo.models.causal_lm import response_token_log_probs

    ranks = run_ranks(2, _both_engines, tmp_path, tiny_model)
    for engine in ENGINES:
        for found in (r[engine] for r in ranks):
            assert found["adapter_same"] and found["optimizer_same"], engine  # resumed = uninterrupted, bit for bit
            # The reference is the base model: adapter-disabled log-probs stay put while the adapter trains.
            assert torch.equal(found["reference_before"], found["reference_after"]), engine
            assert (found["policy"] - found["reference_after"]).abs().max() > 1e-3, engine
        zero = ranks[0][engine]
        merged, base = zero["merged"], zero["base"]
        assert set(merged) == set(base) and all(n.startswith("base_model.model.") for n in zero["adapter_names"])
        adapted = [n for n in base if not torch.equal(merged[n], base[n])]
        assert sorted(adapted) == sorted(n for n in base if n.endswith("_proj.weight")), engine  # adapted ones only
        # The checkpoint holds the adapter and its optimizer state, not the model.
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(tmp_path / f"{engine}_checkpoint")
                   for f in files)
        assert size < sum(t.numel() * t.element_size() for t in base.values()), engine
        # final_model: the merged model scores as the trainer; its adapter loads with PEFT and scores alike.
        hf = str(tmp_path / f"{engine}_hf")
        batch, mask = zero["batch"], zero["batch"]["response_mask"]
        with torch.no_grad():
            for scored in (AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32),
                           PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                                     os.path.join(hf, "adapter"))):
                log_probs, _ = response_token_log_probs(scored, batch["input_ids"], batch["attention_mask"],
                                                        batch["prompt_lengths"], mask.shape[1])
                assert float(((log_probs - zero["policy"]).abs() * mask).max()) < 1e-4, engine


# --------------------------------------------------------------------------------------------
# 3. vLLM takes the adapter as a LoRA request and scores as PEFT does
# --------------------------------------------------------------------------------------------
def _peft_with_random_adapter(model, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                          LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)  # a trained adapter's B is not zero
    return peft.eval()


def _peft_scores(peft, prompts, responses):
    scores = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            log_probs = torch.log_softmax(peft(torch.tensor([p + r])).logits[0].float(), -1)
            scores.append([float(log_probs[len(p) - 1 + i, t]) for i, t in enumerate(r)])
    return scores


def _max_gap(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_vllm_with_lora_requests_scores_as_peft(tiny_model):
    """lora_sync: adapter: each sync's adapter, loaded as a new LoRA request, is what vLLM then scores
    with (the merged sync is checked end to end below)."""
    from roll_gspo.schema.config import RoleConfig, StrategyArgs
    from roll_gspo.strategies.lora import adapter_config, adapter_weight_entries
    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    role = RoleConfig(strategy_args=StrategyArgs(strategy_name="vllm", strategy_config={"max_model_len": 32}))
    role.model_args.model_name_or_path = tiny_model
    prompts, responses = [[20, 21, 15, 22], [23, 24, 15], [30, 31]], [[20, 21, 1], [22, 1], [40, 41, 42, 43]]

    def tensors(entries):
        return [(e.name, e.params[0].detach().clone()) for e in entries]

    engine = VllmStrategy(role, max_model_len=32, seed=0, lora_rank=8)
    base = engine.score(prompts, responses)
    for seed in (1, 2):  # each sync a new LoRA request; the engine follows the latest
        peft = _peft_with_random_adapter(tiny_model, seed)
        engine.load_adapter(tensors(adapter_weight_entries(peft)), adapter_config(peft, tiny_model))
        expected = _peft_scores(peft, prompts, responses)
        assert _max_gap(engine.score(prompts, responses), expected) <= 1e-4
        assert _max_gap(base, expected) > 1e-2


# --------------------------------------------------------------------------------------------
# 4. End to end: a LoRA run with a KL term (no reference model), vLLM sleeping at level 2 and the
#    trainer's states offloaded between phases, checkpoints, final model and adapter
# --------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_lora_run_syncs_exactly_with_colocation_and_kl(tmp_path, tiny_model, ray_session, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipelines.rlvr_pipeline import make_prompt_group_source
    from pipelines.trainer_loop import TrainerLoop
    from roll_gspo.eval.checkpoint_model import checkpoint_model
    from roll_gspo.lifecycle.checkpoint import complete_checkpoints
    from tests.test_pipeline_e2e import load_weights, read_metrics

    monkeypatch.setenv("ROLL_GSPO_OFFLOAD_ON_CPU", "1")  # the GPU path's sleep and offload calls, on CPU
    cfg = lora_config(tmp_path, tiny_model, max_steps=2, save_steps=1, use_kl_loss=True, kl_loss_coef=0.01,
                      is_offload_states=True, offload_train_params=True,
                      system_envs={"ROLL_GSPO_OFFLOAD_ON_CPU": "1"},
                      actor_train={"training_args": {"learning_rate": 2e-2}},
                      actor_infer={"strategy_args": {"strategy_config": {"sleep_level": 2}}})
    pipeline = TrainerLoop(cfg, make_prompt_group_source)
    try:
        assert pipeline.reference is None  # the KL's reference is actor_train without its adapter
        pipeline.run()
    finally:
        pipeline.shutdown()
    records = [r for r in read_metrics(cfg) if "actor/pg_loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # Every step samples from the weights synced after the last (vLLM slept at level 2, which drops
        # them): the rollout's log-probs are the trainer's with the adapter applied.
        assert record["rollout/logprob_gap"] <= 1e-4, record["rollout/logprob_gap"]
        assert record["actor/kl_loss"] > 0 and math.isfinite(record["actor/kl_loss"]) and record["sync/megabytes"] > 0
    final = os.path.join(cfg.output_dir, "final_model")
    base, trained = load_weights(tiny_model), load_weights(final)
    assert max(float((base[k] - trained[k]).abs().max()) for k in base) > 1e-3  # the policy moved
    model_bytes = sum(t.numel() * t.element_size() for t in base.values())
    for folder in complete_checkpoints(cfg.output_dir):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
        assert size < model_bytes  # adapter + its optimizer state, no base weights
    # The last checkpoint holds the adapter only; the evaluation command merges it onto the base model
    # (the run's model_args say where it sits): the same weights as final_model/, which the trainer merged.
    last = complete_checkpoints(cfg.output_dir)[-1]
    args = cfg.actor_train.model_args
    converted = load_weights(checkpoint_model(last, tiny_model, str(tmp_path / "cache"), model_args=args))
    common = set(converted) & set(trained)
    assert common >= set(trained) - {"lm_head.weight"}  # tied to the embedding: either file may name it
    assert max(float((converted[k] - trained[k]).abs().max()) for k in common) < 1e-5
    with pytest.raises(ValueError, match="is a LoRA checkpoint .the adapter only.: give --config"):
        checkpoint_model(last, tiny_model, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="lora_rank 4,.*other shapes"):
        checkpoint_model(last, tiny_model, str(tmp_path / "cache"), model_args=dataclasses.replace(args, lora_rank=4))
    ids = torch.tensor([[20, 21, 15, 22, 30, 31]])
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)(ids).logits
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                        os.path.join(final, "adapter"))(ids).logits
    assert torch.allclose(merged, adapter, atol=1e-4)


@pytest.mark.e2e
def test_roll_deepspeed_lora_recipe_trains_two_steps_on_cpu(tmp_path, tiny_model, ray_session, monkeypatch):
    """ROLL's last DeepSpeed ZeRO-3 LoRA recipe (before v0.3; `${lora_target}` anchors at the top level,
    repeated on actor_infer) trains 2 steps on CPU, sizes and placement from tests.test_roll_recipes, on
    the tests' micro model (built in this session: the recipe's built-in model would need its warm
    start); the adapter it saves is ROLL's rank and targets."""
    from tests.test_roll_recipes import ROLL_DIR, recipe_cpu_overrides, run_recipe

    recipe = ROLL_DIR / "recipes" / "rlvr_lora_zero3.yaml"
    gpu_only = [f"{role}.model_args.attn_implementation=sdpa" for role in ("actor_train", "actor_infer", "reference")]
    models = [f"pretrain={tiny_model}", f"reward_pretrain={tiny_model}",
              f"rewards.llm_judge.model_args.model_name_or_path={tiny_model}"]
    assert run_recipe(["--config", recipe.relative_to(ROLL_DIR), *recipe_cpu_overrides(recipe, tmp_path), *gpu_only,
                       *models], monkeypatch) == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if m.get("step", 0) > 0] == [1, 2]
    adapter = json.loads((tmp_path / "final_model" / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (32, 32)
    assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
