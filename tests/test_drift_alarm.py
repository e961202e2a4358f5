"""The train-inference drift alarm: the trainer-vs-engine log-prob gap grouped per task, turn and
staleness lag (roll_gspo.metrics.drift), the thresholds a run takes from its precision
(roll_gspo.config.plan.drift_alarm) and their checks, the loop's glue (pipelines.drift_watch), and
one real run whose engine samples with keys the trainer does not follow: the alarm's line, its
metrics, and a stop after the step's checkpoint. That it stays silent on the seeded examples is
asserted in their own runs (tests/test_pipeline_e2e.py, tests/test_bf16_rollout.py)."""
import json
import logging
import math
import os

import pytest
import torch

from roll_gspo.metrics.drift import (DriftAlarm, DriftGroup, DriftThresholds, GroupGap, announce, gap_matrix,
                                     group_gaps, likely_causes)

FP32 = DriftThresholds(warn=1e-3, stop=5e-2, basis="fp32 on both sides; auto", exact_precision=True)
BF16 = DriftThresholds(warn=0.1, stop=0.5, basis="bf16 on both sides; auto", exact_precision=False)


def gaps_of(**groups):
    """{DriftGroup: GroupGap} from keywords: all=(gap, tokens), task_arith=..., turn_1=..., arith_1=..."""
    out = {}
    for name, (gap, tokens) in groups.items():
        if name == "all":
            group = DriftGroup()
        elif name.startswith("task_"):
            group = DriftGroup(task=name[5:])
        elif name.startswith("turn_"):
            group = DriftGroup(turn=int(name[5:]))
        else:
            task, turn = name.rsplit("_", 1)
            group = DriftGroup(task=task, turn=int(turn))
        out[group] = GroupGap(gap, tokens)
    return out


# -- grouping -------------------------------------------------------------------------------------
def test_group_gaps_by_task_turn_and_lag_judging_only_the_current_weights_tokens():
    # 3 responses of 4 positions: rows 0-1 task a, row 2 task b; row 1's last two tokens are turn 1;
    # row 2 was sampled one version before the trainer's weights (lag 1).
    gap = torch.tensor([[0.1, 0.1, 0.1, 9.0], [0.2, 0.2, 0.6, 0.6], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    turns = torch.tensor([[0, 0, 0, -1], [0, 0, 1, 1], [0, 0, -1, -1]])
    lags = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    groups = group_gaps(gap, mask, ["a", "a", "b"], turns, lags)
    assert groups[DriftGroup()] == GroupGap(pytest.approx((0.3 + 0.2 + 0.2 + 0.6 + 0.6) / 7), 7)  # no 9.0, no row 2
    assert groups[DriftGroup(task="a")].tokens == 7 and DriftGroup(task="b") not in groups  # b: lag 1 only
    assert groups[DriftGroup(turn=1)] == GroupGap(pytest.approx(0.6), 2)
    assert groups[DriftGroup(task="a", turn=0)] == GroupGap(pytest.approx(0.7 / 5), 5)
    assert groups[DriftGroup(lag=1)] == GroupGap(pytest.approx(1.0), 2)
    assert groups[DriftGroup(lag=0)].tokens == 7
    assert all(g.judged for g in groups if g.lag is None) and not DriftGroup(lag=1).judged


def test_group_gaps_without_turns_or_lags_has_no_lag_groups_and_skips_unnamed_tasks():
    gap = torch.tensor([[0.5, float("nan")], [0.1, 0.1]])
    groups = group_gaps(gap, torch.ones(2, 2), [None, "x"])
    assert set(groups) == {DriftGroup(), DriftGroup(task="x")}
    assert groups[DriftGroup()] == GroupGap(pytest.approx(0.7 / 3), 3)  # a NaN gap is no token


def test_gap_matrix_places_each_ranks_rows_and_marks_them_measured():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    gap, measured = gap_matrix({2: torch.tensor([0.5]), 0: torch.tensor([0.1, 0.2])}, mask)
    assert gap.tolist() == [[pytest.approx(0.1), pytest.approx(0.2), 0.0], [0.0] * 3, [0.5, 0.0, 0.0]]
    assert measured.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]  # row 1: not in the first mini-batch


def test_group_metric_keys():
    assert DriftGroup().metric_key() == "drift/gap"
    assert DriftGroup(task="math/gsm8k v2").metric_key() == "drift/gap/task/math_gsm8k_v2"
    assert DriftGroup(turn=3).metric_key() == "drift/gap/turn3"
    assert DriftGroup(lag=2).metric_key() == "drift/gap/lag2"
    assert DriftGroup(task="a", turn=1).metric_key() is None  # tasks x turns: judged, not logged
    assert DriftGroup(task="arith", turn=2).where() == "task arith, turn 2" and DriftGroup().where() == "every task"


# -- thresholds, verdicts, the line -----------------------------------------------------------------
def test_levels_follow_the_thresholds_and_small_groups_are_not_judged():
    alarm = DriftAlarm(FP32)
    assert alarm.observe(1, gaps_of(all=(4e-7, 100))).level == "ok"
    assert alarm.observe(2, gaps_of(all=(2e-3, 100))).level == "warn"
    assert alarm.observe(3, gaps_of(all=(0.2, 100))).level == "stop"
    assert alarm.observe(4, gaps_of(all=(0.2, 15))) is None  # under MIN_TOKENS: noise
    assert alarm.observe(5, {DriftGroup(lag=1): GroupGap(0.9, 100)}) is None  # learning, not drift
    assert DriftAlarm(BF16).observe(1, gaps_of(all=(0.047, 100))).level == "ok"  # SmolLM2-135M in bf16
    with pytest.raises(ValueError, match="warn <= stop"):
        DriftAlarm(DriftThresholds(0.5, 0.1, "x", True))


def test_the_line_names_step_task_turn_where_it_started_and_the_causes():
    alarm = DriftAlarm(BF16)
    first = alarm.observe(4, gaps_of(all=(0.05, 400), task_arith=(0.05, 200), task_gcd=(0.15, 200)))
    assert first.level == "warn" and first.group == DriftGroup(task="gcd") and first.started == (4, first.group)
    later = alarm.observe(6, gaps_of(all=(0.3, 400), turn_0=(0.05, 200), turn_2=(0.6, 200),
                                     arith_0=(0.05, 100), arith_2=(0.6, 100)))
    line = later.line()
    assert later.level == "stop" and later.group == DriftGroup(task="arith", turn=2)
    assert line.startswith("drift alarm (stop): step 6, task arith, turn 2: trainer-vs-engine log-prob gap 0.6 ")
    assert "> stop_gap 0.5 (bf16 on both sides; auto); it started at step 4 (task gcd)" in line
    assert "Likely causes: a stale prefix cache" in line and "The run stops after this step's checkpoint" in line
    assert later.causes[:2] == ("prefix_cache", "precision")  # a later turn drifting more than the first
    assert "\n" not in line
    assert alarm.observe(7, gaps_of(all=(0.01, 400))).level == "ok" and alarm.started is None
    assert alarm.observe(8, gaps_of(all=(0.2, 400))).started == (8, DriftGroup())  # a new breach, a new start
    assert alarm.breaches == 3


def test_likely_causes_in_fp32_put_the_engine_first():
    causes = likely_causes(DriftGroup(), gaps_of(all=(0.2, 100)), exact_precision=True)
    assert causes[0] == "sampling" and "precision" not in causes


def test_lines_only_when_a_breach_starts_or_rises_and_metrics_every_step():
    alarm = DriftAlarm(FP32)
    verdicts = [alarm.observe(s, gaps_of(all=(g, 100), task_a=(g, 100))) for s, g in
                enumerate([1e-6, 2e-3, 3e-3, 0.1, 0.2, 1e-6, 2e-3], start=1)]
    said = [announce(v, p) for v, p in zip(verdicts, [None] + verdicts[:-1])]
    assert said == [False, True, False, True, False, False, True]
    metrics = alarm.metrics(gaps_of(all=(2e-3, 100), task_a=(2e-3, 100), turn_1=(1e-3, 50)), verdicts[-1])
    assert metrics == {"drift/gap": 2e-3, "drift/gap/task/a": 2e-3, "drift/gap/turn1": 1e-3, "drift/level": 1.0,
                       "drift/breaches": 5.0}


# -- the run's thresholds and their checks --------------------------------------------------------------
EXAMPLE = "examples/example_gspo.yaml"


def plan_of(*overrides):
    from roll_gspo.config import load_config
    from roll_gspo.config.plan.drift_alarm import drift_thresholds

    return drift_thresholds(load_config(EXAMPLE, list(overrides)))


def test_thresholds_follow_the_precision_and_the_keys():
    assert (plan_of().warn, plan_of().stop, plan_of().exact_precision) == (1e-3, 5e-2, True)
    bf16 = plan_of("actor_train.model_args.dtype=bf16", "actor_infer.model_args.dtype=bf16",
                   "actor_infer.strategy_args.strategy_config.dtype=bfloat16")
    assert (bf16.warn, bf16.stop, bf16.exact_precision) == (0.1, 0.5, False) and "bf16 on both sides" in bf16.basis
    mixed = plan_of("actor_infer.model_args.dtype=bf16", "actor_infer.strategy_args.strategy_config.dtype=bfloat16")
    assert mixed.warn == 0.1 and "actor_train fp32, actor_infer bf16" in mixed.basis
    cut = plan_of("actor_infer.generating_args.top_p=0.5", "actor_infer.generating_args.temperature=0.7")
    assert cut.warn == 1e-3 and math.isinf(cut.stop) and "warn only" in cut.basis
    assert plan_of("actor_infer.generating_args.top_p=0.5", "actor_infer.generating_args.temperature=0.7",
                   "drift_alarm.stop_gap=0.05").stop == 0.05
    assert (plan_of("drift_alarm.warn_gap=0.01", "drift_alarm.stop_gap=inf").warn, ) == (0.01, )
    assert plan_of("drift_alarm.enabled=false") is None


@pytest.mark.parametrize("overrides,key", [(["drift_alarm.warn_gap=0"], "drift_alarm.warn_gap"),
                                           (["drift_alarm.stop_gap=-1"], "drift_alarm.stop_gap"),
                                           (["drift_alarm.warn_gap=.inf"], "drift_alarm.warn_gap"),
                                           (["drift_alarm.warn_gap=0.2"], "drift_alarm.warn_gap")])
def test_refused_thresholds_name_their_key(overrides, key):
    from roll_gspo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(EXAMPLE, overrides)


def test_the_plan_prints_the_alarm_and_a_warn_only_run_is_told(caplog):
    from roll_gspo.config import build_run_plan, load_config

    assert any("drift alarm: warn above a log-prob gap of 0.001, stop above 0.05 (fp32 on both sides; auto)" in line
               for line in build_run_plan(load_config(EXAMPLE)).lines())
    with caplog.at_level(logging.WARNING):
        load_config(EXAMPLE, ["actor_infer.generating_args.top_p=0.5", "actor_infer.generating_args.temperature=0.7"])
    assert any("the drift alarm warns only" in r.getMessage() for r in caplog.records)


# -- the loop's glue ---------------------------------------------------------------------------------
def drift_batch(lags=None):
    from roll_gspo.distributed.batch import Batch

    batch = Batch({"response_mask": torch.ones(4, 16)}, meta={"domain": ["arith", "arith", "gcd", "gcd"]})
    batch["weight_version"] = [2, 2, 2, 1] if lags is None else lags
    return batch


def test_the_watch_judges_the_current_weights_rows_logs_one_line_and_stops_after_the_checkpoint(tmp_path, caplog):
    from pipelines.drift_watch import DriftStop, DriftWatch

    from roll_gspo.lifecycle.checkpoint import COMPLETE_MARKER

    (tmp_path / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_3" / COMPLETE_MARKER).write_text("")
    watch = DriftWatch(FP32, str(tmp_path))
    rows = {0: torch.full((16,), 1e-6), 1: torch.full((16,), 1e-6), 2: torch.full((16,), 0.2), 3: torch.full((16,), 5.0)}
    with caplog.at_level(logging.WARNING, logger="roll_gspo"):
        metrics = watch.observe(3, drift_batch(), rows)  # trainer version 2: row 3 (version 1) is lag 1
    assert metrics["drift/level"] == 2.0 and metrics["drift/gap/task/gcd"] == pytest.approx(0.2)
    assert metrics["drift/gap/lag1"] == pytest.approx(5.0) and metrics["drift/gap/lag0"] == pytest.approx(0.2 / 3, rel=1e-4)
    lines = [r.getMessage() for r in caplog.records if "drift alarm" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("drift alarm (stop): step 3, task gcd:")
    watch.stop_if_breached(2, lambda: None)  # another step: nothing
    reported = []
    with pytest.raises(DriftStop, match="stopped the run at step 3: task gcd had a trainer-vs-engine log-prob gap "
                                        "of 0.2 per token, above stop_gap 0.05") as stopped:
        watch.stop_if_breached(3, lambda: reported.append(True))
    assert f"last complete checkpoint is {tmp_path / 'checkpoints' / 'step_3'} (resume with " in str(stopped.value)
    assert reported == [True]
    assert DriftWatch(None, str(tmp_path)).observe(3, drift_batch(), rows) == {}


def test_the_run_report_warns_of_the_breaches():
    from roll_gspo.report.checks import drift_warning

    assert drift_warning([{"step": 1, "drift/gap": 1e-6, "drift/level": 0.0}, {"step": 2}]) == []
    rows = [{"step": 1, "drift/gap": 1e-6, "drift/level": 0.0}, {"step": 2, "drift/gap": 2e-3, "drift/level": 1.0},
            {"step": 3, "drift/gap": 0.2, "drift/level": 2.0}]
    (found,) = drift_warning(rows)
    assert found["kind"] == "drift" and found["steps"] == [2, 3]
    assert "2 step(s) above the warn gap, the first at step 2; the largest gap over every task 0.2 at step 3; a step " \
           "crossed the stop gap" in found["message"]


def test_a_drift_stop_is_one_line_and_exit_1():
    from pipelines.drift_watch import DriftStop
    from roll_gspo.cli import _report_failure

    assert _report_failure(DriftStop("the drift alarm stopped the run at step 1: ...")) == 1


# -- a real run whose engine samples with keys the trainer does not follow ------------------------------
@pytest.mark.e2e
def test_an_engine_sampling_a_cut_distribution_raises_the_alarm_and_stops_the_run(tmp_path, tiny_model, ray_session,
                                                                                  caplog):
    """top_p 0.5 at temperature 0.7: vLLM reports log-probs renormalised over the kept tokens, the
    trainer scores the whole distribution (a user's everyday sampling keys). With a stop gap set the
    run stops after step 1's checkpoint; no final model."""
    from pipelines.drift_watch import DriftStop
    from tests.test_pipeline_e2e import run, write_config

    cfg = write_config(tmp_path, tiny_model, max_steps=2, save_steps=1, track_with="none",
                       actor_train={"world_size": 1, "training_args": {"per_device_train_batch_size": 16}},
                       actor_infer={"generating_args": {"top_p": 0.5, "temperature": 0.7}},
                       drift_alarm={"stop_gap": 0.05})
    with caplog.at_level(logging.WARNING, logger="roll_gspo"), pytest.raises(DriftStop, match="at step 1"):
        run(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drift alarm")]
    assert len(lines) == 1 and lines[0].startswith("drift alarm (stop): step 1, task math_rule"), lines
    assert "Likely causes: sampling keys the trainer does not follow" in lines[0]
    with open(os.path.join(cfg.output_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    assert [r["step"] for r in rows] == [1] and rows[0]["drift/level"] == 2.0
    assert rows[0]["drift/gap"] > 0.05 and rows[0]["drift/gap"] == pytest.approx(rows[0]["rollout/logprob_gap"])
    assert os.listdir(os.path.join(cfg.output_dir, "checkpoints")) == ["step_1"]
    assert not os.path.exists(os.path.join(cfg.output_dir, "final_model"))
