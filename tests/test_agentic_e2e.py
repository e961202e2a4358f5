"""The agentic pipeline for real (Ray, vLLM, DeepSpeed): ROLL's own FrozenLake and Sokoban examples
(tests/data/roll/agentic/, only models, outputs, strategy names, GPU keys and size keys changed)
pass --dry-run and train on CPU; an fp32 run's multi-turn log-prob gap is float noise; a resumed
run replays the uninterrupted one's step exactly; bad agentic input is refused at load."""
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from roll_gspo.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
ROLL_DIR = REPO / "tests" / "data" / "roll"
ROLL_AGENTIC = sorted((ROLL_DIR / "agentic").glob("*.yaml"))

SMALL = {
    "pipeline": "agentic", "exp_name": "agentic_test", "seed": 3, "track_with": "none", "max_steps": 2,
    "pretrain": "builtin:tiny-arith-base", "sequence_length": 160, "rollout_batch_size": 8, "val_batch_size": 4,
    "eval_steps": 2, "adv_estimator": "grpo", "importance_sampling": "seq", "pg_clip_low": 0.2, "pg_clip_high": 0.2,
    "actor_train": {"training_args": {"learning_rate": 1e-3, "per_device_train_batch_size": 4},
                    "strategy_args": {"strategy_name": "deepspeed_train",
                                      "strategy_config": {"zero_optimization": {"stage": 0}}}},
    "actor_infer": {"generating_args": {"temperature": 1.0}, "strategy_args": {"strategy_name": "vllm"}},
    "custom_envs": {"Lake": {"env_type": "frozen_lake", "max_steps": 4, "max_tokens_per_step": 3,
                             "agent_system_template": "", "agent_template": "{observation}\n",
                             "env_config": {"size": 3, "p": 0.8, "is_slippery": False, "action_pattern": "^(.*)$",
                                            "env_instruction": ""}}},
    "train_env_manager": {"tags": ["Lake"], "num_env_groups": 2, "group_size": 4},
    "val_env_manager": {"tags": ["Lake"], "num_env_groups": 4, "group_size": 1},
}


def small_config(tmp_path, **changes):
    os.makedirs(tmp_path, exist_ok=True)
    cfg = OmegaConf.merge(OmegaConf.create(SMALL), OmegaConf.create(changes))
    cfg.output_dir = str(tmp_path / "out")
    path = tmp_path / "agentic.yaml"
    OmegaConf.save(cfg, path)
    return load_config(str(path))


def records(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def run(cfg):
    from pipelines.agentic_pipeline import run_agentic

    run_agentic(cfg)
    return records(cfg.output_dir)


@pytest.fixture
def in_roll_dir(monkeypatch):
    monkeypatch.chdir(ROLL_DIR)  # ROLL runs from its repository root; `defaults:` paths are relative


@pytest.mark.parametrize("recipe", ROLL_AGENTIC, ids=[r.stem for r in ROLL_AGENTIC])
def test_roll_agentic_recipe_dry_run(recipe, in_roll_dir, capsys):
    from roll_gspo.cli import main

    assert main(["--config", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "agentic pipeline" in out and "episodes (train): 8 = 2 groups x group_size 4" in out


@pytest.mark.e2e
def test_roll_agentic_recipe_trains(tmp_path, in_roll_dir, session_cache, ray_session):
    """ROLL's Sokoban example trains a step; its validation (before and after) plays all four of ROLL's
    env entries (SimpleSokoban, LargerSokoban, SokobanDifferentGridVocab, FrozenLake), so the FrozenLake
    example's envs run too (its training is the same loop; the small runs below train FrozenLake for
    more steps)."""
    recipe, steps = "agentic_val_sokoban", 1
    out = tmp_path / "out"
    cfg = load_config(str(ROLL_DIR / "agentic" / f"{recipe}.yaml"),
                      [f"max_steps={steps}", f"output_dir={out}", f"checkpoint_config.output_dir={out}",
                       f"logging_dir={out}/tb", "track_with=none"])
    rows = run(cfg)
    trained = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    for row in trained:
        assert row["traj/agent_tokens_mean"] > 0 and row["traj/num_turns_mean"] >= 1
        assert row["traj/agent_tokens_mean"] < row["traj/length_mean"]  # observations are not in the loss
        assert math.isfinite(row["rollout/logprob_gap"])
    assert "val/success_rate" in rows[-1]
    for tag in ("SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake"):
        assert rows[-1][f"val/{tag}/num_turns_mean"] >= 1, tag
    assert os.path.isdir(out / "final_model")


def example_config(out, *overrides):
    """examples/example_agentic.yaml at test size, on the tests' shared base model (the example's
    warm start is an SFT run: minutes; `benchmarks/bench_agentic.py` runs it). That model's moves are
    almost never valid, so every episode of a group scores the same and the example's z-scores
    within a group are all 0: raw rewards instead (ROLL's default normalization; the group z-scores
    train in ROLL's Sokoban recipe above), with a cost of 0.1 per invalid move, so updates are not 0."""
    return load_config(str(REPO / "examples" / "example_agentic.yaml"), [
        f"output_dir={out}", "track_with=none", "pretrain=builtin:tiny-arith-base", "max_steps=2",
        "reward_normalization.grouping=batch", "reward_normalization.method=identity",
        "rollout_batch_size=8", "train_env_manager.num_env_groups=2", "val_batch_size=4",
        "val_env_manager.num_env_groups=4", "actor_train.training_args.per_device_train_batch_size=4",
        "custom_envs.FrozenLake.env_config.format_penalty=-0.1", *overrides])


@pytest.mark.e2e
@pytest.mark.chaos
def test_example_trains_fp32_gap_exact_resume_and_a_replaced_rollout_rank(tmp_path, session_cache, ray_session,
                                                                          caplog):
    """The learning example (examples/example_agentic.yaml, smaller) trains: multi-turn episodes, the
    moves alone in the loss, the trainer's log-probs equal to vLLM's (fp32), validation's success rate
    and rendered episodes. A run resumed from its step-1 checkpoint loses its vLLM rank to kill -9 at
    its first turn of step 2: the rank is replaced in its bundle with the step-1 weights, the turns it
    held are sent again with their seeds (the episodes' envs and contexts live in the driver), and
    step 2 and the final weights are the uninterrupted run's (one resumed run checks both the resume
    and the replaced rank; the example's own run is the uninterrupted one: one pipeline start fewer)."""
    from tests.test_resume_chaos import comparable, kill_the_rollout_rank_once, load_weights

    whole = example_config(tmp_path / "whole" / "out", "eval_steps=2", "save_steps=1",
                           f"render_save_dir={tmp_path / 'render'}")
    full = run(whole)
    steps = {r["step"]: r for r in full if "actor/pg_loss" in r}
    assert set(steps) == {1, 2}
    for row in steps.values():
        assert row["rollout/logprob_gap"] <= 1e-4
        assert row["drift/breaches"] == 0 and row["drift/gap/turn1"] <= 1e-4  # the drift alarm: silent, per turn
        assert row["traj/num_turns_mean"] > 1 and row["actor/grad_norm"] > 0
        assert 0 < row["traj/agent_tokens_mean"] < row["traj/length_mean"]  # boards are not in the loss
        assert math.isfinite(row["actor/pg_loss"])
    validations = [r for r in full if "val/success_rate" in r]
    assert [r["step"] for r in validations] == [0, 2]
    assert all(0 <= r["val/success_rate"] <= 1 and "val/env/invalid_action_frac" in r for r in validations)
    assert (tmp_path / "render" / "val_step_2.jsonl").exists()
    first = json.loads((tmp_path / "render" / "val_step_0.jsonl").read_text().splitlines()[0])
    assert first["messages"][0]["role"] == "user" and first["turns"] >= 1
    from roll_gspo.metrics.rollouts import read_step, step_files  # the rollout files: episodes turn by turn

    trained = read_step(step_files(whole.rollout_dump_dir)[-1][1])
    episode = max(trained, key=lambda r: len(r["turns"]))
    assert len(episode["turns"]) > 1 and episode["prompt"] and episode["task"]
    assert all(t["action"] and t["reward"] is not None for t in episode["turns"])
    assert episode["turns"][0]["observation"]  # the board the env answered with
    assert [s for s, _ in step_files(whole.validation_data_dir)] == [0, 2]

    resumed_dir = tmp_path / "resumed"
    import shutil

    shutil.copytree(os.path.join(whole.output_dir, "checkpoints", "step_1"),
                    resumed_dir / "out" / "checkpoints" / "step_1")
    resumed = example_config(resumed_dir / "out", "resume_from_checkpoint=auto", "eval_steps=0")
    killed: list = []
    watcher = kill_the_rollout_rank_once(None, killed, method="serve_generate")  # at its first turn
    again = {r["step"]: r for r in run(resumed) if "actor/pg_loss" in r}
    watcher.join(timeout=5)
    assert killed, "the rollout rank ran no turn"
    assert set(again) == {2}
    assert again[2]["fault/restarts/actor_infer"] == 1
    assert re.search(rf"role actor_infer rank 0 \(node [\d.]+, pid {killed[0]}\) died: .*; replaced in its "
                     rf"placement bundle \(restart 1 of 3 for this rank, [\d.]+ s\); weights of step 1",
                     caplog.text), caplog.text[-3000:]
    trained = {k: v for k, v in comparable(steps[2]).items()
               if not k.startswith(("val/", "rollouts/val_"))}  # no validation resumed
    assert comparable(again[2]) == trained
    final, want = (load_weights(os.path.join(c.output_dir, "final_model")) for c in (resumed, whole))
    assert final.keys() == want.keys() and all(torch.equal(final[k], want[k]) for k in want)


# async_generation_ratio: 2 (agentic runs asynchronous): episodes in flight across steps. Two tags whose episodes
# last at most 2 and 5 turns (the random model's moves are mostly invalid, so most run to the cap): of
# the pool's 4 groups a step takes the first 2 to complete, the others stop between two turns and are
# held with their envs, continued under the next weights; at step 3 the groups started under version 0
# are at their last chance and finish under version 1 (staleness 2). An invalid
# move costs 0.1, so the advantages are not 0 and every step changes the weights.
LAKE = {**SMALL["custom_envs"]["Lake"], "max_steps": 2,
        "env_config": {**SMALL["custom_envs"]["Lake"]["env_config"], "format_penalty": -0.1}}
ASYNC_EPISODES = dict(async_generation_ratio=2, max_steps=4, save_steps=2, save_total_limit=2, eval_steps=0,
                      custom_envs={"Short": LAKE, "Long": {**LAKE, "max_steps": 5}},
                      train_env_manager={"tags": ["Short", "Long"], "num_env_groups": 2, "group_size": 4})


@pytest.mark.e2e
def test_async_agentic_staleness_two_and_exact_resume(tmp_path, session_cache, ray_session):
    """The RLVR k = 2 checks (tests/test_async_rollout.py) on the agentic pipeline: staleness up to 2 and
    never beyond, per trajectory from its oldest turn; the trainer's fp32 log-probs equal the rollout's
    on the turns its own version sampled (each turn is sampled by one version: the per-version check
    with a weight update mid-episode is tests/test_request_pool.py's); resumed from step 2's checkpoint
    (held episodes' envs replayed), steps 3 and 4 replay every metric."""
    from tests.test_resume_chaos import comparable

    cfg = small_config(tmp_path / "whole", **ASYNC_EPISODES)
    records = [r for r in run(cfg) if "actor/pg_loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert record["rollout/staleness_max"] <= 2 and record["sync/seconds"] > 0
        hist = [record[f"rollout/staleness_hist/{j}"] for j in range(3)]
        assert sum(hist) == 8 and "rollout/staleness_hist/3" not in record  # 2 groups x 4 episodes
    # Step 1 is synchronous (version 0, trainer 0); step 2 was played by version 0 while step 1 trained;
    # from step 3 on, episodes continued across a sync carry turns two versions old.
    assert records[0]["rollout/staleness_max"] == 0 and records[1]["rollout/staleness_max"] == 1
    assert max(r["rollout/staleness_max"] for r in records[2:]) == 2
    assert sum(r["rollout/continuations"] for r in records) > 0 and records[-1]["rollout/dropped_past_bound_total"] == 0
    assert records[0]["rollout/logprob_gap/lag0"] <= 1e-4  # the trainer's own version: fp32 noise
    assert max(r["rollout/logprob_gap/lag2"] for r in records[2:]) > 1e-4  # two versions back: the policy moved
    # The drift alarm judges the current version's tokens only: the moved policy at lag 2 is no breach.
    assert max(r.get("drift/gap/lag2", 0.0) for r in records[2:]) > 1e-4 and all(r["drift/breaches"] == 0 for r in records)
    # Per env tag over lag-0 tokens only (the Long episodes, continued across syncs, may have none).
    per_tag = {k: v for r in records for k, v in r.items() if k.startswith("drift/gap/task/")}
    assert "drift/gap/task/Short" in per_tag and max(per_tag.values()) <= 1e-4
    checkpoints = os.path.join(cfg.output_dir, "checkpoints")
    assert os.path.exists(os.path.join(checkpoints, "step_2", "rollout_pool.pt"))

    resumed = small_config(tmp_path / "resumed", **ASYNC_EPISODES,
                           resume_from_checkpoint=os.path.join(checkpoints, "step_2"))
    again = [r for r in run(resumed) if "actor/pg_loss" in r]
    assert [r["step"] for r in again] == [3, 4]
    for got, want in zip(again, records[2:]):
        assert comparable(got) == comparable(want), got["step"]


@pytest.mark.parametrize("change,message", [
    ({"custom_envs": {"Lake": {"env_type": "no_such_env"}}}, "env_type 'no_such_env' is unknown; valid: frozen_lake"),
    ({"custom_envs": {"Lake": {"env_config": {"sizee": 3}}}}, "sizee"),
    ({"custom_envs": {"Lake": {"env_config": {"action_pattern": "(unclosed"}}}}, "action_pattern"),
    ({"custom_envs": {"Lake": {"agent_template": "{observation} {turn}"}}}, "unknown placeholders ['turn']"),
    ({"train_env_manager": {"tags": ["Nope"]}}, "train_env_manager.tags: ['Nope'] are not custom_envs entries"),
    ({"rollout_batch_size": 6}, "rollout_batch_size = 6 is not a multiple of train_env_manager.group_size = 4"),
    ({"train_env_manager": {"group_size": 1}, "rollout_batch_size": 8,
      "reward_normalization": {"grouping": "traj_group_id", "method": "mean_std"}}, "turns every reward into 0"),
    ({"adv_estimator": "rloo"}, "adv_estimator 'rloo' is not built for the agentic pipeline"),
    ({"async_generation_ratio": 2, "model_update_frequency": 2}, "model_update_frequency = 2 is refused"),
    ({"sequence_length": 4096}, "sequence_length = 4096, but the model"),
    ({"custom_envs": {"Lake": {"tool_wrapper": {"tool_configs": [{"tool_id": "nope"}]}}}}, "nope"),
    ({"custom_envs": {"Lake": {"env_manager_cls": "roll.pipeline.agentic.env_manager.vl_traj_env_manager.X"}}},
     "env_manager_cls"),
    ({"ratio_type": "segment"}, "per-turn ratios are not built"),
])
def test_bad_agentic_input_is_refused_at_load(tmp_path, change, message):
    from roll_gspo.config import preflight

    with pytest.raises(ConfigError) as error:
        preflight(small_config(tmp_path, **change))
    assert message in str(error.value)


def test_agentic_keys_in_an_rlvr_config_are_refused(tmp_path):
    path = REPO / "examples" / "example_gspo.yaml"
    with pytest.raises(ConfigError, match="sequence_length: read only by `pipeline: agentic`"):
        load_config(str(path), ["+sequence_length=512"])


def test_roll_top_level_max_grad_norm_acts(tmp_path):
    cfg = small_config(tmp_path, max_grad_norm=0.5)
    assert cfg.actor_train.training_args.max_grad_norm == 0.5
    with pytest.raises(ConfigError, match="contradicts actor_train.training_args.max_grad_norm"):
        small_config(tmp_path, max_grad_norm=0.5, actor_train={"training_args": {"max_grad_norm": 2.0}})
