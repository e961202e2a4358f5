"""Stalls flagged while running (roll_gspo.metrics.stalls): a phase far above its
own median, throughput collapsing, the trainer idle against its usual share; the same rule over a
finished run's metrics (the report's marks)."""
from roll_gspo.metrics.stalls import StallWatch, find_stalls


def step_row(step, generate=2.0, train=1.0, tokens_per_s=500.0, reward=0.2):
    return {"step": step, "time/generate_s": generate, "time/train_s": train, "time/reward_s": reward,
            "time/step_s": generate + train + reward, "throughput/tokens_per_s": tokens_per_s}


def test_a_phase_far_above_its_median_is_one_line_naming_phase_and_role():
    watch = StallWatch()
    for step in range(1, 6):
        assert watch.observe(step, step_row(step)) == []
    (stall,) = watch.observe(6, step_row(6, generate=9.0, tokens_per_s=400))
    assert stall.line() == "stall: step 6 generate (actor_infer) took 9.0 s, 4.5x its median 2.0 s"
    assert watch.metrics([stall]) == {"stall/count": 1.0, "stall/total": 1.0, "stall/generate": 1.0}


def test_short_phases_and_the_first_steps_are_not_stalls():
    watch = StallWatch()
    assert watch.observe(1, step_row(1, reward=0.1)) == []
    assert watch.observe(2, step_row(2, generate=20.0)) == []  # no median yet
    rows = [step_row(s, reward=0.1) for s in range(1, 6)] + [step_row(6, reward=0.5)]  # 5x, but 0.4 s
    assert find_stalls(rows) == []


def test_throughput_collapse_and_an_idle_trainer():
    rows = [step_row(s) for s in range(1, 5)] + [step_row(5, tokens_per_s=100.0)]
    assert [s.kind for s in find_stalls(rows)] == ["throughput"]
    rows = [step_row(s, generate=2.0, train=2.0) for s in range(1, 5)] + [step_row(5, generate=3.5, train=0.2)]
    (idle,) = [s for s in find_stalls(rows) if s.kind == "idle"]
    assert "the trainer (actor_train) worked" in idle.line()


def test_a_run_where_generation_always_dominates_is_not_flagged():
    rows = [step_row(s, generate=20.0, train=1.0) for s in range(1, 10)]
    assert find_stalls(rows) == []
