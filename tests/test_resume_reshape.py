"""Resuming on another training shape (roll_gspo.lifecycle.reshape): a checkpoint
written by 2 ranks resumes on 1 (DeepSpeed ZeRO-2 through its universal checkpoint, FSDP2 through
torch.distributed.checkpoint's resharding), and a ZeRO-2 checkpoint resumes under FSDP2. Each carries
the fp32 weights, Adam's moments and step, the LR schedule (compared tensor by tensor with what the
2 ranks held), and the next step's loss and weights stay within float rounding of the uninterrupted
2-rank run's: the same mini-batch (one per step), summed in another order. What cannot carry over
is refused before any worker starts (`--dry-run` says which), and the pipeline itself resumes a
2-rank run on 1 rank (that run also serving the rollout endpoint: started, served and stopped with it).

Engine ranks are plain processes (tests.test_fsdp2.run_ranks: gloo, no Ray); the pipeline test runs on
the session's Ray."""
import glob
import json
import logging
import os
import re
import shutil

import pytest
import torch

from roll_gspo.lifecycle.reshape import (LOAD_NATIVE, LOAD_UNIVERSAL, SHAPES_KEY, ResumeShapeError, TrainerShape,
                                         decide, describe_resume, resume_actions, saved_shape, to_universal)
from tests.test_fsdp2 import bare_worker, pipeline_config, run_ranks, training_batch

ZERO2 = ("deepspeed_train", {"zero_optimization": {"stage": 2}})
FSDP2 = ("fsdp2_train", {})
ROWS = 8  # one mini-batch per step on 2 ranks (2 x 2 x 2 rows) and on 1 rank (2 x 4)


def _strategy(model, engine, world):
    strategy_name, strategy_config = engine
    cfg = pipeline_config(model, strategy_name, strategy_config)
    cfg.actor_train.training_args.gradient_accumulation_steps = 4 // world  # 8 rows per optimizer step
    cfg.actor_train.training_args.warmup_steps = 4  # the LR still changes at the resumed step
    if strategy_name == "fsdp2_train":
        from roll_gspo.strategies.fsdp2_strategy import FSDP2Strategy as Strategy
    else:
        from roll_gspo.strategies.deepspeed_strategy import DeepSpeedStrategy as Strategy
    return cfg, Strategy(cfg.actor_train, train=True, total_optimizer_steps=8, seed=0)


def full_state(strategy):
    """Every parameter's whole fp32 weight and Adam moments, by name (collective; rank 0 keeps them)."""
    out = {}
    if hasattr(strategy, "zero_stage"):  # DeepSpeed: its own accessors of the partitioned states
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for name, param in strategy.module.named_parameters():
            out[f"{name}/fp32"] = safe_get_full_fp32_param(param).detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}/{key}"] = safe_get_full_optimizer_state(param, key).detach().clone()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model, optimizer = get_state_dict(strategy.model, strategy.optimizer,
                                          options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        names = {name for name, _ in strategy.model.named_parameters()}
        out.update({f"{name}/fp32": t.clone() for name, t in model.items() if name in names})
        for name, state in optimizer.get("state", {}).items():  # rank 0's only (cpu_offload)
            out.update({f"{name}/{key}": state[key].clone() for key in ("exp_avg", "exp_avg_sq")})
    return out if strategy.rank == 0 else {}


def _batches(world, rank):
    return [training_batch(ROWS, seed=40 + i).chunk(world)[rank] for i in range(3)]


def _write_two_ranks(rank, world, out_dir, model):
    """Per engine: 2 steps, a checkpoint, then the uninterrupted step 3."""
    found = {}
    for label, engine in (("fsdp2", FSDP2), ("zero2", ZERO2)):
        cfg, strategy = _strategy(model, engine, world)
        worker = bare_worker(cfg, strategy, rank)
        batches = _batches(world, rank)
        for batch in batches[:2]:
            worker.train_step(batch)
        folder = os.path.join(out_dir, label)
        os.makedirs(folder, exist_ok=True)
        strategy.save_checkpoint(folder)
        saved = full_state(strategy)
        metrics = worker.train_step(batches[2])
        found[label] = {"saved": saved, "step3": metrics, "after": full_state(strategy), "lr": strategy.learning_rate()}
    return found


def _resume_one_rank(rank, world, out_dir, model):
    found = {}
    for label, source, engine, mode in (("zero2->zero2", "zero2", ZERO2, LOAD_UNIVERSAL),
                                        ("zero2->fsdp2", "zero2", FSDP2, LOAD_UNIVERSAL),
                                        ("fsdp2->fsdp2", "fsdp2", FSDP2, LOAD_NATIVE)):
        cfg, strategy = _strategy(model, engine, world)
        strategy.load_checkpoint(os.path.join(out_dir, source), mode)
        loaded = full_state(strategy)
        state = {"steps": strategy.global_steps, "lr": strategy.learning_rate()}
        worker = bare_worker(cfg, strategy, rank)
        metrics = worker.train_step(_batches(world, rank)[2])
        found[label] = {"loaded": loaded, "step3": metrics, "after": full_state(strategy), **state}
        if label == "zero2->zero2":  # and back to 2 ranks, under ZeRO-1: a checkpoint, then the step it resumes
            folder = os.path.join(out_dir, "zero2_one_rank")
            os.makedirs(folder, exist_ok=True)
            strategy.save_checkpoint(folder)
            found["step4"] = worker.train_step(_batches(world, rank)[2])
            found["after4"] = full_state(strategy)
    return found


ZERO1 = ("deepspeed_train", {"zero_optimization": {"stage": 1}})


def _resume_two_ranks_zero1(rank, world, out_dir, model):
    cfg, strategy = _strategy(model, ZERO1, world)
    strategy.load_checkpoint(os.path.join(out_dir, "zero2_one_rank"), LOAD_UNIVERSAL)
    loaded, steps = full_state(strategy), strategy.global_steps
    metrics = bare_worker(cfg, strategy, rank).train_step(_batches(world, rank)[2])
    return {"loaded": loaded, "steps": steps, "step4": metrics, "after4": full_state(strategy)}


@pytest.fixture(scope="module")
def reshaped(tmp_path_factory, tiny_model):
    out = tmp_path_factory.mktemp("reshape")
    written = run_ranks(2, _write_two_ranks, out, tiny_model)[0]
    to_universal(str(out / "zero2"))  # the driver's part (prepare_resume)
    resumed = run_ranks(1, _resume_one_rank, out, tiny_model)[0]
    to_universal(str(out / "zero2_one_rank"))
    resumed["zero2->zero1"] = run_ranks(2, _resume_two_ranks_zero1, out, tiny_model)[0]
    written["folder"] = str(out)
    return written, resumed


def _max_gap(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("case", ["zero2->zero2", "zero2->fsdp2", "fsdp2->fsdp2"])
def test_two_ranks_resume_on_one_with_weights_moments_and_schedule(reshaped, case):
    written, resumed = reshaped
    source = case.split("->")[0]
    before, after = written[source], resumed[case]
    # The checkpoint's fp32 weights and Adam's moments, whole, bit for bit; the step and the LR schedule.
    assert before["saved"].keys() == after["loaded"].keys() and any(k.endswith("exp_avg_sq") for k in before["saved"])
    different = [k for k in before["saved"] if not torch.equal(before["saved"][k], after["loaded"][k])]
    assert not different, different
    assert after["steps"] == 2
    # The next step: the same 8 rows in one mini-batch, its gradient summed over 2 ranks or 4
    # micro-batches of one rank: equal up to float rounding, not bit for bit.
    loss_gap = abs(before["step3"]["actor/pg_loss"] - after["step3"]["actor/pg_loss"])
    assert loss_gap < 1e-5, loss_gap
    assert after["step3"]["actor/lr"] == before["step3"]["actor/lr"]  # warm-up continued: step 3 of 4
    assert _max_gap(before["after"], after["after"]) < 1e-5
    print(f"{case}: step-3 loss gap {loss_gap:.2e}, weights/moments after step 3 max gap "
          f"{_max_gap(before['after'], after['after']):.2e}")


def test_one_rank_resumes_on_two_under_zero1(reshaped):
    """ZeRO-2 on 1 rank (the resumed run's step-3 checkpoint) -> ZeRO-1 on 2 ranks: another stage and
    more ranks."""
    _, resumed = reshaped
    one, two = resumed["zero2->zero2"], resumed["zero2->zero1"]
    different = [k for k in one["after"] if not torch.equal(one["after"][k], two["loaded"][k])]
    assert not different and two["steps"] == 3, different
    loss_gap = abs(resumed["step4"]["actor/pg_loss"] - two["step4"]["actor/pg_loss"])
    weights_gap = _max_gap(resumed["after4"], two["after4"])
    assert loss_gap < 1e-5 and weights_gap < 1e-5, (loss_gap, weights_gap)
    print(f"zero2 x1 -> zero1 x2: step-4 loss gap {loss_gap:.2e}, weights/moments max gap {weights_gap:.2e}")


def test_shape_of_a_checkpoint_without_the_record_is_read_from_its_files(reshaped):
    folder = reshaped[0]["folder"]
    assert saved_shape(os.path.join(folder, "zero2"), "actor_train", {}) == TrainerShape("deepspeed", 2, 2, "fp32")
    assert saved_shape(os.path.join(folder, "fsdp2"), "actor_train", {}) == TrainerShape("fsdp2", 2, None, None)


# --------------------------------------------------------------------------------------------
# The decision before any worker starts
# --------------------------------------------------------------------------------------------
def test_decisions_name_what_differs_and_what_to_do():
    zero2x2 = TrainerShape("deepspeed", 2, 2, "fp32")
    assert decide("actor_train", zero2x2, zero2x2).kind == "exact"
    for wanted in (TrainerShape("deepspeed", 1, 2, "fp32"), TrainerShape("deepspeed", 2, 1, "fp32"),
                   TrainerShape("fsdp2", 1, None, "fp32")):
        action = decide("actor_train", zero2x2, wanted)
        assert (action.kind, action.load_mode) == ("converted", LOAD_UNIVERSAL), wanted
    fsdp = TrainerShape("fsdp2", 2, None, "fp32")
    assert decide("actor_train", fsdp, TrainerShape("fsdp2", 1, None, "fp32")).kind == "resharded"
    refused = decide("actor_train", fsdp, zero2x2)
    assert refused.kind == "refused" and "actor_train.strategy_args.strategy_name=fsdp2_train" in refused.how
    assert "world_size=2" in refused.how
    assert decide("actor_train", zero2x2, TrainerShape("deepspeed", 2, 3, "fp32")).kind == "refused"
    zero3 = TrainerShape("deepspeed", 2, 3, "fp32")
    assert decide("actor_train", zero3, TrainerShape("deepspeed", 4, 3, "fp32")).kind == "converted"
    assert decide("actor_train", zero3, TrainerShape("fsdp2", 2, None, "fp32")).kind == "refused"
    stage0 = TrainerShape("deepspeed", 2, 0, "fp32")
    assert decide("actor_train", stage0, TrainerShape("deepspeed", 1, 0, "fp32")).kind == "resharded"
    assert decide("actor_train", stage0, zero2x2).kind == "refused"
    lora = TrainerShape("deepspeed", 2, 3, "fp32", lora=True)
    assert decide("actor_train", lora, TrainerShape("deepspeed", 2, 3, "fp32")).kind == "refused"
    assert "stage=3" in decide("actor_train", lora, TrainerShape("fsdp2", 2, None, "fp32", lora=True)).how


@pytest.mark.parametrize("wanted_ranks", [2, 1])
def test_a_refused_precision_change_suggests_the_checkpoints_dtype(wanted_ranks):
    """`dtype: auto` is bf16 on one machine and fp32 on another, so a ZeRO-0 fp32
    checkpoint is refused on a bf16 machine; the suggested keys must name the dtype (following keys
    without it is refused again) and say why `auto` moved."""
    saved = TrainerShape("deepspeed", 2, 0, "fp32")
    refused = decide("actor_train", saved, TrainerShape("deepspeed", wanted_ranks, 0, "bf16"))
    assert refused.kind == "refused"
    assert "actor_train.model_args.dtype=fp32" in refused.how
    assert "auto resolves per machine" in refused.how and "bf16 matrix instructions" in refused.how
    assert "ZeRO-0 checkpoint in fp32 does not load in bf16" in refused.how
    keys = dict(re.findall(r"(actor_train\.[\w.]+)=([\w.]*\w)", refused.how))
    assert decide("actor_train", saved, TrainerShape("deepspeed", int(keys["actor_train.world_size"]), 0,
                                                     keys["actor_train.model_args.dtype"])).kind != "refused"


def test_a_refusal_without_a_precision_change_leaves_the_dtype_out():
    refused = decide("actor_train", TrainerShape("fsdp2", 2, None, "fp32"), TrainerShape("deepspeed", 2, 2, "fp32"))
    assert refused.kind == "refused" and "model_args.dtype" not in refused.how


def _fake_checkpoint(root, shapes):
    folder = root / "out" / "checkpoints" / "step_2"
    folder.mkdir(parents=True)
    (folder / "pipeline_state.json").write_text(json.dumps({"step": 2, SHAPES_KEY: shapes}))
    (folder / "COMPLETE").write_text("ok\n")
    return folder


def test_dry_run_prints_the_resume_and_refuses_before_workers(tmp_path, tiny_model, capsys):
    from roll_gspo.cli import main
    from tests.test_pipeline_e2e import write_config

    folder = _fake_checkpoint(tmp_path, {"actor_train": {"engine": "fsdp2", "world_size": 2, "zero_stage": None,
                                                         "dtype": "fp32", "lora": False}})
    write_config(tmp_path, tiny_model)
    assert main(["--config", str(tmp_path / "config.yaml"), "--dry-run"]) == 1  # a fresh start over checkpoints
    assert "already holds checkpoints (step_2 newest)" in capsys.readouterr().err
    write_config(tmp_path, tiny_model, resume_from_checkpoint="auto")
    assert main(["--config", str(tmp_path / "config.yaml"), "--dry-run"]) == 1
    captured = capsys.readouterr()
    assert "resume: from" in captured.out and "refused" in captured.out
    assert "actor_train: refused, FSDP2, 2 ranks, fp32 -> DeepSpeed ZeRO-2, 2 ranks, fp32" in captured.err
    assert "fsdp2_train" in captured.err
    # The run itself: the same line, before Ray or any worker starts (no raw trace from a worker).
    assert main(["--config", str(tmp_path / "config.yaml")]) == 1
    err = capsys.readouterr().err
    assert "error: resume_from_checkpoint: " in err and "Traceback" not in err
    assert not glob.glob(os.path.join(tmp_path, "out", "logs", "actor_train-*"))  # no training rank started
    assert main(["--config", str(tmp_path / "config.yaml"), "--dry-run", "actor_train.strategy_args.strategy_name="
                 "fsdp2_train", "actor_train.strategy_args.strategy_config=null", "actor_train.world_size=1"]) == 0
    assert "actor_train: resharded, FSDP2, 2 ranks, fp32 -> FSDP2, 1 rank, fp32" in capsys.readouterr().out
    cfg = write_config(tmp_path, tiny_model, resume_from_checkpoint=str(folder))
    with pytest.raises(ResumeShapeError, match="resume_from_checkpoint: .* cannot resume as configured"):
        resume_actions(cfg, str(folder))
    lines, problems = describe_resume(cfg, cfg.output_dir)
    assert problems and lines == [f"resume: from {folder}: refused"]


# --------------------------------------------------------------------------------------------
# The pipeline: a run checkpointed with 2 training ranks resumes with 1 and trains on
# --------------------------------------------------------------------------------------------
# One mini-batch per step on either shape (16 responses: 2 ranks x 4 rows x 2 accumulations, or
# 1 rank x 4 x 4), so the resumed step trains on the rows the uninterrupted one does.
TWO_RANKS = dict(max_steps=2, save_steps=1, save_total_limit=2, importance_sampling="seq",
                 actor_train={"world_size": 2, "training_args": {"gradient_accumulation_steps": 2}})
ONE_RANK = ["actor_train.world_size=1", "actor_train.training_args.gradient_accumulation_steps=4"]


@pytest.mark.e2e
def test_pipeline_two_ranks_resume_on_one_and_train_on(tmp_path, tiny_model, ray_session, capsys, caplog):
    """The resumed run also serves the rollout endpoint (`rollout_endpoint`; one run
    for both): it prints the address once its workers are up, a client is served before and after
    the step, and the endpoint stops with the run."""
    import openai

    from pipelines.rlvr_pipeline import make_prompt_group_source
    from pipelines.trainer_loop import TrainerLoop
    from roll_gspo.cli import main
    from roll_gspo.config import load_config
    from tests.test_pipeline_e2e import load_weights, read_metrics, run, write_config

    (tmp_path / "two").mkdir()
    first = write_config(tmp_path / "two", tiny_model, **TWO_RANKS)
    uninterrupted = run(first)
    # The run as a user resumes it after losing a node: its output up to the step-1 checkpoint, one rank.
    (tmp_path / "one").mkdir()
    resumed_cfg = write_config(tmp_path / "one", tiny_model, **TWO_RANKS)
    checkpoints = os.path.join(resumed_cfg.output_dir, "checkpoints")
    shutil.copytree(os.path.join(first.output_dir, "checkpoints", "step_1"), os.path.join(checkpoints, "step_1"))
    config_path = str(tmp_path / "one" / "config.yaml")
    assert main(["--config", config_path, "--dry-run", "resume_from_checkpoint=auto", *ONE_RANK]) == 0
    printed = capsys.readouterr().out
    assert ("actor_train: converted, DeepSpeed ZeRO-2, 2 ranks, fp32 -> DeepSpeed ZeRO-2, 1 rank, fp32: "
            "DeepSpeed's universal checkpoint") in printed, printed
    with caplog.at_level(logging.INFO, logger="roll_gspo"):
        loop = TrainerLoop(load_config(config_path, ["resume_from_checkpoint=auto", *ONE_RANK,
                                                     "rollout_endpoint.enabled=true"]), make_prompt_group_source)
    try:
        address = loop.endpoint.address
        assert f"rollout endpoint: {address}" in caplog.text and address.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=address, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["policy"]
        r = client.completions.create(model="policy", prompt="1+2=", max_tokens=4, user="outside")
        assert r.choices[0].token_ids and r.episode_id == "outside"
        assert loop.run()["time/step_s"] > 0
        r = client.completions.create(model="policy", prompt="1+2=", max_tokens=4)  # still served after the step
        assert r.choices[0].token_ids
    finally:
        loop.shutdown()
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=address, api_key="unused", max_retries=0, timeout=5).models.list()
    resumed = read_metrics(resumed_cfg)
    assert [r["step"] for r in resumed if "actor/pg_loss" in r] == [2]
    assert os.path.isdir(os.path.join(checkpoints, "step_1", "universal", "engine", "zero"))
    assert saved_shape(os.path.join(checkpoints, "step_2"), "actor_train") == TrainerShape("deepspeed", 1, 2, "fp32")
    want, got = uninterrupted[-1], resumed[-1]
    assert want["step"] == got["step"] == 2
    # Step 2's rollout comes from step 1's weights, carried bit for bit: the same samples and rewards.
    assert got["reward/mean"] == want["reward/mean"]
    gaps = {key: abs(got[key] - want[key]) for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl")}
    assert all(gap < 1e-5 for gap in gaps.values()), gaps
    final_gap = max(float((load_weights(os.path.join(resumed_cfg.output_dir, "final_model"))[k] - w).abs().max())
                    for k, w in load_weights(os.path.join(first.output_dir, "final_model")).items())
    assert final_gap < 1e-5, final_gap
    print(f"2 -> 1 ranks, step 2: {gaps}, final weights max gap {final_gap:.2e}")
    assert read_metrics(resumed_cfg)[-1]["step"] == 2
