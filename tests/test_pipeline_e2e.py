"""End-to-end RLVR runs on the real stack: Ray actors, vLLM (or hf_infer) rollout, DeepSpeed
ZeRO-2/3 training ranks, reward workers, weight sync. A tiny random model, a few steps each."""
import json
import math
import os

import pytest
import torch
from omegaconf import OmegaConf

from roll_gspo.config import load_config
from roll_gspo.distributed.batch import Batch

pytestmark = pytest.mark.e2e
REPO_ROOT_FOR_SUBPROCESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_config(tmp_path, model, **changes):
    """A small RLVR config: 4 prompts x G=4 = 16 responses, 2 training ranks, 2 mini-batches."""
    base = {
        "exp_name": "e2e", "output_dir": str(tmp_path / "out"), "pretrain": model, "seed": 1,
        "max_steps": 2, "eval_steps": 0, "save_steps": 0, "track_with": "tensorboard",
        "adv_estimator": "grpo", "importance_sampling": "seq", "rollout_batch_size": 4,
        "num_return_sequences_in_group": 4, "prompt_length": 16, "response_length": 6,
        "pg_clip_low": 3e-3, "pg_clip_high": 4e-3, "loss_agg_mode": "seq-mean-token-mean",
        "actor_train": {
            "training_args": {"learning_rate": 1e-3, "per_device_train_batch_size": 4,
                              "gradient_accumulation_steps": 1},
            "data_args": {"file_name": ["builtin:arith/train"]},
            "strategy_args": {"strategy_name": "deepspeed_train",
                              "strategy_config": {"zero_optimization": {"stage": 2}}},
            "world_size": 2, "num_cpus_per_worker": 0.5, "infer_batch_size": 8},
        "actor_infer": {"strategy_args": {"strategy_name": "vllm",
                                          "strategy_config": {"max_model_len": 32, "enforce_eager": True}},
                        "num_cpus_per_worker": 0.5},
        "reference": {"strategy_args": {"strategy_name": "hf_infer"}, "num_cpus_per_worker": 0.25},
        "rewards": {"math_rule": {"worker_cls": "roll_gspo.workers.rewards.FunctionRewardWorker",
                                  "reward_fn": "tests.reward_fns:digit_fraction", "num_cpus_per_worker": 0.25}},
        "validation": {"data_args": {"file_name": ["builtin:arith/val"], "max_samples": 16}},
    }
    cfg = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(changes))
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path)
    return load_config(str(path))


def read_metrics(cfg):
    with open(os.path.join(cfg.output_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def load_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def weights_changed(model_dir, trained_dir):
    before, after = load_weights(model_dir), load_weights(trained_dir)
    return max(float((before[k] - after[k]).abs().max()) for k in before)


def run(cfg):
    from pipelines.rlvr_pipeline import run_rlvr

    run_rlvr(cfg)
    return read_metrics(cfg)


def check_training_happened(cfg, records, model):
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, cfg.max_steps + 1))
    for record in steps:
        for key in ("reward/mean", "actor/clipfrac", "actor/ratio_mean", "actor/grad_norm", "actor/entropy",
                    "time/step_s", "time/generate_s", "time/train_s", "sync/seconds", "rollout/logprob_gap"):
            assert key in record and record[key] is not None and math.isfinite(record[key]), key
        # The sync rides on the train call but stays its own phase, timed by the sending rank.
        assert record["time/sync_s"] == record["sync/seconds"] > 0
    assert weights_changed(model, os.path.join(cfg.output_dir, "final_model")) > 0
    assert os.path.exists(os.path.join(cfg.output_dir, "metrics.png"))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(cfg.logging_dir))


# The algorithm block of ROLL's GSPO page (seed 004), every key live.
SEED_004_KEYS = dict(adv_estimator="reinforce", importance_sampling="seq", ppo_epochs=1, use_kl_loss=True,
                     kl_loss_coef=0.001, loss_agg_mode="seq-mean-token-sum", whiten_advantages=True,
                     advantage_clip=2.0, dual_clip_loss=True, reward_clip=10, reward_norm=None,
                     reward_shift=False, reward_scale=False, add_token_level_kl=False)


@pytest.fixture(scope="module")
def seed_004_run(tmp_path_factory, tiny_model, ray_session):
    """One run of the seed-004 config (2 steps, a checkpoint after each; ZeRO-2, one 256 MB bucket
    by shared memory, vLLM's direct update): its test checks the run, the weight-sync test's first
    case its scores, the resume test continues from a copy of its checkpoints."""
    tmp_path = tmp_path_factory.mktemp("seed_004")
    cfg = write_config(tmp_path, tiny_model, **SEED_004_RUN)
    observed = run_observing_sync(cfg)
    return cfg, read_metrics(cfg), observed


SEED_004_RUN = dict(eval_steps=2, save_steps=1, **SEED_004_KEYS)


def test_seed_004_keys_zero2_vllm_with_kl_and_validation(seed_004_run, tiny_model):
    cfg, records, _ = seed_004_run
    check_training_happened(cfg, records, tiny_model)
    assert "actor/kl_mean" in records[-1] or "actor/kl_loss" in records[-1]
    assert [r["step"] for r in records if "val/accuracy" in r] == [0, 2]
    # Trainer and vLLM agree on the rollout policy's log-probs (fp32 both sides).
    assert records[1]["rollout/logprob_gap"] < 1e-3
    # So the drift alarm stays silent: its gap below fp32's warn gap every step, no breach.
    assert all(r["drift/gap"] < 1e-3 and r["drift/breaches"] == 0 for r in records if "actor/pg_loss" in r)
    # So old_logprob_source: auto took vLLM's and the trainer's old-log-prob pass never ran.
    steps = [r for r in records if "actor/pg_loss" in r]
    assert all(r["rollout/old_logprobs_from_rollout"] == 1.0 and "time/old_log_probs_s" not in r for r in steps)
    checkpoints = sorted(os.listdir(os.path.join(cfg.output_dir, "checkpoints")))
    assert checkpoints == ["step_1", "step_2"]
    check_rollout_files(cfg, records)


def test_the_run_report_of_a_real_run_opens_in_a_browser(seed_004_run, tmp_path):
    """The run report on a real run (the seed-004 pipeline's own report.html, rewritten at each
    validation and at the end): Chromium opens it without a console error, draws its curves and
    timeline, and a response the run wrote is in the sample browser."""
    from tests.test_report_browser import browser_for, open_page, severe
    from roll_gspo.metrics.rollouts import read_step, step_files

    cfg, records, _ = seed_004_run
    report = os.path.join(cfg.output_dir, "report.html")
    assert os.path.getmtime(report) >= os.path.getmtime(os.path.join(cfg.output_dir, "metrics.jsonl"))
    shown_first = read_step(step_files(cfg.rollout_dump_dir)[0][1])  # the browser opens on the first step
    response = " ".join(max((s["response"] for s in shown_first), key=len).split())
    with browser_for(tmp_path) as browser:
        open_page(browser, report)
        assert severe(browser) == []
        assert browser.execute_script("return document.querySelectorAll('#charts svg path.series').length") > 3
        assert browser.execute_script("return document.querySelectorAll('.timeline-svg rect').length") >= 2
        shown = " ".join(browser.find_element("id", "sample-rows").text.split())
        assert response[:30] in shown, (response, shown[:500])


def check_rollout_files(cfg, records):
    """Every trained step's samples and every validation's prompts in the rollout files,
    readable: texts, reward and its parts, advantages, versions (docs/rollouts.md)."""
    from roll_gspo.metrics.rollouts import read_step, step_files

    train = step_files(cfg.rollout_dump_dir)
    assert [step for step, _ in train] == [r["step"] for r in records if "actor/pg_loss" in r]
    samples = read_step(train[-1][1])
    assert len(samples) == records[-1]["rollouts/train_samples"] == cfg.rollout_batch_size * cfg.num_return_sequences_in_group
    first = samples[0]
    assert first["prompt"] and isinstance(first["response"], str) and first["finish_reason"] in ("stop", "length")
    assert first["response_tokens"] >= 1 and first["task"] and first["ground_truth"] is not None
    assert isinstance(first["reward"], float) and isinstance(first["correct"], bool)
    assert first["reward_parts"] is None or isinstance(first["reward_parts"], dict)  # math_rule sends none
    assert [s["group"] for s in samples[:2 * cfg.num_return_sequences_in_group]] == \
        [0] * cfg.num_return_sequences_in_group + [1] * cfg.num_return_sequences_in_group
    assert all(s["advantage"] is not None and s["weight_version"] == train[-1][0] - 1 and s["staleness"] == 0
               for s in samples)
    assert all(s["ratio"] > 0 and 0 <= s["clipped"] <= 1 for s in samples)  # from the training ranks
    validation = step_files(cfg.validation_data_dir)
    assert [step for step, _ in validation] == [r["step"] for r in records if "val/accuracy" in r]
    answers = read_step(validation[-1][1])
    assert {"prompt", "response", "answer", "correct", "ground_truth"} <= set(answers[0])
    accuracy = sum(bool(a["correct"]) for a in answers) / len(answers)
    assert accuracy == pytest.approx(records[-1]["val/accuracy"])


# ZeRO-3 with token-level ratios; its weight sync by Ray's object store in many small buckets, with
# vLLM's layerwise reload: one run serves test_token_level_zero3 and that case of the weight-sync test.
# old_logprob_source: trainer keeps ZeRO-3's old-log-prob pass covered (auto takes vLLM's in fp32).
ZERO3_TOKEN = dict(importance_sampling="token", pg_clip_low=0.2, pg_clip_high=0.28, weight_sync_transport="object_store",
                   weight_sync_bucket_mb=0.02, vllm_weight_update="layerwise", old_logprob_source="trainer")


@pytest.fixture(scope="module")
def zero3_token_run(tmp_path_factory, tiny_model, ray_session):
    tmp_path = tmp_path_factory.mktemp("zero3_token")
    cfg = write_config(tmp_path, tiny_model, max_steps=2, **ZERO3_TOKEN,
                       actor_train={"strategy_args": {"strategy_config": {"zero_optimization": {"stage": 3}}}})
    observed = run_observing_sync(cfg)
    return cfg, read_metrics(cfg), observed


def test_token_level_zero3(zero3_token_run, tiny_model):
    cfg, records, _ = zero3_token_run
    check_training_happened(cfg, records, tiny_model)
    # The trainer's pass, as written (with token ratios in fp32 auto would take vLLM's: test_config_old_logprobs.py).
    steps = [r for r in records if "actor/pg_loss" in r]
    assert all(r["rollout/old_logprobs_from_rollout"] == 0.0 and r["time/old_log_probs_s"] > 0 for r in steps)


def test_hf_infer_rollout_and_failing_reward_is_counted(tmp_path, tiny_model, ray_session):
    cfg = write_config(tmp_path, tiny_model, actor_infer={"strategy_args": {"strategy_name": "hf_infer",
                                                                               "strategy_config": {}}},
                       rewards={"math_rule": {"reward_fn": "tests.reward_fns:flaky"}},
                       old_logprob_source="rollout")
    records = run(cfg)
    check_training_happened(cfg, records, tiny_model)
    assert sum(r["reward/errors"] for r in records if "reward/errors" in r) > 0


def run_observing_sync(cfg):
    """The pipeline's own run loop (run_rlvr's), scoring fixed sequences with vLLM and with the
    trainer before the first step and after each step's sync: the update mode vLLM chose, then
    [(vLLM's log-probs, the trainer's)] before step 1, after step 1, after step 2, ..."""
    import ray

    from pipelines.rlvr_pipeline import make_prompt_group_source
    from pipelines.trainer_loop import TrainerLoop

    pipeline = TrainerLoop(cfg, make_prompt_group_source)
    try:
        mode = ray.get(pipeline.actor_infer.workers[0].__ray_call__.remote(lambda w: w.strategy.update_mode))
        fixed = Batch(meta={"prompt_ids": [[20, 21, 15, 22], [23, 24, 15], [25, 15, 26, 27, 28]],
                            "response_ids": [[20, 21, 1], [22, 1], [23, 24, 25, 1]]})
        pipeline._add_sequence_tensors(fixed)

        def scores():
            vllm = [torch.tensor(r) for r in ray.get(pipeline.actor_infer.workers[0].score.remote(fixed))]
            log_probs = pipeline.actor_train.dispatch("compute_log_probs", pipeline._view(fixed))["old_log_probs"]
            return vllm, [log_probs[i, :len(r)] for i, r in enumerate(fixed["response_ids"])]

        observed = [scores()]
        plain_step = pipeline.step

        def step(number):  # generate, reward, train, sync; then score
            metrics = plain_step(number)
            observed.append(scores())
            return metrics

        pipeline.step = step
        pipeline.run()
        return mode, observed
    finally:
        pipeline.shutdown()


@pytest.mark.parametrize("zero_stage, transport, bucket_mb, update, run", [
    (2, "auto", 256.0, "auto", "seed_004_run"), (3, "object_store", 0.02, "layerwise", "zero3_token_run"),
    (2, "auto", 0.02, "auto", "resumed_run")])
def test_weight_sync_makes_vllm_match_trainer(request, zero_stage, transport, bucket_mb, update, run):
    """After each of two steps and syncs, vLLM's log-probs of fixed sequences equal the
    trainer's within float32 tolerance, and differ from before; by shared memory (same node) and
    by Ray's object store, in one bucket and in many (a layer's tensors then span buckets), with
    vLLM's layerwise reload and with the direct CPU update. Each case is another test's run, which
    sets these keys: the ZeRO-2 one-bucket case the seed-004 run's, the ZeRO-3 case the token-level
    run's, the ZeRO-2 many-bucket case the seed-004 run's resumed run (steps 3 and 4)."""
    cfg, _, (mode, observed) = request.getfixturevalue(run)
    assert (cfg.actor_train.strategy_args.strategy_config["zero_optimization"]["stage"], cfg.weight_sync_transport,
            cfg.weight_sync_bucket_mb, cfg.vllm_weight_update) == (zero_stage, transport, bucket_mb, update)
    assert mode == ("direct" if update == "auto" else "layerwise")
    assert len(observed) == 3  # before, after step 1, after step 2
    before, _ = observed[0]
    for v, t in zip(*observed[0]):
        assert torch.allclose(v, t, atol=1e-3), (v, t)
    for step, (after_vllm, after_trainer) in enumerate(observed[1:], start=1):
        for v, t in zip(after_vllm, after_trainer):
            assert torch.allclose(v, t, atol=1e-3), (step, v, t)
        assert max(float((a - b).abs().max()) for a, b in zip(after_vllm, before)) > 1e-3
        before = after_vllm


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, tiny_model, seed_004_run):
    """A copy of the seed-004 run's output (checkpoints step_1, step_2, its metrics): a fresh start
    into it is refused, then resuming runs steps 3 and 4 only; its weight sync in many 0.02 MB
    buckets (the weight-sync test's case), vLLM and the trainer scoring fixed sequences before step 3
    and after each step's sync (run_observing_sync)."""
    import shutil

    first, _, _ = seed_004_run
    tmp_path = tmp_path_factory.mktemp("resumed")
    shutil.copytree(first.output_dir, tmp_path / "out")
    again = write_config(tmp_path, tiny_model, **SEED_004_RUN)
    with pytest.raises(FileExistsError, match="resume_from_checkpoint"):
        run(again)
    resumed = write_config(tmp_path, tiny_model, **{**SEED_004_RUN, "max_steps": 4, "weight_sync_bucket_mb": 0.02,
                                                    "resume_from_checkpoint": "auto"})
    observed = run_observing_sync(resumed)
    return resumed, read_metrics(resumed), observed


def test_resume_continues_and_fresh_start_is_refused(resumed_run):
    """A copy of the seed-004 run's output: a fresh start into it is refused (resumed_run), resuming
    runs steps 3 and 4 only."""
    from roll_gspo.lifecycle.checkpoint import complete_checkpoints

    resumed, records, _ = resumed_run
    assert [r["step"] for r in records if "actor/pg_loss" in r] == [1, 2, 3, 4]  # steps 1-2 logged before, 3-4 now
    # step_1..step_4 written, the oldest deleted (save_total_limit: 2)
    assert [os.path.basename(p) for p in complete_checkpoints(resumed.output_dir)] == ["step_3", "step_4"]
    from roll_gspo.metrics.rollouts import step_files  # one rollout file a step, none twice or missing

    assert [step for step, _ in step_files(resumed.rollout_dump_dir)] == [1, 2, 3, 4]


def test_eval_reads_a_checkpoint_as_the_model_it_holds(resumed_run, tiny_model, tmp_path, monkeypatch):
    """The evaluation command's model from a training checkpoint (ZeRO-2 over 2 ranks): the last
    checkpoint's weights are the final model's, with the run's config and tokenizer; a run's
    output_dir without final_model/ (stopped early) gives its latest checkpoint."""
    from safetensors.torch import load_file

    from roll_gspo.eval import resolve_eval_model

    resumed, _, _ = resumed_run
    monkeypatch.setenv("ROLL_GSPO_CACHE", str(tmp_path / "cache"))
    folder = resolve_eval_model(os.path.join(resumed.output_dir, "checkpoints", "step_4"), tiny_model)
    exported = load_file(os.path.join(folder, "model.safetensors"))
    final = load_file(os.path.join(resumed.output_dir, "final_model", "model.safetensors"))
    assert set(final) <= set(exported)
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert {"config.json", "tokenizer_config.json"} <= set(os.listdir(folder))
    stopped = tmp_path / "stopped"  # an output_dir with checkpoints and no final_model/
    stopped.mkdir()
    (stopped / "checkpoints").symlink_to(os.path.join(resumed.output_dir, "checkpoints"))
    assert resolve_eval_model(str(stopped), tiny_model) == folder  # step_4, already converted
    with pytest.raises(ValueError, match="give --config"):
        resolve_eval_model(str(stopped))


def test_multidomain_rewards_logged_per_domain(tmp_path, tiny_model, ray_session):
    """Math, code sandbox and multiple choice in one run: each domain's reward, statuses and
    validation accuracy are logged separately."""
    rewards = {
        "math_rule": {"worker_cls": "roll_gspo.workers.rewards.MathRuleRewardWorker", "timeout_s": 5,
                      "num_cpus_per_worker": 0.1},
        "code_sandbox": {"worker_cls": "roll_gspo.workers.rewards.CodeSandboxRewardWorker", "reward_type": "soft",
                         "timeout_s": 2, "num_cpus_per_worker": 0.1},
        "multiple_choice": {"worker_cls": "roll_gspo.workers.rewards.MultipleChoiceRewardWorker",
                            "num_cpus_per_worker": 0.1},
    }
    cfg = write_config(tmp_path, tiny_model, max_steps=1, eval_steps=1, prompt_length=32,
                       actor_train={"data_args": {"file_name": ["builtin:mixed/train"]}},
                       actor_infer={"strategy_args": {"strategy_config": {"max_model_len": 48}}},
                       validation={"data_args": {"file_name": ["builtin:mixed/val"], "max_samples": 12}},
                       rewards=rewards)
    records = run(cfg)
    val = records[0]
    for domain in rewards:
        assert f"val/{domain}/reward_mean" in val and f"val/{domain}/accuracy" in val
        assert f"val/{domain}/errors" in val and f"val/{domain}/format" in val
    assert "val/accuracy" in val and "val/reward_mean" in val
    step = records[-1]
    seen = [d for d in rewards if f"reward/{d}/mean" in step]
    assert seen and all(f"reward/{d}/timeouts" in step for d in seen)
