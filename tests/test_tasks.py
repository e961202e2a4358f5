"""Tasks (roll_gspo.tasks): answer extraction, pass@k / maj@k, task rows and their seeds, the checks
of `tasks.<key>` before workers start, the task reward worker, and the evaluation command on the
tiny model (one vLLM start, in the test process)."""
import itertools
import json
import logging
import math
import os

import pytest

from roll_gspo.rewards.answers import boxed_answer, clean_answer, extract_answer, has_answer_format, last_number
from roll_gspo.tasks import TaskSpec, grouped_sample_metrics, pass_at_k, sample_metrics, score_reply, spec_problems, task_rows
from roll_gspo.tasks.sample_metrics import majority_correct

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_DIGIT_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


# ------------------------------------------------------------------ answer extraction
@pytest.mark.parametrize("reply, answer", [
    ("<answer>42</answer>", "42"),
    ("First <answer>1</answer>, no wait: <answer> 7 </answer> done", "7"),  # the last tag
    ("<answer>**-3.**</answer>", "-3"),  # markdown inside the tag
    ("So $x = \\boxed{\\frac{1}{2}}$. Done.", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{12", "12"),  # an unclosed box is no box; the last number
    ("So, the answer is -97.", "-97"),
    ("The answer is **1,234** apples, I think.", "1234"),  # trailing words, bold, thousands
    ("Final answer: $12$\n\nHope this helps with question 3!", "12"),  # the phrase beats a later number
    ("The answer is 3 + 4 = 7", "7"),
    ("we get 3 + 4 = 7\n\nThat is all.", "7"),  # no phrase: the last number
    ("\u22125 is the result", "-5"),  # a unicode minus
    ("Answer: B", "B"),
    ("<think>it is 5</think>The final answer is 6.", "6"),  # reasoning is not the answer
    ("<think>it is 5 and", ""),  # cut inside reasoning: nothing
    ("no digits at all\n**Paris**.", "Paris"),  # last line, cleaned
    ("", ""),
])
def test_extract_answer(reply, answer):
    assert extract_answer(reply) == answer


def test_extraction_helpers():
    assert boxed_answer("\\boxed{a{b}c} and \\fbox{d}") == "d"
    assert boxed_answer("none") is None
    assert last_number("3 apples, 4.5 pears.") == "4.5"
    assert clean_answer("$\\text{yes}$.") == "yes"
    assert has_answer_format("x <answer>4</answer>") and not has_answer_format("<answer>4</answer><answer>5</answer>")
    assert not has_answer_format("<answer> </answer>") and not has_answer_format("4")


def test_accuracy_does_not_need_the_rewarded_format():
    spec = TaskSpec("sums", name="chain_sum", config=ONE_DIGIT_SUMS, train_size=4, val_size=2,
                    format_weight=0.25).resolved()
    row = task_rows(spec, "val")[0]
    gold = row["answer"]
    tagged = score_reply("", f"Easy. <answer>{gold}</answer>", row["ground_truth"])
    plain = score_reply("", f"Let me see... so the answer is {gold}.", row["ground_truth"])
    wrong = score_reply("", "<answer>99</answer>", row["ground_truth"])
    assert tagged.metrics["accuracy"] == plain.metrics["accuracy"] == 1.0 and wrong.metrics["accuracy"] == 0.0
    assert (tagged.metrics["format_rate"], plain.metrics["format_rate"], wrong.metrics["format_rate"]) == (1, 0, 1)
    # the format term is the only gap, paid with a correct answer only (tags alone were learnt as a hack)
    assert (float(tagged), float(plain), float(wrong)) == (1.25, 1.0, 0.0)
    assert float(score_reply("", "<answer>N</answer>", row["ground_truth"])) == 0.0


# ------------------------------------------------------------------ near misses earn nothing
SMOLLM2_TASKS = ["products", "arithmetic", "lcm"]  # keys of examples/example_gspo_smollm2.yaml's tasks


def smollm2_task(key, **fields):
    """One of the SmolLM2 example's tasks (products, basic_arithmetic, lcm) as its YAML configures it."""
    import yaml

    with open(os.path.join(REPO, "examples", "example_gspo_smollm2.yaml")) as fh:
        task = yaml.safe_load(fh)["tasks"][key]
    return TaskSpec(key, name=task["name"], config=task["config"], train_size=1, val_size=40, **fields).resolved()


def near_misses(gold):
    """Wrong answers that hold the gold answer: reasoning-gym pays len(gold) / len(answer) for them."""
    return {"negated": f"-{gold}", "digit slip": gold + gold[-1],
            "hedged list": f"{int(gold) + 1}, {gold}, {int(gold) - 1}"}


def positive_golds(spec):
    return [row for row in task_rows(spec, "val") if row["answer"].isdigit() and int(row["answer"]) > 0][:8]


@pytest.mark.parametrize("key", SMOLLM2_TASKS)
def test_near_misses_earn_nothing_by_default(key):
    """A negated answer, a digit slip, a hedged list of three guesses: wrong, so 0 reward (no format
    credit either: it goes with a correct answer) and not accurate; group normalisation would make a
    paid near miss a positive advantage."""
    spec = smollm2_task(key, format_weight=0.1)
    for row in positive_golds(spec):
        for kind, answer in near_misses(row["answer"]).items():
            scored = score_reply("", f"The answer is <answer>{answer}</answer>.", row["ground_truth"])
            assert (float(scored), scored.metrics["accuracy"]) == (0.0, 0.0), (spec.name, kind, answer, row["answer"])
            assert 0 < scored.metrics["answer_score"] < 1  # reasoning-gym's own score, still reported


@pytest.mark.parametrize("key", SMOLLM2_TASKS)
def test_partial_credit_gives_reasoning_gyms_leniency_back(key):
    spec = smollm2_task(key, partial_credit=True)
    for row in positive_golds(spec):
        gold = row["answer"]
        for kind, answer in near_misses(gold).items():
            scored = score_reply("", f"<answer>{answer}</answer>", row["ground_truth"])
            assert 0 < float(scored) == scored.metrics["answer_score"] < 1, (spec.name, kind, answer)
            assert scored.metrics["accuracy"] == 0.0  # still not correct
        assert float(score_reply("", f"<answer>{gold}</answer>", row["ground_truth"])) == 1.0


@pytest.mark.parametrize("key", SMOLLM2_TASKS)
def test_a_correct_number_written_another_way_is_correct(key):
    """basic_arithmetic and lcm compare strings ("7.0" earns 2/3 there); products compares
    numbers. Without partial credit a correct number written another way must not fall to 0."""
    spec = smollm2_task(key)
    for row in positive_golds(spec):
        gold = row["answer"]
        for answer in (gold, f"+{gold}", f"0{gold}", f"{gold}.0"):
            scored = score_reply("", f"<answer>{answer}</answer>", row["ground_truth"])
            assert (float(scored), scored.metrics["accuracy"]) == (1.0, 1.0), (spec.name, answer, gold)


def test_partial_credit_is_a_task_key(tmp_path):
    from roll_gspo.config.plan.tasks import task_specs

    cfg = load_tasks_run(tmp_path, overrides=["tasks.sums.partial_credit=true"])
    specs = {s.key: s.resolved() for s in task_specs(cfg)}
    assert (specs["sums"].partial_credit, specs["arith"].partial_credit) == (True, False)
    truth = json.loads(task_rows(specs["sums"], "val")[0]["ground_truth"])
    assert truth["partial_credit"] is True
    from roll_gspo.config import load_config  # and in the SmolLM2 example, per task

    example = load_config(os.path.join(REPO, "examples", "example_gspo_smollm2.yaml"), ["tasks.lcm.partial_credit=true"])
    assert {s.key: s.partial_credit for s in task_specs(example)} == {"products": False, "arithmetic": False, "lcm": True}


# ------------------------------------------------------------------ pass@k, maj@k
def test_pass_at_k_is_the_unbiased_estimator():
    for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 0, 2), (6, 6, 6), (8, 3, 4), (7, 1, 7)]:
        draws = list(itertools.combinations([True] * c + [False] * (n - c), k))
        exact = sum(any(d) for d in draws) / len(draws)  # k of n without replacement, by brute force
        assert pass_at_k(n, c, k) == pytest.approx(exact)
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    assert pass_at_k(200, 10, 1) == pytest.approx(0.05)  # pass@1 is the mean
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_vote_and_metrics_per_domain():
    assert majority_correct(["7", "8", "7", ""], [True, False, True, False])
    assert not majority_correct(["8", "7", "8"], [False, True, False])
    assert not majority_correct(["", ""], [False, False])
    assert majority_correct(["7", "8"], [True, False])  # a tie: the answer seen first
    found = sample_metrics([[True, False, False, False], [False] * 4], [["1", "2", "2", "2"], ["x"] * 4])
    assert found["pass@1"] == pytest.approx(0.125) and found["pass@4"] == pytest.approx(0.5)
    assert found["maj@4"] == 0.0 and found["maj@2"] == 0.5 and set(found) == {"pass@1", "pass@2", "pass@4",
                                                                              "maj@2", "maj@4"}
    # flat rows, 2 samples per prompt; a prompt whose worker has no verdict (None) is left out
    domains, correct = ["a", "a", "b", "b", "c", "c"], [1.0, 0.0, 0.0, 0.0, None, None]
    got = grouped_sample_metrics(domains, correct, ["1", "2", "3", "3", "", ""], 2)
    assert got["pass@2"] == 0.5 and got["a/pass@1"] == 0.5 and got["b/pass@2"] == 0.0 and "c/pass@1" not in got


# ------------------------------------------------------------------ task rows
def test_rows_come_from_disjoint_seeds_and_carry_their_scorer():
    spec = TaskSpec("sums", name="rg:chain_sum", config=ONE_DIGIT_SUMS, train_size=30, val_size=5, seed=3).resolved()
    assert (spec.source, spec.name, spec.val_seed) == ("reasoning_gym", "chain_sum", 1_000_003)
    train, val = task_rows(spec, "train"), task_rows(spec, "val")
    assert (len(train), len(val)) == (30, 5) and task_rows(spec, "val") == val  # deterministic
    seeds = lambda rows: {json.loads(r["ground_truth"])["seed"] + json.loads(r["ground_truth"])["index"] for r in rows}
    assert seeds(train) == set(range(3, 33)) and seeds(val) == set(range(1_000_003, 1_000_008))
    row = val[0]
    assert row["domain"] == "sums" and [m["role"] for m in row["messages"]] == ["system", "user"]
    assert "<answer>" in row["messages"][0]["content"]
    assert score_reply("", row["answer"], row["ground_truth"]).metrics["accuracy"] == 1.0
    # built-in tasks: the raw prompt, no system turn; arithmetic val prompts never in train
    arith = TaskSpec("a", name="builtin:arith_easy", train_size=200, val_size=20).resolved()
    a_train, a_val = task_rows(arith, "train"), task_rows(arith, "val")
    assert [m["role"] for m in a_val[0]["messages"]] == ["user"] and a_val[0]["messages"][0]["content"].endswith("=")
    assert not {r["messages"][0]["content"] for r in a_val} & {r["messages"][0]["content"] for r in a_train}
    choice = task_rows(TaskSpec("c", name="builtin:choice", train_size=2, val_size=2).resolved(), "val")[0]
    assert score_reply("", f"Answer: ({choice['answer']})", choice["ground_truth"]).metrics["accuracy"] == 1.0


def test_spec_problems_name_the_key():
    assert spec_problems(TaskSpec("s", name="chain_sum", config=ONE_DIGIT_SUMS), "tasks.s") == []
    (unknown,) = spec_problems(TaskSpec("chian_sum"), "tasks.chian_sum")
    assert unknown.startswith("tasks.chian_sum.name: unknown task 'chian_sum'; nearest: chain_sum")
    (refused,) = spec_problems(TaskSpec("s", name="chain_sum", config={"max_term": 2}), "tasks.s")
    assert refused.startswith("tasks.s.config: reasoning_gym task 'chain_sum' refuses it: TypeError:")
    assert "unexpected keyword argument 'max_term'" in refused
    (invalid,) = spec_problems(TaskSpec("s", name="chain_sum", config={"min_terms": 5, "max_terms": 2}), "tasks.s")
    assert "max_terms must be >= min_terms" in invalid  # the config's own validate()
    # a config the generator reads only when drawing an entry: one entry is drawn
    (drawn,) = spec_problems(TaskSpec("e", name="simple_equations", config={"operators": ["+", "-"]}), "tasks.e")
    assert drawn.startswith("tasks.e.config: reasoning_gym task 'simple_equations' refuses it: ValueError:")
    assert "weights does not match" in drawn
    sizes = spec_problems(TaskSpec("s", name="chain_sum", train_size=0, val_size=0), "tasks.s")
    assert [p.split(" =")[0] for p in sizes] == ["tasks.s.train_size", "tasks.s.val_size"]
    (overlap,) = spec_problems(TaskSpec("s", name="chain_sum", train_size=100, seed=0, val_seed=50), "tasks.s")
    assert overlap.startswith("tasks.s.val_seed = 50: validation seeds 50..149 overlap the training seeds 0..99")
    (prefix,) = spec_problems(TaskSpec("s", name="hub:chain_sum"), "tasks.s")
    assert "unknown task source 'hub'" in prefix
    (builtin_key,) = spec_problems(TaskSpec("c", name="builtin:choice", config={"levels": [1]}), "tasks.c")
    assert "choice takes no config key ['levels']" in builtin_key


# ------------------------------------------------------------------ the config: checks before workers start
TASKS_RUN = """\
rollout_batch_size: 4
num_return_sequences_in_group: 4
actor_train:
  training_args: {per_device_train_batch_size: 4, gradient_accumulation_steps: 1}
  world_size: 1
tasks:
  sums: {name: chain_sum, config: {min_terms: 2, max_terms: 2}, weight: 3}
  arith: {name: builtin:arith_easy}
rewards:
  tasks: {worker_cls: roll_gspo.workers.rewards.TaskRewardWorker}
"""


def load_tasks_run(tmp_path, text=TASKS_RUN, overrides=()):
    from roll_gspo.config import load_config

    path = tmp_path / "tasks.yaml"
    path.write_text(text)
    return load_config(str(path), list(overrides))


def test_a_task_run_loads_and_its_rows_route_to_the_task_worker(tmp_path):
    from pipelines.setup import reward_routes
    from roll_gspo.config.plan.tasks import task_specs

    cfg = load_tasks_run(tmp_path, overrides=["eval_steps=5"])
    assert cfg.eval_steps == 5  # the tasks' validation rows count as validation data
    assert [s.key for s in task_specs(cfg)] == ["sums", "arith"] and cfg.tasks["sums"].weight == 3
    assert reward_routes(cfg)["sums"] == reward_routes(cfg)["arith"] == "tasks"


def test_bad_tasks_are_refused_before_workers_start(tmp_path):
    from roll_gspo.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load_tasks_run(tmp_path, overrides=[
            "tasks.sums.name=chian_sum", "tasks.arith.val_size=0", "+tasks.more.name=basic_arithmetic",
            "+tasks.more.config.bogus=1", "+tasks.more.reward=math_rule", "+rewards.math_rule.world_size=1",
            "actor_train.data_args.file_name=[builtin:arith/train]"])
    message = str(info.value)
    for expected in ["tasks.sums.name: unknown task 'chian_sum'; nearest: chain_sum",
                     "tasks.arith.val_size = 0", "tasks.more.config: reasoning_gym task 'basic_arithmetic' "
                     "refuses it: TypeError", "tasks.more.reward = 'math_rule': rewards.math_rule.worker_cls",
                     "actor_train.data_args.file_name = ['builtin:arith/train']: with `tasks`"]:
        assert expected in message, (expected, message)


def in_process_task_reward_worker():
    """A TaskRewardWorker set up in this process (timeout_s 0: scored here, no reward process);
    the environment its setup writes (rank, world size) is put back."""
    from roll_gspo.schema.config import RewardConfig
    from roll_gspo.workers.rewards import TaskRewardWorker

    saved = dict(os.environ)
    try:
        worker = TaskRewardWorker(RewardConfig(worker_cls="roll_gspo.workers.rewards.TaskRewardWorker", timeout_s=0),
                                  domain="tasks", dist_env={"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1",
                                                            "MASTER_PORT": 1})
        worker.setup()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return worker


def test_task_reward_worker_counts_the_answer_not_the_format():
    from roll_gspo.distributed.batch import Batch

    worker = in_process_task_reward_worker()
    spec = TaskSpec("sums", name="chain_sum", config=ONE_DIGIT_SUMS, train_size=2, val_size=1,
                    format_weight=0.5).resolved()
    row = task_rows(spec, "val")[0]
    replies = [f"<answer>{row['answer']}</answer>", f"It is {row['answer']}", "<answer>99</answer>"]
    scored = worker.compute_scores(Batch(meta={"prompt_text": [""] * 3, "response_text": replies,
                                               "ground_truth": [row["ground_truth"]] * 3, "domain": ["sums"] * 3}))
    assert scored["scores"].tolist() == [1.5, 1.0, 0.0]  # no format credit without a correct answer
    assert scored["reward_correct"] == [1.0, 1.0, 0.0]
    assert [m["format_rate"] for m in scored["reward_metrics"]] == [1.0, 0.0, 1.0]


def test_task_reward_worker_scores_cut_replies_by_the_task_and_counts_them():
    """A reply cut at response_length (`finished` False) is scored by the task's rule on what it
    wrote, like a finished one, and counted: metric `truncated` (-> `reward/<task>/truncated`)."""
    from roll_gspo.distributed.batch import Batch

    worker = in_process_task_reward_worker()
    spec = TaskSpec("sums", name="chain_sum", config=ONE_DIGIT_SUMS, train_size=2, val_size=1).resolved()
    row = task_rows(spec, "val")[0]
    replies = [f"The answer is {row['answer']}", f"First, {row['answer']}", "First, 3 + 4 is"]
    scored = worker.compute_scores(Batch(meta={"prompt_text": [""] * 3, "response_text": replies,
                                               "ground_truth": [row["ground_truth"]] * 3, "domain": ["sums"] * 3,
                                               "finished": [True, False, False]}))
    # the cut reply that got to the right number counts, as the task scores it; one that did not, not
    assert scored["scores"].tolist() == [1.0, 1.0, float(row["answer"] == "4")]
    assert [m["truncated"] for m in scored["reward_metrics"]] == [0.0, 1.0, 1.0]


# ------------------------------------------------------------------ the evaluation command
def test_eval_command_on_the_tiny_model(tiny_model, session_cache, tmp_path, monkeypatch, capsys, caplog):
    """One vLLM start: greedy and 4 sampled replies on a built-in and a reasoning-gym task, with a
    progress line per chunk of replies. `python -m roll_gspo.eval ...` as its main() in this process
    (the suite has imported vLLM by then; a fresh interpreter would import it again); the variables
    it sets for vLLM are undone."""
    import roll_gspo.eval as eval_module
    from roll_gspo.distributed.cluster import DEFAULT_WORKER_ENV
    from roll_gspo.eval.__main__ import main

    monkeypatch.setattr(eval_module, "PROGRESS_CHUNK_REPLIES", 16)  # greedy: 16 prompts a chunk, sampled: 4
    caplog.set_level(logging.INFO, logger="roll_gspo.eval")

    for key, value in DEFAULT_WORKER_ENV.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.setenv("ROLL_GSPO_CACHE", session_cache)
    monkeypatch.chdir(REPO)
    out = tmp_path / "eval.json"
    assert main(["--model", tiny_model, "--tasks", "builtin:arith_easy", "chain_sum",
                 "--task-config", f"chain_sum={json.dumps(ONE_DIGIT_SUMS)}", "--val-size", "6", "--n", "4",
                 "--max-new-tokens", "6", "--screen", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    header = next(line for line in stdout.splitlines() if line.startswith("task"))
    assert header.split() == ["task", "prompts", "greedy", "format", "cut", "top_ans", "const", "pass@1", "pass@2", "pass@4", "maj@2", "maj@4"]
    result = json.loads(out.read_text())
    assert set(result["tasks"]) == {"arith_easy", "chain_sum"} and result["all"]["prompts"] == 12
    for metrics in [*result["tasks"].values(), result["all"]]:
        assert 0 <= metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@4"] <= 1  # pass@k grows with k
        assert 0 <= metrics["greedy_accuracy"] <= 1
    for metrics in result["tasks"].values():
        assert 0 < metrics["top_answer_share"] <= 1 and 0 < metrics["constant_answer_accuracy"] <= 1
    assert "top_answer_share" not in result["all"]  # a share of one task's answers
    example = result["examples"]["chain_sum"][0]
    assert example["answer"] == extract_answer(example["reply"])  # the one extraction
    assert result["settings"]["tasks"][1]["val_seed"] == 1_000_000
    assert {row["task"] for row in result["screen"]} == {"arith_easy", "chain_sum"}  # --screen's table
    assert any(line.split()[0] == "task" and "headroom" in line for line in stdout.splitlines())
    progress = [r.getMessage() for r in caplog.records if r.name == "roll_gspo.eval"]
    assert [m.split(":")[0] for m in progress] == [
        "12/12 prompts greedy replies", "4/12 prompts x 4 sampled replies (temperature 1.0)",
        "8/12 prompts x 4 sampled replies (temperature 1.0)", "12/12 prompts x 4 sampled replies (temperature 1.0)"]


def test_eval_model_names(tmp_path):
    from roll_gspo.eval import resolve_eval_model, specs_from_names

    run = tmp_path / "run"
    (run / "final_model").mkdir(parents=True)
    (run / "final_model" / "config.json").write_text("{}")
    assert resolve_eval_model(str(run)) == str(run / "final_model")  # a run's output_dir
    assert resolve_eval_model(str(run / "final_model")) == str(run / "final_model")
    step = run / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    with pytest.raises(ValueError, match="a training checkpoint .checkpoints/step_N/, with --config"):
        resolve_eval_model(str(step))  # not committed (no COMPLETE): not a checkpoint
    (step / "COMPLETE").write_text("")
    for shape, why in [({"engine": "fsdp2", "lora": False}, "an fsdp2 checkpoint is not converted"),
                       ({"engine": "deepspeed", "lora": True}, "is a LoRA checkpoint .the adapter only.: give --config"),
                       ({"engine": "deepspeed", "lora": False}, "give --config with the run's YAML")]:
        (step / "pipeline_state.json").write_text(json.dumps({"step": 2, "trainer_shapes": {"actor_train": shape}}))
        with pytest.raises(ValueError, match=why):
            resolve_eval_model(str(step))
    specs = specs_from_names(["rg:chain_sum", "builtin:arith"], val_size=5, configs={"chain_sum": ONE_DIGIT_SUMS})
    assert [(s.key, s.name, s.val_size, s.config) for s in specs] == [
        ("chain_sum", "rg:chain_sum", 5, ONE_DIGIT_SUMS), ("arith", "builtin:arith", 5, {})]


def test_validation_reports_pass_at_k_with_the_eval_code():
    from pipelines.reward_scoring import sample_metrics as _sample_metrics
    from roll_gspo.distributed.batch import Batch

    truths = [json.dumps({"answer": a}) for a in ("4", "4", "6", "6")] + [json.dumps({"answer": a}) for a in "8888"]
    batch = Batch(meta={"domain": ["sums"] * 4 + ["legs"] * 4, "reward_correct": [1.0, 0.0, 0.0, 0.0] + [0.0] * 4,
                        "response_text": ["<answer>4</answer>", "5", "The answer is 5.", "**5**"] + ["12 legs"] * 4,
                        "ground_truth": truths})
    found = _sample_metrics(batch, 2)  # 2 prompts per task, 2 replies each
    assert found["val/sums/pass@2"] == 0.5 and found["val/sums/maj@2"] == 0.5 and found["val/legs/pass@1"] == 0.0
    assert found["val/pass@1"] == pytest.approx(0.125)
    # one answer to every prompt shows, and what a constant answer would score
    assert found["val/legs/top_answer_share"] == 1.0 and found["val/legs/constant_answer_accuracy"] == 1.0
    assert found["val/sums/top_answer_share"] == 0.75 and found["val/sums/constant_answer_accuracy"] == 0.5


def test_answer_spread_and_reference_answers():
    from roll_gspo.tasks import answer_spread, reference_answer

    assert reference_answer(json.dumps({"answer": "Yes", "source": "reasoning_gym"})) == "Yes"
    assert reference_answer("42") == "42" and reference_answer("x + 1") == "x + 1"  # math_rule's plain strings
    spread = answer_spread(["a", "a", "a", "b"], ["1", "1", "", "7"], ["1", "2", "2", "7"])
    assert spread == {"a/top_answer_share": pytest.approx(2 / 3), "a/constant_answer_accuracy": pytest.approx(2 / 3),
                      "b/top_answer_share": 1.0, "b/constant_answer_accuracy": 1.0}


def test_screening_ranks_tasks_by_headroom_and_says_why_one_is_left_out():
    """`--screen`: 5-50 % greedy, no answer repeated past twice the gold's top
    share, the most headroom (pass@k - greedy) first."""
    from roll_gspo.eval import format_screen, screen_tasks

    def task(greedy, pass8, top=0.1, gold=0.1):
        return {"greedy_accuracy": greedy, "pass@1": greedy, "pass@8": pass8, "top_answer_share": top,
                "constant_answer_accuracy": gold, "mean_reply_tokens": 20.0, "greedy_format_rate": 0.5}

    result = {"tasks": {"small_room": task(0.30, 0.40), "much_room": task(0.20, 0.70), "too_easy": task(0.80, 0.95),
                        "one_answer": task(0.25, 0.90, top=0.6, gold=0.1)}}
    rows = screen_tasks(result)
    assert [r["task"] for r in rows] == ["much_room", "small_room", "one_answer", "too_easy"]
    assert rows[0]["headroom"] == pytest.approx(0.5) and rows[0]["k"] == 8 and rows[0]["eligible"]
    assert "one answer dominates (0.60 of replies, 0.10 of the gold)" in rows[2]["why"]
    assert "greedy 0.80 outside 0.05-0.50" in rows[3]["why"]
    table = format_screen(rows)
    assert table.splitlines()[1].startswith("much_room") and table.splitlines()[1].endswith("train")


def test_eval_command_samples_at_the_configs_rollout_temperature(tmp_path, monkeypatch):
    """With --config, pass@k is measured at the rollout's temperature and top_p (what RL samples),
    unless --temperature / --top-p say otherwise; without a config, 1.0."""
    import roll_gspo.eval.__main__ as eval_main

    seen = []

    def fake_evaluate(model, specs, **kwargs):
        seen.append((kwargs["temperature"], kwargs["top_p"]))
        ranks.append(kwargs["model_args"].lora_rank if kwargs["model_args"] is not None else None)
        raise SystemExit(0)  # the settings are all this test reads

    ranks = []

    monkeypatch.setattr(eval_main, "evaluate", fake_evaluate)
    monkeypatch.chdir(REPO)
    config = "examples/example_gspo_smollm2.yaml"  # temperature 0.7, top_p 1.0
    for argv in (["--config", config], ["--config", config, "--temperature", "1.0", "--top-p", "0.9"],
                 ["--tasks", "chain_sum"], ["--config", config, "actor_train.model_args.lora_rank=4"]):
        with pytest.raises(SystemExit):
            eval_main.main(["--model", "builtin:tiny", "--out", str(tmp_path / "e.json"), *argv])
    assert seen == [(0.7, 1.0), (1.0, 0.9), (1.0, 1.0), (0.7, 1.0)]
    assert ranks[-1] == 4  # the run's command-line overrides apply to --config (a LoRA run's keys)
    with pytest.raises(SystemExit, match="need --config"):
        eval_main.main(["--model", "builtin:tiny", "--tasks", "chain_sum", "--out", "e.json", "seed=7"])


def test_eval_command_says_what_is_wrong_with_its_model_in_one_line(tmp_path, monkeypatch):
    """A LoRA checkpoint without the run's LoRA keys: one line naming --model, not a trace."""
    import roll_gspo.eval.__main__ as eval_main

    step = tmp_path / "run" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / "pipeline_state.json").write_text(json.dumps(
        {"step": 2, "trainer_shapes": {"actor_train": {"engine": "deepspeed", "lora": True}}}))
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit, match=r"^error: --model .* is a LoRA checkpoint .*overrides of its command line"):
        eval_main.main(["--model", str(step), "--tasks", "chain_sum", "--out", str(tmp_path / "e.json")])


def test_an_answer_the_generators_scorer_cannot_parse_scores_zero():
    """prime_factorization's scorer calls int() on each factor unguarded: a reply's "1/2" raised out
    of the reward (a 7-minute evaluation lost at its end); it is a wrong answer."""
    spec = TaskSpec("p", name="prime_factorization", config={"min_value": 2, "max_value": 50},
                    train_size=1, val_size=1).resolved()
    row = task_rows(spec, "val")[0]
    wrong = score_reply("", "The answer is <answer>1/2</answer>", row["ground_truth"])
    assert wrong == 0.0 and wrong.metrics["accuracy"] == 0.0
    right = score_reply("", f"<answer>{row['answer']}</answer>", row["ground_truth"])
    assert right.metrics["accuracy"] == 1.0
