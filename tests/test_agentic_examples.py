"""The built-in agentic examples (examples/example_agentic.yaml, examples/example_agentic_tool.yaml) and
their warm starts (pipelines/agentic_warm_start.py): the examples pass --dry-run and play the env their
model was warm-started on; the warm start's SFT rows are the exact ids RL sees and valid moves; the
benchmark's arithmetic. The learning example's training run is in tests/test_agentic_e2e.py (it is
also the uninterrupted run a resumed one must match)."""
import importlib.util
import json
from pathlib import Path

import pytest

from roll_gspo.config import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"example_agentic.yaml": "builtin:tiny-frozenlake", "example_agentic_tool.yaml": "builtin:tiny-calculator"}


@pytest.fixture(scope="module")
def tok():
    from roll_gspo.builtin.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_passes_dry_run(example, capsys):
    from roll_gspo.cli import main

    assert main(["--config", example, "--dry-run"]) == 0
    assert "agentic pipeline" in capsys.readouterr().out


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_plays_the_env_its_model_was_warm_started_on(example):
    from pipelines.agentic_warm_start import WARM_STARTS

    cfg = load_config(example)
    start = WARM_STARTS[EXAMPLES[example]]
    assert cfg.pretrain == start.name
    assert cfg.train_env_manager.tags == cfg.val_env_manager.tags == [start.tag]
    assert cfg.custom_envs[start.tag] == start.env_config()  # same templates, env_config, caps, tools
    assert cfg.sequence_length == start.sequence_length
    assert cfg.train_env_manager.group_size >= 4 and cfg.importance_sampling == "seq"


def board_desc(prompt: str, size: int):
    """The map letters (S/F/H/G) of the last board in a prompt (the player's cell as the start); its
    first row follows the previous move's <eos> on the same line."""
    rows = [line[-size:] for line in prompt.rstrip("\n").split("\n")[-size:]]
    return ["".join({"P": "S", "_": "F", "O": "H", "G": "G"}[c] for c in row) for row in rows]


def test_frozen_lake_rows_are_the_exact_ids_rl_sees_and_valid_moves(tok, tmp_path):
    from pipelines.agentic_warm_start import HABIT_TURNS, WARM_STARTS, play, scripted_generate, sft_rows
    from roll_gspo.agentic.trajectory import turn_samples
    from roll_gspo.data.prompts import load_sft_samples
    from roll_gspo.envs.frozen_lake import FrozenLakeEnv

    start = WARM_STARTS["builtin:tiny-frozenlake"]
    rows = sft_rows(start, tok, episodes=40, seed=5)
    # The same episodes through the episode loop: each row, as the SFT pipeline tokenises it, is the
    # context the turn was played from followed by the turn's ids (the move and <eos>).
    trajectories = play(start, tok, scripted_generate(start, tok, 5), 40, 5, for_play=True)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = load_sft_samples([str(path)], tokenizer=tok, max_length=start.sequence_length)
    turns = turn_samples(trajectories)
    assert len(samples) == len(rows) == len(turns) > 40
    for sample, turn in zip(samples, turns):
        t = turn.trajectory
        assert sample["input_ids"] == t.prompt_ids + t.response_ids[:turn.end]
        assert sum(sample["loss_mask"]) == turn.end - turn.start == 2  # the move and <eos>
    size = start.env["env_config"]["size"]
    habits = 0
    for row in rows:
        assert row["response"] in ("L", "D", "R", "U")
        env = FrozenLakeEnv(desc=board_desc(row["prompt"], size), is_slippery=False)
        env.reset(seed=0)
        best = env.shortest_path()[0]
        assert row["response"] in (best[0], HABIT_TURNS.get(best, best)[0]), (row, best)
        habits += row["response"] != best[0]
    assert 0 < habits < len(rows)  # the habit shows, and so do right moves


def test_calculator_rows_call_the_tool_or_answer_right(tok):
    from pipelines.agentic_warm_start import WARM_STARTS, sft_rows
    from roll_gspo.envs.math_python import answers_match, last_boxed
    from roll_gspo.envs.tools import FunctionTool, calculator, evaluate_arithmetic

    start = WARM_STARTS["builtin:tiny-calculator"]
    rows = sft_rows(start, tok, episodes=30, seed=2)
    tool = FunctionTool(calculator, isolation="thread")
    calls = answers = 0
    for row in rows:
        question = row["prompt"].split("\n")[0]
        assert question.startswith("What is ") and question.endswith("?")
        want = evaluate_arithmetic(question[len("What is "):-1])
        if row["response"].startswith("<tool_call>"):
            call = tool.execute_action(row["response"])
            assert call.parsed and not call.error and answers_match(call.observation, want)
            calls += 1
        else:
            assert answers_match(last_boxed(row["response"]), want)
            answers += 1
    assert calls and answers


def test_benchmark_reads_the_rise_and_when_the_target_was_reached():
    spec = importlib.util.spec_from_file_location("bench_agentic", REPO / "benchmarks" / "bench_agentic.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    records = [{"step": 0, "val/success_rate": 0.3}, {"step": 1, "traj/reward_mean": 0.5},
               {"step": 5, "val/success_rate": 0.45}, {"step": 10, "val/success_rate": 0.55},
               {"step": 15, "val/success_rate": 0.7}]
    curve = bench.validation_curve(records, {0: 1.0, 1: 1.2, 5: 2.0, 10: 3.0, 15: 20.0})
    assert [p["step"] for p in curve] == [0, 5, 10, 15]
    figures = bench.rise(curve, budget_minutes=15)  # step 15 came after the budget
    assert figures["start"] == 0.3 and figures["best"] == 0.55 and figures["best_step"] == 10
    assert figures["gain"] == pytest.approx(0.25) and figures["target_reached_minutes"] == 3.0
    assert bench.rise(curve[:2], budget_minutes=15)["target_reached_minutes"] is None
    with pytest.raises(ValueError, match="fewer than two validations"):
        bench.rise(curve[:1], budget_minutes=15)
