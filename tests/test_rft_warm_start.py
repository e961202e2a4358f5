"""The warm start from the policy's own correct answers (`warm_start`, pipelines/rft_warm_start.py): which
replies are kept, the SFT rows, the run's reward in the driver, the refusals before workers start, and
one small run (sampling, fine-tuning, one RL step from the fine-tuned model, a second start reusing it)."""
import json
import os

import pytest

from pipelines.rft_warm_start import Reply, choose_replies, pick_prompts, sft_rows, summarise


def reply(text, correct=True, formatted=True, finished=True):
    return Reply(text, correct, formatted, finished)


# ------------------------------------------------------------------ choosing the kept replies
def test_kept_replies_are_correct_finished_formatted_distinct_and_capped():
    replies = [reply("7", correct=False), reply("The answer is 8"), reply(" The answer is 8 "),  # a repeat
               reply("8", formatted=False), reply("so 8", finished=False), reply("   ", correct=True),
               reply("<answer>8</answer>"), reply("8!")]
    assert choose_replies(replies, 1, require_format=True) == [1]
    assert choose_replies(replies, 3, require_format=True) == [1, 6, 7]
    assert choose_replies(replies, 3, require_format=False) == [1, 3, 6]  # unformatted counts now
    assert choose_replies(replies, 8, require_format=True) == [1, 6, 7]  # the cap is an upper bound
    assert choose_replies([reply("x", correct=False)] * 4, 2, require_format=False) == []


def test_sft_rows_pair_the_templated_prompt_with_each_kept_reply():
    items = [{"prompt_text": "<|user|>1+1=<|assistant|>", "domain": "a"},
             {"prompt_text": "<|user|>2+2=<|assistant|>", "domain": "b"}]
    replies = [[reply("2"), reply("two")], [reply("5", correct=False)]]
    rows = sft_rows(items, replies, [[0, 1], []])
    assert rows == [{"prompt": "<|user|>1+1=<|assistant|>", "response": "2", "domain": "a"},
                    {"prompt": "<|user|>1+1=<|assistant|>", "response": "two", "domain": "a"}]
    summary = summarise(items, replies, [[0, 1], []])
    assert summary["a"] == {"prompts": 1, "samples": 2, "accuracy": 1.0, "format_rate": 1.0, "truncated": 0.0,
                            "kept": 2, "prompts_kept": 1}
    assert summary["all"]["accuracy"] == pytest.approx(2 / 3) and summary["all"]["prompts_kept"] == 1


def test_prompts_follow_the_mix_and_the_seed():
    items = [{"domain": "a", "i": i} for i in range(100)] + [{"domain": "b", "i": i} for i in range(5)]
    picked = pick_prompts(items, 20, seed=3, mix={"a": 1.0, "b": 3.0})
    assert sum(p["domain"] == "b" for p in picked) == 5 and len(picked) == 20  # b has 5 rows; a makes up the rest
    shares = pick_prompts(items, 8, seed=3, mix={"a": 1.0, "b": 1.0})
    assert sum(p["domain"] == "b" for p in shares) == 4
    assert picked == pick_prompts(items, 20, seed=3, mix={"a": 1.0, "b": 3.0})
    assert picked != pick_prompts(items, 20, seed=4, mix={"a": 1.0, "b": 3.0})
    assert len(pick_prompts(items, 500, seed=3)) == 105  # all there are
    assert {p["domain"] for p in pick_prompts(items, 50, seed=3, mix={"a": 1.0, "b": 0.0})} == {"a"}


# ------------------------------------------------------------------ the run's reward in the driver
TASKS_RUN = """\
pretrain: builtin:tiny-arith
rollout_batch_size: 4
num_return_sequences_in_group: 4
actor_train:
  training_args: {per_device_train_batch_size: 4, gradient_accumulation_steps: 1}
  world_size: 1
tasks:
  sums: {name: builtin:arith_easy, format_weight: 0.1, train_size: 50, val_size: 10}
  plain: {name: builtin:arith_easy, seed: 7, train_size: 50, val_size: 10, val_seed: 5000}
rewards:
  tasks: {worker_cls: roll_gspo.workers.rewards.TaskRewardWorker}
warm_start: {enabled: true, prompts: 8, samples_per_prompt: 2}
"""


RULE_RUN = "warm_start: {enabled: true}\nactor_train: {data_args: {file_name: [builtin:arith_easy/train]}}\n"


def load(tmp_path, text, overrides=()):
    from roll_gspo.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(str(path), list(overrides))


def refusal(tmp_path, text, overrides=()):
    from roll_gspo.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, overrides)
    return str(info.value)


def test_task_rewards_score_in_the_driver_with_the_format_the_task_pays_for(tmp_path):
    from pipelines.rft_warm_start import reward_scorers
    from roll_gspo.tasks import TaskSpec, task_rows

    cfg = load(tmp_path, TASKS_RUN)
    scorers = reward_scorers(cfg)
    for key, weight in (("sums", 0.1), ("plain", 0.0)):
        row = task_rows(TaskSpec(key, name="builtin:arith_easy", format_weight=weight, train_size=1).resolved(),
                        "train")[0]
        right, wrong = row["answer"], str(int(row["answer"]) + 1)
        score = scorers[key]
        assert score("", right, row["ground_truth"]) == (True, weight == 0)  # no tags: formatted only when unpaid
        assert score("", f"<answer>{right}</answer>", row["ground_truth"]) == (True, True)
        assert score("", f"<answer>{wrong}</answer>", row["ground_truth"])[0] is False
        assert score("", f"<think>{right}", row["ground_truth"]) == (False, False)  # unfinished reasoning


def test_rule_rewards_score_in_the_driver_with_their_format_pattern(tmp_path):
    from pipelines.rft_warm_start import reward_scorers

    cfg = load(tmp_path, RULE_RUN + "rewards:\n  math_rule:\n"
                         "    format_pattern: '^.*\\\\boxed\\{.*\\}.*$'\n")
    score = reward_scorers(cfg)["math_rule"]
    assert score("1+1=", "so \\boxed{2}", "2") == (True, True)
    assert score("1+1=", "2", "2") == (False, False)  # right, but not the block's format
    assert score("1+1=", "\\boxed{3}", "2") == (False, True)


# ------------------------------------------------------------------ refusals before workers start
def test_a_warm_start_is_refused_where_it_cannot_run(tmp_path):
    on = RULE_RUN
    assert "warm_start.enabled: runs before an RL run of `pipeline: rlvr` only (this is `pipeline: sft`" in refusal(
        tmp_path, "pipeline: sft\n" + on)
    from roll_gspo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config("example_agentic.yaml", ["warm_start.enabled=true"])
    agentic = str(info.value)
    assert "(this is `pipeline: agentic`" in agentic
    judge = refusal(tmp_path, on, ["rewards.math_rule.worker_cls=roll_gspo.workers.rewards.RewardModelWorker",
                                   "reward_pretrain=builtin:tiny-arith"])
    assert "rewards.math_rule.worker_cls = 'roll_gspo.workers.rewards.RewardModelWorker' with warm_start.enabled" in judge
    sandbox = refusal(tmp_path, on, ["rewards.math_rule.worker_cls=roll_gspo.workers.rewards.CodeSandboxRewardWorker"])
    assert "scores its samples in the driver" in sandbox
    adapter = refusal(tmp_path, on, ["actor_train.model_args.lora_target=all-linear",
                                     "actor_train.model_args.adapter_name_or_path=/tmp/adapter"])
    assert "actor_train.model_args.adapter_name_or_path = '/tmp/adapter' with warm_start.enabled" in adapter
    numbers = refusal(tmp_path, on, ["warm_start.prompts=0", "warm_start.temperature=0", "warm_start.kept_per_prompt=9"])
    assert "warm_start.prompts = 0: must be >= 1" in numbers
    assert "warm_start.temperature = 0" in numbers and "more than warm_start.samples_per_prompt = 8" in numbers


def test_what_a_warm_start_takes_loads(tmp_path):
    from roll_gspo.config.checks.warm_start import training_reward_blocks

    cfg = load(tmp_path, TASKS_RUN, ["actor_train.model_args.lora_target=all-linear"])  # LoRA: merged after SFT
    assert cfg.warm_start.enabled and training_reward_blocks(cfg) == ["tasks"]
    load(tmp_path, RULE_RUN, ["rewards.math_rule.worker_cls=roll_gspo.workers.rewards."
                                                     "FunctionRewardWorker", "rewards.math_rule.reward_fn="
                                                     "tests.reward_fns:digit_fraction"])
    load(tmp_path, "pipeline: sft\nactor_train: {data_args: {file_name: [builtin:arith/sft]}}\n")  # off: not checked


def test_the_rl_run_continues_from_the_warm_started_model(tmp_path):
    from pipelines.rft_warm_start import sft_config, warm_started

    cfg = load(tmp_path, TASKS_RUN, ["warm_start.learning_rate=3e-4", "warm_start.per_device_train_batch_size=2"])
    after = warm_started(cfg, "/runs/x/warm_start/model")
    assert {getattr(after, r).model_args.model_name_or_path for r in ("actor_train", "actor_infer", "reference")} == {
        "/runs/x/warm_start/model"}
    assert cfg.actor_train.model_args.model_name_or_path == "builtin:tiny-arith"  # the loaded config is unchanged
    sft = sft_config(cfg, "/runs/x/warm_start/sft_data.jsonl")
    assert (sft.pipeline, sft.output_dir) == ("sft", os.path.join(cfg.output_dir, "warm_start", "sft"))
    args = sft.actor_train.training_args
    assert (args.learning_rate, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (3e-4, 2, 1)
    assert sft.actor_train.data_args.file_name == ["/runs/x/warm_start/sft_data.jsonl"]
    assert sft.actor_train.model_args.model_name_or_path == "builtin:tiny-arith"


# ------------------------------------------------------------------ one small run
@pytest.mark.e2e
def test_warm_start_then_one_rl_step_then_reused(tmp_path, tiny_model, ray_session, caplog):
    """16 prompts x 4 replies from the random-init micro model, scored by a rule it passes often (a reply
    with a digit: it cannot add), a few SFT steps, one RL step at learning rate 0, so
    the final model is the warm-started one exactly; a second start reuses the warm start."""
    import logging

    from tests.test_pipeline_e2e import load_weights, run, weights_changed, write_config
    from pipelines.rft_warm_start import warm_start

    caplog.set_level(logging.INFO, logger="roll_gspo")
    cfg = write_config(
        tmp_path, tiny_model, max_steps=1, rewards={"math_rule": {"reward_fn": "tests.rft_reward_fns:has_digit"}},
        # Room to end: the random model ends ~1.6 % of its tokens with <eos>, and only ended replies are kept.
        response_length=24, actor_infer={"strategy_args": {"strategy_config": {"max_model_len": 48}}},
        actor_train={"data_args": {"file_name": ["builtin:arith_easy/train"]},
                     "training_args": {"learning_rate": 0.0}},
        warm_start={"enabled": True, "prompts": 16, "samples_per_prompt": 4, "kept_per_prompt": 2,
                    "learning_rate": 1e-3, "per_device_train_batch_size": 2})
    records = run(cfg)
    folder = os.path.join(cfg.output_dir, "warm_start")
    with open(os.path.join(folder, "summary.json")) as handle:
        summary = json.load(handle)
    every = summary["tasks"]["all"]
    assert every["prompts"] == 16 and every["samples"] == 64 and 0 < every["accuracy"] <= 1
    assert 4 <= every["kept"] <= 32 and summary["sft_rows"] == every["kept"]
    assert summary["sft"]["optimizer_steps"] == every["kept"] // 4 and summary["prompt_token_mismatches"] == 0
    assert all(summary["seconds"][k] > 0 for k in ("sampling", "sft", "total"))
    with open(os.path.join(folder, "samples.jsonl")) as handle:
        samples = [json.loads(line) for line in handle]
    assert len(samples) == 64 and sum(s["kept"] for s in samples) == every["kept"]
    assert all(s["correct"] and s["finished"] for s in samples if s["kept"])
    model = os.path.join(folder, "model")
    assert os.path.isfile(os.path.join(model, "COMPLETE"))
    # The RL step (learning rate 0) started from the warm-started weights, which SFT moved off the base.
    assert [r["step"] for r in records if "actor/pg_loss" in r] == [1]
    assert weights_changed(tiny_model, model) > 0
    final, warm = load_weights(os.path.join(cfg.output_dir, "final_model")), load_weights(model)
    assert all(bool((final[k] == warm[k]).all()) for k in warm)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm start:")]
    assert any(" samples, accuracy " in m for m in lines) and any(m.startswith("warm start: kept ") for m in lines)
    # A second start: reused, not redone.
    stamp = os.path.getmtime(os.path.join(folder, "summary.json"))
    again = warm_start(cfg)
    assert again.actor_train.model_args.model_name_or_path == model == again.actor_infer.model_args.model_name_or_path
    assert os.path.getmtime(os.path.join(folder, "summary.json")) == stamp
    # A half-finished one (no COMPLETE) is redone: here only its start is checked (the folder is cleared).
    os.remove(os.path.join(model, "COMPLETE"))
    from pipelines import rft_warm_start as module

    class Stop(Exception):
        pass

    def stop(cfg, folder):
        assert os.listdir(folder) == []
        raise Stop

    original, module.run_warm_start = module.run_warm_start, stop
    try:
        with pytest.raises(Stop):
            warm_start(cfg)
    finally:
        module.run_warm_start = original


def test_the_smollm2_example_builds_on_the_example_with_the_warm_start_on():
    from roll_gspo.config import load_config

    base, rft = load_config("example_gspo_smollm2.yaml"), load_config("example_gspo_smollm2_rft.yaml")
    assert rft.warm_start.enabled and not base.warm_start.enabled and rft.exp_name == "example_gspo_smollm2_rft"
    assert rft.tasks == base.tasks and rft.actor_train.training_args == base.actor_train.training_args
