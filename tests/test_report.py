"""The run report (roll_gspo.report) without a browser: stall detection, the warnings and their
thresholds, reading a run folder with bad files in it, the page's data and the command."""
import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from roll_gspo.metrics.stalls import find_stalls as metric_stalls
from roll_gspo.report import NotARunFolder, find_stalls, report_data, run_warnings, write_report
from tests.report_fixtures import KNOWN_RESPONSE, STALL_STEP, make_run, write_jsonl_gz
from roll_gspo.report.checks import (dominant_answer, logprob_gap_warning, paid_without_correctness,  # noqa: E402
                                     reward_without_correctness_warnings, truncated_shares, truncation_warning)
from roll_gspo.report.page import (MAX_STEPS_EMBEDDED, MAX_TRAIN_SAMPLES_PER_STEP, chart_groups,  # noqa: E402
                                   embed_json, spaced_steps)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def embedded(path):
    """The JSON a written page carries."""
    text = open(path, encoding="utf-8").read()
    return json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text, re.S).group(1))


# -- stalls ---------------------------------------------------------------------------------------
def rows_with(phase_values, **extra):
    return [{"step": i + 1, "time/generate_s": v, "time/sync_s": 0.5, **extra} for i, v in enumerate(phase_values)]


def test_a_phase_over_three_times_its_median_and_a_second_above_is_a_stall():
    stalls = find_stalls(rows_with([5.0, 5.2, 4.9, 5.1, 20.0, 5.1]))
    assert [(s["step"], s["kind"], s["phase"], s["role"]) for s in stalls] == [(5, "phase", "generate", "actor_infer")]
    assert stalls[0]["median"] == 5.05 and stalls[0]["seconds"] == 20.0
    assert stalls[0]["line"].startswith("stall: step 5 generate (actor_infer) took 20.0 s")


def test_a_short_phase_tripling_by_under_a_second_is_not_a_stall():
    assert find_stalls(rows_with([0.1, 0.1, 0.1, 0.1, 0.9, 0.1])) == []  # 9x, but 0.8 s above


def test_a_phase_under_three_times_its_median_is_not_a_stall():
    assert find_stalls(rows_with([5.0, 5.0, 5.0, 5.0, 14.9, 5.0])) == []


def test_the_report_marks_what_the_console_flagged():
    # one rule (roll_gspo.metrics.stalls): the first steps set the median, a missing value is no step
    rows = rows_with([40.0, 5.0, None, 5.0, 5.0, 40.0])
    for row in rows:
        row["time/step_s"] = 100.0 if row["step"] == 3 else 5.0  # the step's sum is no phase
    assert [(s["step"], s["phase"]) for s in find_stalls(rows)] == [(6, "generate")]
    assert [(s.step, s.phase) for s in metric_stalls(rows)] == [(6, "generate")]


def test_throughput_collapsing_is_marked_too():
    rows = [{"step": s, "throughput/tokens_per_s": 500.0 if s < 5 else 100.0} for s in range(1, 6)]
    assert [(s["step"], s["kind"]) for s in find_stalls(rows)] == [(5, "throughput")]
    assert run_warnings(rows, {}, {})[0]["message"].endswith("under a third of its median 500")


# -- reward paid without correctness --------------------------------------------------------------
@pytest.mark.parametrize("record, paid", [
    # reasoning-gym's partial credit on: a negated answer paid its answer score plus the format term
    ({"correct": False, "reward": 0.56, "reward_parts": {"answer_score": 0.46, "format_rate": 1.0}}, True),
    # partial credit off: the same near miss paid only its format weight (the design)
    ({"correct": False, "reward": 0.1, "reward_parts": {"answer_score": 0.46, "format_rate": 1.0}}, False),
    ({"correct": False, "reward": 0.1, "reward_parts": {"format": 0.1}}, False),
    ({"correct": False, "reward": 0.3}, True),  # nothing explains it
    ({"correct": False, "reward": 0.3, "reward_parts": {"length_penalty": -0.1}}, True),
    ({"correct": True, "reward": 1.0, "reward_parts": {"answer_score": 1.0}}, False),
    ({"correct": None, "reward": 0.7}, False),  # a reward model: no notion of correct
    ({"correct": False, "reward": 0.0, "reward_parts": {"answer_score": 0.46}}, False),
    ({"correct": False, "reward": float("nan")}, False),
    ({"reward": 0.5}, False),
    # a task row states its format weight: a near miss (answer_score 0.05) paid 0.1 for its format only
    ({"correct": False, "reward": 0.1, "reward_parts": {"answer_score": 0.05, "format_rate": 1.0},
      "ground_truth": json.dumps({"answer": "7", "format_weight": 0.1, "partial_credit": False})}, False),
    ({"correct": False, "reward": 0.15, "reward_parts": {"answer_score": 0.05, "format_rate": 1.0},
      "ground_truth": json.dumps({"answer": "7", "format_weight": 0.1, "partial_credit": True})}, True),
    ({"correct": False, "reward": 0.5, "reward_parts": {"answer_score": 0.5, "format_rate": 0.0},
      "ground_truth": json.dumps({"answer": "7", "format_weight": 0.0})}, True),
])
def test_paid_without_correctness(record, paid):
    assert paid_without_correctness(record) is paid


def test_paid_wrong_answers_are_one_warning_per_task_with_a_first_example():
    train = {3: [{"task": "a", "index": 0, "correct": False, "reward": 0.5},
                 {"task": "a", "index": 1, "correct": False, "reward": 0.0},
                 {"task": "b", "index": 2, "correct": True, "reward": 1.0}],
             4: [{"task": "a", "index": 7, "correct": False, "reward": 0.7}]}
    [found] = reward_without_correctness_warnings(train)
    assert found["task"] == "a" and found["steps"] == [3, 4] and found["example"] == {"step": 3, "index": 0}
    assert "2 of 3 wrong answers of task 'a'" in found["message"]


# -- one answer dominating ------------------------------------------------------------------------
def answers(*values, truths=None):
    return [{"answer": v, "ground_truth": (truths or [None] * len(values))[i]} for i, v in enumerate(values)]


def test_one_answer_over_half_of_a_tasks_responses_dominates():
    top = dominant_answer(answers("7", "7", "7", "3"))
    assert top == {"answer": "7", "share": 0.75, "responses": 4}


def test_half_or_a_handful_or_a_truth_as_dominated_is_no_dominance():
    assert dominant_answer(answers("7", "7", "3", "4")) is None  # exactly half
    assert dominant_answer(answers("7", "7", "7")) is None  # too few to say
    # a yes/no task whose truth is mostly yes
    assert dominant_answer(answers("yes", "yes", "yes", "no", truths=["yes", "yes", "yes", "no"])) is None
    # task rows carry the reference in their JSON ground truth
    truths = [json.dumps({"answer": t}) for t in ("1", "2", "3", "4")]
    assert dominant_answer(answers("1", "1", "1", "4", truths=truths))["answer"] == "1"
    assert dominant_answer([{"response": "no answer field"}] * 6) is None


# -- truncation, log-prob gap ---------------------------------------------------------------------
def test_truncation_warns_over_a_fifth_cut_at_the_length_cap():
    steps = {1: [{"finish_reason": "length"}] + [{"finish_reason": "stop"}] * 4,  # 20 %: not over
             2: [{"finish_reason": "length"}] * 2 + [{"finish_reason": "stop"}] * 3, 3: [{}]}
    shares = truncated_shares(steps)
    assert shares == {1: 0.2, 2: 0.4}
    [found] = truncation_warning(shares, "training rollouts")
    assert found["steps"] == [2] and "40%" in found["message"]


def test_truncation_falls_back_on_the_metric_without_rollouts():
    rows = [{"step": 1, "response/truncated_frac": 0.5}, {"step": 2, "response/truncated_frac": 0.1}]
    assert [w["kind"] for w in run_warnings(rows, {}, {})] == ["truncated"]


def gap_rows(values):
    return [{"step": i + 1, "rollout/logprob_gap": v} for i, v in enumerate(values)]


def test_a_growing_log_prob_gap_warns():
    assert logprob_gap_warning(gap_rows([0.002, 0.002, 0.003, 0.004, 0.006, 0.007]))[0]["steps"] == [5, 6]
    assert logprob_gap_warning(gap_rows([1e-5, 1e-5, 2e-5, 3e-5, 8e-4, 9e-4])) == []  # under the 1e-3 floor
    assert logprob_gap_warning(gap_rows([0.01, 0.012, 0.011, 0.013, 0.015, 0.014])) == []  # steady
    assert logprob_gap_warning(gap_rows([0.001, 0.01, 0.05])) == []  # too few points
    assert logprob_gap_warning(gap_rows([0.002, None, 0.002, 0.003, 0.004, 0.006, 0.007])) != []


# -- the page's data ------------------------------------------------------------------------------
def test_a_fixture_run_gives_its_curves_timeline_samples_and_warnings(tmp_path):
    data = report_data(make_run(str(tmp_path / "run")))
    titles = [g["title"] for g in data["groups"]]
    assert titles[:3] == ["Reward", "Validation accuracy", "Validation pass@k"] and "Staleness (steps)" in titles
    assert "val/arithmetic/accuracy" in data["groups"][1]["keys"]
    assert [(s["step"], s["phase"]) for s in data["runs"][0]["stalls"]] == [(STALL_STEP, "generate")]
    assert data["runs"][0]["phase_names"][:2] == ["generate", "reward"]
    kinds = [w["kind"] for w in data["warnings"]]
    assert kinds == ["reward_without_correctness"] * 2 + ["dominant_answer", "logprob_gap_growing", "stall"]
    samples = data["samples"]
    assert len(samples["train"]["1"]) == MAX_TRAIN_SAMPLES_PER_STEP and samples["left_out"]["train"]["1"] == 8
    assert len(samples["val"]) == 8 and len(samples["val"]["5"]) == 8
    assert any(s.get("turns") for s in samples["train"]["1"])
    assert data["notes"] == []


def test_a_missing_key_draws_no_chart():
    groups = chart_groups(["reward/mean", "actor/entropy", "val/math/pass@4", "val/pass@1"])
    assert [g["title"] for g in groups] == ["Reward", "Validation pass@k", "Entropy"]
    assert groups[1]["keys"] == ["val/pass@1", "val/math/pass@4"]


def test_the_page_is_self_contained_and_bounded(tmp_path):
    path = write_report(make_run(str(tmp_path / "run")))
    text = open(path, encoding="utf-8").read()
    assert path == str(tmp_path / "run" / "report.html")
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", text), "the page loads nothing"
    assert len(text) < 2_500_000, f"a 40-step page is {len(text)} bytes"
    assert KNOWN_RESPONSE in json.dumps(embedded(path))


def test_a_response_holding_markup_cannot_break_out_of_the_data(tmp_path):
    run = make_run(str(tmp_path / "run"), steps=2, rollouts=False)
    evil = "</script><script>alert(1)</script><!-- & \u2028"
    write_jsonl_gz(os.path.join(run, "rollouts", "step_000001.jsonl.gz"),
                   [{"response": evil, "reward": float("nan")}, {"prompt": None}])
    path = write_report(run)
    text = open(path, encoding="utf-8").read()
    assert "alert(1)" in text and "</script><script>alert" not in text
    first = embedded(path)["samples"]["train"]["1"][0]
    assert first["response"] == evil and first["reward"] is None
    assert "<" not in embed_json({"a": "<b>"})


# -- bad input ------------------------------------------------------------------------------------
def test_a_folder_that_is_not_a_run_is_refused_in_one_line(tmp_path):
    with pytest.raises(NotARunFolder):
        write_report(str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "roll_gspo.report", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"error: {tmp_path} is not a run folder (no metrics.jsonl)\n"


def test_a_run_from_before_rollouts_gets_its_curves_and_a_note(tmp_path):
    data = report_data(make_run(str(tmp_path / "old"), steps=5, rollouts=False))
    assert data["groups"] and data["has_rollouts"] is False and data["samples"]["train"] == {}
    assert any("no rollouts/ folder" in n for n in data["notes"])


def test_unreadable_step_files_and_lines_are_skipped_and_counted(tmp_path):
    run = make_run(str(tmp_path / "run"), steps=6, train_per_step=4)
    rollouts = os.path.join(run, "rollouts")
    open(os.path.join(rollouts, "step_000002.jsonl.gz"), "w").write("not gzip at all")
    whole = gzip.compress(b'{"step": 3, "response": "x"}\n' * 50)
    open(os.path.join(rollouts, "step_000003.jsonl.gz"), "wb").write(whole[:len(whole) // 2])  # cut short
    flipped = bytearray(gzip.compress(b'{"step": 4, "response": "x"}\n' * 50))
    flipped[20:30] = b"\xff" * 10  # bad bytes inside the deflate stream
    open(os.path.join(rollouts, "step_000004.jsonl.gz"), "wb").write(bytes(flipped))
    with gzip.open(os.path.join(rollouts, "val", "step_000005.jsonl.gz"), "wt") as handle:
        handle.write('{"step": 5}\n{torn\n')
    with open(os.path.join(run, "metrics.jsonl"), "a") as handle:
        handle.write('{"step": 7, "reward/me')  # a line torn by a crash
    data = report_data(run)
    assert sorted(data["samples"]["train"]) == ["1", "5", "6"] and data["samples"]["val"] == {}
    [skipped] = [n for n in data["notes"] if "unreadable rollout file" in n]
    assert skipped.startswith("run: 4 unreadable rollout file(s) skipped")
    assert "rollouts/step_000002.jsonl.gz" in skipped and "rollouts/val/step_000005.jsonl.gz" in skipped
    assert any("1 unreadable line(s) of metrics.jsonl" in n for n in data["notes"])


def test_a_repeated_step_keeps_its_last_row(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 1, "reward/mean": 0.9}\n')
    series = report_data(str(run))["runs"][0]["series"]
    assert series == {"steps": [1], "values": {"reward/mean": [0.9]}}


# -- the command ----------------------------------------------------------------------------------
def test_the_command_overlays_two_runs_and_prints_the_path(tmp_path):
    first, second = make_run(str(tmp_path / "a"), steps=5), make_run(str(tmp_path / "b"), steps=4, rollouts=False)
    out = str(tmp_path / "both.html")
    done = subprocess.run([sys.executable, "-m", "roll_gspo.report", first, second, "-o", out], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == out + "\n"
    data = embedded(out)
    assert [r["name"] for r in data["runs"]] == ["a", "b"] and data["title"] == "a vs b"
    assert len(data["runs"][1]["series"]["steps"]) == 4


def test_the_report_imports_neither_torch_nor_ray():
    # A user reads a report on a laptop without the training stack; the pipeline imports it cheaply.
    code = ("import sys, roll_gspo.report, roll_gspo.report.__main__; "
            "print([m for m in ('torch', 'ray', 'vllm') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_rollouts_moved_by_the_config_are_read_from_where_they_are(tmp_path):
    source = make_run(str(tmp_path / "src"), steps=5, train_per_step=4)
    run = make_run(str(tmp_path / "run"), steps=5, rollouts=False)
    data = report_data(run, train_dir=os.path.join(source, "rollouts"), val_dir=os.path.join(source, "rollouts", "val"))
    assert sorted(data["samples"]["train"]) == ["1", "2", "3", "4", "5"] and list(data["samples"]["val"]) == ["5"]
    assert data["has_rollouts"] and data["notes"] == []


def test_a_long_run_embeds_evenly_spaced_steps_and_says_so(tmp_path):
    assert spaced_steps(range(1, 11), 4) == [1, 4, 7, 10]
    assert spaced_steps(range(1, 11), 4, wanted=[5, 99]) == [1, 4, 5, 7, 10]
    assert spaced_steps([3, 1, 2], 5) == [1, 2, 3]
    steps = MAX_STEPS_EMBEDDED + 10
    data = report_data(make_run(str(tmp_path / "long"), steps=steps, train_per_step=2))
    train = sorted(map(int, data["samples"]["train"]))
    assert len(train) == MAX_STEPS_EMBEDDED and train[0] == 1 and train[-1] == steps
    assert any(f"samples of {MAX_STEPS_EMBEDDED} evenly spaced training steps of {steps}" in n for n in data["notes"])


def test_a_numeric_verdict_of_older_files_reads_as_a_bool(tmp_path):
    from roll_gspo.metrics.rollouts import write_step
    from roll_gspo.report.files import read_rollouts

    write_step(str(tmp_path / "rollouts"), 1, [{"step": 1, "correct": 0.0, "reward": 0.5}, {"step": 1, "correct": 1.0}])
    records = read_rollouts(str(tmp_path)).train[1]
    assert [r["correct"] for r in records] == [False, True]
    assert run_warnings([], {1: records}, {})  # the wrong answer paid 0.5 is flagged
