"""How the agentic pipeline credits episodes: each turn's return counted once in
its set; no sequence ratio over turns of different advantages; ROLL's reward_clip and token-level KL
acting; an adapter run's first episodes sampled with the adapter; episodes whose env never started
outside the baseline; batch_adjust_mode drawing what it copies or drops; ROLL's normalisation
defaults with a notice. Each is checked against a re-typed reference of ROLL's chain where ROLL has one."""
import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from roll_gspo.agentic.episodes import trajectory_metrics
from roll_gspo.agentic.rollout import EnvSetup, EpisodeRunner
from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.agentic.trajectory import EpisodeSpec, Trajectory
from roll_gspo.algorithms.trajectory_advantages import trajectory_advantages
from roll_gspo.builtin.tokenizer import build_tokenizer
from roll_gspo.config import ConfigError
from roll_gspo.schema.config import CustomEnvConfig, PipelineConfig, RewardNormalizationConfig
from tests.test_agentic import ScriptedEnv, _engine
from tests.test_agentic_e2e import SMALL, records, small_config


def _trajectory(group: str, index: int, rewards, *, gen: int = 2, ctx: int = 1, opened: bool = True) -> Trajectory:
    """An episode of len(rewards) turns, `gen` generated ids a turn and `ctx` observation ids between turns."""
    t = Trajectory(EpisodeSpec("T", 0, group, index), prompt_ids=[1, 2] if opened else [0], opened=opened)
    for turn, reward in enumerate(rewards):
        t.append_generated([5 + turn] * gen, [-0.5] * gen)
        t.step_rewards.append(float(reward))
        if turn < len(rewards) - 1:
            t.append_context([9] * ctx)
    t.stop_reason = "terminated" if opened else "env_error"
    return t


def _pipeline(step_wise: bool, **keys):
    from pipelines.agentic_pipeline import EpisodeSamples

    if "reward_normalization" in keys:
        keys["reward_normalization"] = RewardNormalizationConfig(**keys["reward_normalization"])
    return EpisodeSamples(PipelineConfig(**keys), pad_id=0, step_wise=step_wise)


def _zscore(values):
    x = torch.tensor(values, dtype=torch.float64)
    return ((x - x.mean()) / x.std(unbiased=False)).tolist()


def _turn_values(advantages, loss_mask):
    """The value each row's generated tokens carry (one per row: a turn sample has one turn)."""
    out = []
    for row, mask in zip(advantages, loss_mask):
        values = set(round(float(v), 6) for v, m in zip(row, mask) if m)
        assert len(values) == 1, values
        out.append(values.pop())
    return out


# -- 1. step-wise step_reinforce: a turn's return is one value of its set ------------------------------
def test_step_wise_returns_count_each_turn_once():
    """One group: a 1-turn success and three 3-turn episodes are 10 turn samples, so 10 values in
    the group's normalisation (ROLL's), not every row's whole episode (28 values)."""
    gamma = 0.9
    episodes = [[1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]]
    trajectories = [_trajectory("g", i, r) for i, r in enumerate(episodes)]
    pipeline = _pipeline(True, adv_estimator="step_reinforce", step_reward_gamma=gamma,
                         reward_normalization={"grouping": "traj_group_id", "method": "mean_std"})
    pipeline.cfg.actor_train.training_args.per_device_train_batch_size = 10
    batch = pipeline.samples(trajectories, step=1)
    assert len(batch) == 10
    advantages, metrics = pipeline.advantages(batch)
    # ROLL, re-typed: each turn sample's discounted return, z-scored over the group's samples.
    returns = []
    for rewards in episodes:
        running, out = 0.0, []
        for r in reversed(rewards):
            running = r + gamma * running
            out.append(running)
        returns += out[::-1]
    expected = _zscore(returns)
    assert _turn_values(advantages, batch["loss_mask"]) == pytest.approx(expected, abs=1e-5)
    assert metrics["critic/unstarted_samples"] == 0


def test_trajectory_rows_of_step_reinforce_count_each_turn_once():
    """Whole-trajectory samples: each turn is one value of the set, and each turn's tokens get theirs."""
    episodes = [[1.0], [0.0, 1.0], [0.0, 0.0]]
    trajectories = [_trajectory("g", i, r, gen=1) for i, r in enumerate(episodes)]
    pipeline = _pipeline(False, adv_estimator="step_reinforce", importance_sampling="token",
                         reward_normalization={"grouping": "batch", "method": "mean_std"})
    batch = pipeline.samples(trajectories, step=1)
    advantages, _ = pipeline.advantages(batch)
    expected = _zscore([1.0, 1.0, 1.0, 0.0, 0.0])
    generated = [[float(a) for a, m in zip(row, mask) if m] for row, mask in zip(advantages, batch["loss_mask"])]
    assert generated[0] == pytest.approx(expected[:1], abs=1e-5)
    assert generated[1] == pytest.approx(expected[1:3], abs=1e-5)
    assert generated[2] == pytest.approx(expected[3:], abs=1e-5)


# -- 2. no sequence ratio over turns of different advantages --------------------------------------------
def _agentic_config(tmp_path, drop=(), **changes):
    raw = OmegaConf.merge(OmegaConf.create(SMALL), OmegaConf.create(changes))
    for key in drop:
        raw.pop(key)
    raw.output_dir = str(tmp_path / "out")
    path = tmp_path / "agentic.yaml"
    OmegaConf.save(raw, path)
    from roll_gspo.config import load_config

    return load_config(str(path))


def test_seq_ratio_with_step_reinforce_on_trajectories_is_refused(tmp_path, caplog):
    with pytest.raises(ConfigError, match="importance_sampling: seq with adv_estimator: step_reinforce on "
                                          "whole-trajectory samples is refused"):
        _agentic_config(tmp_path, adv_estimator="step_reinforce")
    for ratio in ("gspo-token", "token"):
        assert _agentic_config(tmp_path, adv_estimator="step_reinforce", importance_sampling=ratio).importance_sampling \
            == ratio
    step_wise = {"custom_envs": {"Lake": {"env_manager_cls": "step"}}, "batch_adjust_mode": "copy"}
    assert _agentic_config(tmp_path, adv_estimator="step_reinforce", **step_wise).importance_sampling == "seq"
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        cfg = _agentic_config(tmp_path, drop=("importance_sampling",), adv_estimator="step_reinforce")
    assert cfg.importance_sampling == "token"
    assert "step_reinforce on whole-trajectory samples with importance_sampling not set: token" in caplog.text


# -- 3. reward_clip and the token-level KL act, as ROLL's chain -------------------------------------------
def _roll_chain(scores, loss_mask, kl, kl_coef, reward_clip):
    """ROLL's agentic chain re-typed (grouping: batch, method: mean_std, population std here):
    normalise, clip, reward on the last generated token minus kl_coef * kl, clip, return-to-go."""
    normed = torch.tensor(_zscore(scores.tolist()))
    normed = normed.clamp(-reward_clip, reward_clip)
    n, width = loss_mask.shape
    rewards = torch.zeros(n, width, dtype=torch.float64)
    for i in range(n):
        last = max(j for j in range(width) if loss_mask[i, j])
        rewards[i, last] = normed[i]
    rewards = (rewards - kl_coef * kl.double()) * loss_mask
    rewards = rewards.clamp(-reward_clip, reward_clip)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(n, dtype=torch.float64)
    for j in reversed(range(width)):
        running = rewards[:, j] + running
        returns[:, j] = running
    return returns * loss_mask


def test_reward_clip_and_token_level_kl_follow_roll():
    torch.manual_seed(0)
    scores = torch.tensor([1.0, 0.0, 0.2, 0.9])
    loss_mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 0, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]).float()
    kl = torch.randn(4, 5) * 0.5
    expected = _roll_chain(scores, loss_mask, kl, 0.2, 0.8)
    adv, metrics = trajectory_advantages(scores, loss_mask, torch.zeros(4, dtype=torch.long), method="mean_std",
                                         reward_clip=0.8, kl=kl, kl_coef=0.2)
    assert torch.allclose(adv.double(), expected, atol=1e-5)
    assert metrics["critic/reward_clipfrac"] > 0 and metrics["critic/kl_coef"] == 0.2
    plain, _ = trajectory_advantages(scores, loss_mask, torch.zeros(4, dtype=torch.long), method="mean_std")
    assert float((plain - adv).abs().max()) > 0.1


def test_the_pipeline_passes_its_kl_and_reward_clip():
    trajectories = [_trajectory("g", i, [r]) for i, r in enumerate([1.0, 0.0, 0.0, 3.0])]
    plain = _pipeline(False, reward_normalization={"grouping": "batch", "method": "identity"})
    batch = plain.samples(trajectories, step=1)
    batch["old_log_probs"] = torch.full(batch["loss_mask"].shape, -1.0)
    batch["ref_log_probs"] = torch.full(batch["loss_mask"].shape, -2.0)  # kl = 1 a token
    base, _ = plain.advantages(batch)
    shaped = _pipeline(False, reward_normalization={"grouping": "batch", "method": "identity"},
                       add_token_level_kl=True, init_kl_coef=0.1, reward_clip=2.0)
    advantages, metrics = shaped.advantages(batch)
    # Two generated tokens a row: the first gets r - 0.2, the last r - 0.1; the 3.0 is clipped to 2.0.
    assert advantages[0, :2].tolist() == pytest.approx([0.8, 0.9])
    assert advantages[3, :2].tolist() == pytest.approx([1.8, 1.9])
    assert base[3, :2].tolist() == [3.0, 3.0] and metrics["critic/kl"] == pytest.approx(1.0)


# -- 5. an episode whose env never started is in no baseline ---------------------------------------------
class _ResetFails(ScriptedEnv):
    def reset(self, seed=None):
        raise RuntimeError("no map")


def test_an_episode_that_never_started_is_outside_its_group_baseline():
    tok = build_tokenizer()
    config = CustomEnvConfig(env_type="scripted", max_steps=1, max_tokens_per_step=4, agent_system_template="",
                             agent_template="{observation}:", env_step_timeout_s=2.0)
    setups = {"ok": EnvSetup("ok", config, lambda seed: ScriptedEnv(), -1.0),
              "bad": EnvSetup("bad", config, lambda seed: _ResetFails(), -1.0)}
    runner = EpisodeRunner(ChatStitcher(tok), setups, sequence_length=64, max_new_tokens=4)
    specs = [EpisodeSpec(tag, 3, "g0", i) for i, tag in enumerate(["ok", "ok", "ok", "bad"])]
    trajectories = runner.run(specs, _engine(tok), lambda i, n: n)
    assert [t.opened for t in trajectories] == [True, True, True, False]
    assert [t.reward for t in trajectories] == [1.0, 1.0, 1.0, 0.0]
    trajectories[3].prompt_ids = [0]  # as EpisodeSamples.sampleable leaves it
    pipeline = _pipeline(False, reward_normalization={"grouping": "traj_group_id", "method": "mean_std"})
    batch = pipeline.samples(trajectories, step=1)
    advantages, metrics = pipeline.advantages(batch)
    assert float(advantages.abs().max()) == 0.0  # three equal winners: no signal (not +0.577 each)
    assert metrics["critic/unstarted_samples"] == 1


class _LongOpening(ScriptedEnv):
    def reset(self, seed=None):
        return "a long opening " * 40, {}


def test_an_episode_whose_opening_does_not_fit_is_outside_its_group_baseline(caplog):
    """An opening longer than sequence_length (the env answered, no token was
    generated) is treated as an episode that never started: in no baseline, counted, logged."""
    tok = build_tokenizer()
    config = CustomEnvConfig(env_type="scripted", max_steps=1, max_tokens_per_step=4, agent_system_template="",
                             agent_template="{observation}:", env_step_timeout_s=2.0)
    setups = {"ok": EnvSetup("ok", config, lambda seed: ScriptedEnv(), -1.0),
              "long": EnvSetup("long", config, lambda seed: _LongOpening(), -1.0)}
    runner = EpisodeRunner(ChatStitcher(tok), setups, sequence_length=64, max_new_tokens=4)
    specs = [EpisodeSpec(tag, 3, "g0", i) for i, tag in enumerate(["ok", "ok", "ok", "long"])]
    with caplog.at_level(logging.WARNING, logger="roll_gspo.agentic"):
        trajectories = runner.run(specs, _engine(tok), lambda i, n: n)
    long = trajectories[3]
    assert long.stop_reason == "max_length" and not any(long.agent_mask) and not long.opened
    assert "sequence_length" in caplog.text and "long" in caplog.text
    assert trajectory_metrics(trajectories, "traj")["traj/opening_too_long"] == 1
    pipeline = _pipeline(False, reward_normalization={"grouping": "traj_group_id", "method": "mean_std"})
    batch = pipeline.samples(pipeline.sampleable(trajectories), step=1)
    assert batch["input_ids"].shape[1] <= 64  # the unplayable opening is an empty sample, not a row past the budget
    advantages, metrics = pipeline.advantages(batch)
    assert float(advantages.abs().max()) == 0.0  # three equal winners: no signal (not +0.577 each)
    assert metrics["critic/unstarted_samples"] == 1


# -- 6. batch_adjust_mode draws what it copies or drops ------------------------------------------------
def test_batch_adjust_draws_its_samples_from_seed_and_step():
    from pipelines.agentic_pipeline import adjust_to_mini_batches as _adjust

    samples = list(range(10))

    def adjusted(mode, step, seed=0):
        return _adjust(samples, SimpleNamespace(mini_batch_size=lambda: 4, batch_adjust_mode=mode, seed=seed), step)

    for mode, size in (("delete", 8), ("random_sample", 8), ("copy", 12), ("auto", 12)):
        runs = [adjusted(mode, step) for step in range(1, 13)]
        assert all(len(r) == size for r in runs)
        assert adjusted(mode, 5) == runs[4]  # a function of (seed, step): a resumed run adjusts alike
        assert len({tuple(r) for r in runs}) > 3, mode  # drawn: not the same positions every step
    dropped_tails = sum(adjusted("delete", step) == samples[:8] for step in range(1, 13))
    assert dropped_tails < 3  # the tail (the last group's final turns) is not always what goes
    copies = [adjusted("copy", step)[10:] for step in range(1, 13)]
    assert all(len(set(c)) == 2 for c in copies) and any(c != [0, 1] for c in copies)
    assert adjusted("delete", 3, seed=1) != adjusted("delete", 3, seed=2) or adjusted("delete", 4, seed=1) != \
        adjusted("delete", 4, seed=2)


# -- 8. ROLL's reward_normalization defaults, said when they act ----------------------------------------
def test_roll_normalisation_defaults_with_a_notice(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        cfg = _agentic_config(tmp_path)
    assert (cfg.reward_normalization.grouping, cfg.reward_normalization.method) == ("batch", "identity")
    assert "reward_normalization.grouping and method not set: ROLL's default (grouping: batch, method: identity: " \
           "raw rewards, no baseline)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        cfg = _agentic_config(tmp_path, reward_normalization={"grouping": "traj_group_id", "method": "mean_std"})
    assert cfg.reward_normalization.method == "mean_std" and "reward_normalization" not in caplog.text


# -- 4. an agentic LoRA run from an adapter samples its first episodes with it -------------------------
@pytest.mark.e2e
def test_agentic_run_from_an_adapter_samples_with_it(tmp_path, tiny_model, session_cache, ray_session):
    """Step 1's episodes come from base + adapter, as the trainer scores them (fp32: equal log-probs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                          LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)  # a trained adapter's B is not zero
    adapter = tmp_path / "adapter"
    peft.save_pretrained(adapter)
    cfg = small_config(tmp_path / "run", pretrain=tiny_model, max_steps=1, eval_steps=0,
                       actor_train={"model_args": {"adapter_name_or_path": str(adapter)}})
    from pipelines.agentic_pipeline import run_agentic

    run_agentic(cfg)
    (row,) = [r for r in records(cfg.output_dir) if "actor/pg_loss" in r]
    assert row["rollout/logprob_gap"] <= 1e-4, row["rollout/logprob_gap"]
    assert math.isfinite(row["actor/pg_loss"]) and os.path.isdir(os.path.join(cfg.output_dir, "final_model"))
