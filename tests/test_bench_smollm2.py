"""benchmarks/bench_smollm2_learning.py's figures from a run's metrics (the run itself, 30 minutes on
the real model, is not started here; its --smoke mode takes minutes on 2 cores, so no test runs it)."""
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_smollm2_learning.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_smollm2_learning", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def val(step, a, b, fa=0.0, fb=0.0):
    return {"step": step, "val/accuracy": (a + b) / 2, "val/x/accuracy": a, "val/y/accuracy": b,
            "val/x/format_rate": fa, "val/y/format_rate": fb, "val/pass@1": 0.5}


def test_curve_verdict_and_report(bench, tmp_path):
    records = [val(0, 0.2, 0.1), {"step": 1, "time/step_s": 30.0}, val(10, 0.5, 0.4, 0.5, 0.3),
               val(20, 0.6, 0.05)]
    curve = bench.learning_curve(records, {0: 60.0, 10: 600.0})
    assert [p["step"] for p in curve] == [0, 10, 20] and curve[0]["elapsed_s"] == 60.0
    assert curve[1]["mean_accuracy"] == pytest.approx(0.45) and curve[1]["mean_format_rate"] == pytest.approx(0.4)
    spread = {"x": {"answer": "7", "reply_share": 0.1, "gold_share": 0.05},
              "y": {"answer": "3", "reply_share": 0.2, "gold_share": 0.1}}
    result = bench.verdict(curve, shares=spread)
    # the mean rose by 0.175 and y fell: both fail
    assert result["rise"] == pytest.approx(0.175) and not result["rise_ok"] and not result["every_task_rises"]
    assert result["task_change"]["y"] == pytest.approx(-0.05)
    good = bench.verdict(curve[:2], shares=spread)
    assert good["pass"] and good["rise"] == pytest.approx(0.3)
    report = bench.format_report(curve[:2], good)
    assert "mean accuracy rise" in report and "+0.300" in report and "PASS" in report
    assert bench.verdict(curve[:1])["pass"] is False
    assert not bench.verdict(curve[:2])["pass"]  # no validation replies: the answer rule cannot be read
    bench.plot(curve, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 1000
    # a task that did not rise fails, as one that fell does
    flat = bench.learning_curve([val(0, 0.2, 0.1), val(10, 0.2, 0.9)])
    assert bench.verdict(flat, shares=spread)["rise_ok"] and not bench.verdict(flat, shares=spread)["pass"]
    # a rise that is one answer repeated: x's most common answer in 97 % of replies, 30 % of the gold answers
    collapsed = dict(spread, x={"answer": "1", "reply_share": 0.97, "gold_share": 0.3})
    result = bench.verdict(curve[:2], shares=collapsed)
    assert result["rise_ok"] and result["answer_spread_ok"] == {"x": False, "y": True} and not result["pass"]
    report = bench.format_report(curve[:2], result)
    assert "x top answer '1'" in report and "0.970   <= 2 x gold 0.300  NO" in report
    args = bench.parse_args(["--smoke", "seed=3"])
    assert args.smoke and args.overrides == ["seed=3"] and args.minutes == 45.0
    for bad in (["--passk-prompts", "0"], ["--passk-n", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_answer_shares_read_validation_replies(bench):
    """The most common reply answer per task, its share of the replies and of the gold answers."""
    import json

    def reply(task, answer, gold):
        return {"task": task, "answer": answer, "ground_truth": json.dumps({"answer": gold})}

    records = [reply("x", "1", "1"), reply("x", "1", "2"), reply("x", "1", "3"), reply("x", "4", "4"),
               reply("y", "5", "5"), reply("y", "6", "6")]
    shares = bench.answer_shares(records)
    assert shares["x"] == {"answer": "1", "reply_share": 0.75, "gold_share": 0.25}
    assert shares["y"]["reply_share"] == 0.5 and shares["y"]["gold_share"] == 0.5


def test_passk_table(bench):
    text = bench.format_passk({"base": {"greedy_accuracy": 0.275, "pass@1": 0.2, "pass@8": 0.52},
                               "final": {"greedy_accuracy": 0.5, "pass@1": 0.45, "pass@8": 0.6}})
    lines = text.splitlines()
    assert lines[0].split() == ["model", "greedy_accuracy", "pass@1", "pass@8"]
    assert lines[1].split() == ["base", "0.275", "0.200", "0.520"] and lines[2].split()[-1] == "0.600"


def test_the_smollm2_examples_load(tmp_path, monkeypatch):
    """The three examples load and pass the config checks without building the model (an empty cache):
    `dtype: auto`, fp32 on a CPU without bf16 instructions (old log-probs from vLLM, the correction
    idle), three reasoning-gym tasks
    of 200 held-out prompts each; the LoRA one changes only the adapter keys and the learning rate,
    the GRPO one only the policy loss."""
    from roll_gspo.config import load_config
    from roll_gspo.config.plan.tasks import task_specs

    from roll_gspo.config.plan import cpu_precision
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    monkeypatch.setenv("ROLL_GSPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: ("avx2", "avx512f"))  # dtype: auto -> fp32
    full = load_config(str(BENCH.parents[1] / "examples" / "example_gspo_smollm2.yaml"))
    lora = load_config(str(BENCH.parents[1] / "examples" / "example_gspo_smollm2_lora.yaml"))
    assert full.pretrain == "builtin:smollm2-135m-instruct" and full.importance_sampling == "seq"
    assert full.actor_train.model_args.dtype == full.actor_infer.model_args.dtype == "fp32"
    # the correction (for bf16, where auto picks it) costs nothing in fp32: vLLM's log-probs are the old ones
    assert full.train_infer_correction.is_weight.enabled and choose_old_logprob_source(full).source == "rollout"
    specs = task_specs(full)
    assert len(specs) >= 3 and all(s.val_size >= 200 and s.source == "reasoning_gym" for s in
                                   (spec.resolved() for spec in specs))
    assert lora.actor_train.model_args.lora_target == "all-linear" and full.actor_train.model_args.lora_target is None
    assert [s.key for s in task_specs(lora)] == [s.key for s in specs]
    grpo = load_config(str(BENCH.parents[1] / "examples" / "example_grpo_smollm2.yaml"))
    assert (grpo.importance_sampling, grpo.loss_agg_mode, grpo.pg_clip_low, grpo.pg_clip_high) == \
        ("token", "token-mean", 0.2, 0.28)
    assert [s.key for s in task_specs(grpo)] == [s.key for s in specs]
    assert grpo.actor_train.training_args.learning_rate == full.actor_train.training_args.learning_rate
    assert choose_old_logprob_source(grpo).source == "rollout"  # token ratios too: fp32 mismatch is ~1e-6
    assert not (tmp_path / "cache" / "models").exists()  # nothing built


def test_table_compares_finished_runs(bench, tmp_path):
    """--table: per validation point the mean accuracy and the training metrics averaged since the
    previous point; the final model's pass@k (from the evaluation command's JSON) in the last row."""
    import json

    def finished(name, clip, with_eval):
        out = tmp_path / name
        (out / "run").mkdir(parents=True)
        records = [val(0, 0.2, 0.2), *({"step": s, "time/step_s": 50.0, "actor/clipfrac": clip * s,
                                        "actor/entropy": 0.5, "response/length_mean": 30.0 + s} for s in (1, 2, 3, 4)),
                   val(2, 0.4, 0.2), val(4, 0.5, 0.3)]
        (out / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        curve = bench.learning_curve(records, {0: 60.0, 2: 180.0, 4: 300.0})
        (out / "learning.json").write_text(json.dumps({"config": "x.yaml", "overrides": [], "steps": 4,
                                                       "wall_s": 320.0, "curve": curve,
                                                       "result": bench.verdict(curve)}))
        if with_eval:
            (out / "eval.json").write_text(json.dumps({"all": {"greedy_accuracy": 0.4, "pass@1": 0.3, "pass@8": 0.7,
                                                               "maj@8": 0.4}}))
        return out

    gspo, grpo = finished("gspo", 0.1, True), finished("grpo", 0.01, False)
    summary = bench.run_summary(gspo)
    assert [p["step"] for p in summary["points"]] == [0, 2, 4] and summary["rise"] == pytest.approx(0.2)
    assert summary["points"][0]["clip"] == pytest.approx(0.1)  # step 0: the first step's
    assert summary["points"][1]["clip"] == pytest.approx(0.15) and summary["points"][2]["clip"] == pytest.approx(0.35)
    assert summary["points"][2]["reply tokens"] == pytest.approx(33.5)
    assert summary["eval"] == {"greedy_accuracy": 0.4, "pass@1": 0.3, "pass@8": 0.7}
    table = bench.format_table([summary, bench.run_summary(grpo)]).splitlines()
    assert table[0] == "| run | step | min | mean accuracy | clip | entropy | reply tokens | final pass@1 | final pass@8 |"
    assert table[2].startswith("| gspo | 0 | 1.0 | 0.200 | 0.100 | 0.500 | 31.0 |  |  |")
    assert table[4].endswith("| 0.350 | 0.500 | 33.5 | 0.300 | 0.700 |")
    assert table[5].startswith("| grpo | 0 |") and table[-1].endswith("| 33.5 |  |  |")
    assert bench.parse_args(["--table", "a", "b"]).overrides == ["a", "b"]
    seeds = bench.format_seed_table([summary, bench.run_summary(grpo), dict(summary, name="gspo_s7", rise=0.4)])
    lines = seeds.splitlines()
    assert lines[0] == "| config | runs | step 0 | step 2 | step 4 | rise | final pass@1 | final pass@8 |"
    # the two gspo-like runs share x.yaml here: one row, their mean with each run's value
    assert lines[2] == ("| x | gspo, grpo, gspo_s7 | 0.200 (0.200, 0.200, 0.200) | 0.300 (0.300, 0.300, 0.300) | "
                        "0.400 (0.400, 0.400, 0.400) | 0.267 (0.200, 0.200, 0.400) | - | - |")
    other = bench.format_seed_table([summary, dict(summary, config="y.yaml")]).splitlines()
    assert other[2].startswith("| x | gspo | 0.200 |") and other[2].endswith("| 0.300 | 0.700 |")
    assert other[3].startswith("| y | gspo |")
