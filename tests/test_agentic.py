"""The agentic pipeline's parts without Ray: token-in/token-out stitching, the in-flight episode
loop (env failures, hangs, malformed results, budgets, overlap of env steps with generation),
trajectory tensors and masks, advantages, episode seeds, health warnings, and ROLL's agentic YAML
surface (interpolation anchors, checks)."""
import time

import pytest
import torch

from roll_gspo.agentic.episodes import episode_specs, set_ids, trajectory_metrics, turn_seed_fn
from roll_gspo.agentic.health import HealthMonitor
from roll_gspo.agentic.rollout import EnvSetup, EpisodeRunner, TurnOutput, format_turn
from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.agentic.trajectory import EpisodeSpec, Trajectory, trajectory_tensors, turn_sample_tensors, turn_samples
from roll_gspo.algorithms.trajectory_advantages import (discounted_turn_returns, normalize_in_sets, step_advantages,
    trajectory_advantages)
from roll_gspo.builtin.tokenizer import build_tokenizer
from roll_gspo.schema.config import CustomEnvConfig, EnvManagerConfig


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chatml_tok():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


# -- token stitching ----------------------------------------------------------------------------
def test_stitched_ids_equal_the_full_conversation_render(chatml_tok):
    """Engine ids kept verbatim plus each appended message's suffix give exactly the ids of the
    whole conversation rendered at once (ChatML: the newline after <|im_end|> is not lost)."""
    s = ChatStitcher(chatml_tok, "chatml")
    eos = chatml_tok.eos_token_id
    opening = [{"role": "system", "content": "S"}, {"role": "user", "content": "grid 1"}]
    ids = s.initial_ids(opening)
    conversation = list(opening)
    for turn, (action, reply) in enumerate([("Up", "grid 2"), ("<python>1</python>", "1"), ("Left", "grid 3")]):
        ids += s.encode(action) + [eos]
        role = "tool" if turn == 1 else "user"
        ids += s.suffix_ids([{"role": role, "content": reply}], turn_finished=True, system="S")
        conversation += [{"role": "assistant", "content": action}, {"role": role, "content": reply}]
    assert ids == s.encode(s.render(conversation))


def test_a_turn_cut_at_its_cap_is_closed_by_the_template(chatml_tok):
    s = ChatStitcher(chatml_tok, "chatml")
    cut = s.suffix_text([{"role": "user", "content": "o"}], turn_finished=False)
    done = s.suffix_text([{"role": "user", "content": "o"}], turn_finished=True)
    assert cut == "<|im_end|>" + done and done.startswith("\n<|im_start|>user\no")


def test_builtin_template_appends_the_observation_alone(tok):
    s = ChatStitcher(tok)
    assert s.suffix_text([{"role": "user", "content": "obs"}], turn_finished=True) == "obs"
    assert s.turn_finished([5, tok.eos_token_id]) and not s.turn_finished([5, 6])


# -- the episode loop ---------------------------------------------------------------------------
class ScriptedEnv:
    """Ends after 3 valid steps; misbehaves at its second step as told."""

    def __init__(self, mode=None, slow=0.0):
        self.mode, self.slow, self.steps = mode, slow, 0

    def reset(self, seed=None):
        return f"s{seed % 10}", {"env_instruction": "go"} if self.mode == "instr" else {}

    def step(self, action):
        self.steps += 1
        time.sleep(self.slow)
        if self.steps == 2 and self.mode == "raise":
            raise RuntimeError("boom")
        if self.steps == 2 and self.mode == "hang":
            while True:
                pass
        if self.mode == "not_str":
            return 5, 0.0, False, False, {}
        if self.mode == "tool" and self.steps == 1:
            return "42", 0.0, False, False, {"use_tool": True}
        valid = action.strip() == "a"
        return (f"o{self.steps}", 1.0 if valid else -0.1, self.steps >= 3, False,
                {"action_is_valid": valid, "success": self.steps >= 3, "metrics": {"steps": self.steps}})


def _setups(modes, *, max_steps=5, cap=4, timeout=1.0, slow=0.0):
    setups = {}
    for mode in modes:
        config = CustomEnvConfig(env_type="scripted", max_steps=max_steps, max_tokens_per_step=cap,
                                 agent_system_template="", agent_template="{observation}:",
                                 env_step_timeout_s=timeout)
        setups[mode or "ok"] = EnvSetup(mode or "ok", config, lambda seed, m=mode: ScriptedEnv(m, slow), -1.0)
    return setups


def _engine(tok, text="a", calls=None, delay=0.0):
    def generate(requests):
        if calls is not None:
            calls.append([r.index for r in requests])
        time.sleep(delay)
        return [TurnOutput(tok(text)["input_ids"] + [tok.eos_token_id], [-0.5] * (len(text) + 1), 3)
                for _ in requests]
    return generate


def test_episodes_end_on_env_failures_without_stopping_the_others(tok):
    runner = EpisodeRunner(ChatStitcher(tok), _setups([None, "raise", "hang", "not_str"]), sequence_length=64,
                           max_new_tokens=8)
    specs = [EpisodeSpec(tag, 3, f"g{i}", i) for i, tag in enumerate(["ok", "raise", "hang", "not_str"])]
    start = time.monotonic()
    ok, raised, hung, bad = runner.run(specs, _engine(tok), lambda i, t: i * 10 + t)
    assert time.monotonic() - start < 10  # the hung step was given up at its 1 s timeout
    assert (ok.stop_reason, ok.success, ok.step_rewards) == ("terminated", True, [1.0, 1.0, 1.0])
    assert (raised.stop_reason, raised.step_rewards) == ("env_error", [1.0, -1.0]) and "boom" in raised.error
    assert (hung.stop_reason, hung.step_rewards) == ("env_timeout", [1.0, -1.0])
    assert bad.stop_reason == "env_error" and "observations must be str" in bad.error
    metrics = trajectory_metrics([ok, raised, hung, bad], "traj")
    assert metrics["env/errors"] == 2 and metrics["env/timeouts"] == 1
    assert metrics["env/metric/steps"] == pytest.approx((3 + 1 + 1) / 3)  # the last value each reported


def test_continuous_turns_give_the_waves_trajectories(tok):
    """`submit` (one request per turn, awaited on its own) plays the same episodes as waves: env
    failures, a slow env, tools and the token budget end the same episodes the same way."""
    from concurrent.futures import ThreadPoolExecutor

    setups = _setups([None, "raise", "hang", "tool"], timeout=1.0)
    specs = [EpisodeSpec(tag, 3, f"g{i}", i) for i, tag in enumerate(["ok", "raise", "hang", "tool", "ok"])]
    runner = EpisodeRunner(ChatStitcher(tok), setups, sequence_length=64, max_new_tokens=8)
    waves = runner.run(specs, _engine(tok), lambda i, t: i * 10 + t)
    seeds = []
    generate = _engine(tok, delay=0.01)
    with ThreadPoolExecutor(4) as pool:
        def submit(request):
            seeds.append((request.index, request.seed))
            return pool.submit(lambda: generate([request])[0])
        continuous = runner.run(specs, None, lambda i, t: i * 10 + t, submit=submit)
    fields = ("stop_reason", "step_rewards", "prompt_ids", "response_ids", "agent_mask", "log_probs", "messages")
    assert [[getattr(t, f) for f in fields] for t in continuous] == [[getattr(t, f) for f in fields] for t in waves]
    assert sorted(seeds) == sorted((t.spec.index, t.spec.index * 10 + n) for t in waves for n in range(t.turns))


def test_trajectory_ids_and_masks(tok):
    runner = EpisodeRunner(ChatStitcher(tok), _setups([None]), sequence_length=64, max_new_tokens=8)
    (t,) = runner.run([EpisodeSpec("ok", 3, "g", 0)], _engine(tok), lambda i, n: n)
    eos = tok.eos_token
    assert tok.decode(t.prompt_ids + t.response_ids) == f"s3:a{eos}o1:a{eos}o2:a{eos}"
    assert t.agent_mask == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert t.weight_version == 3 and t.turns == 3
    tensors = trajectory_tensors([t], pad_token_id=0)
    assert tensors["response_mask"].sum() == 12 and tensors["loss_mask"].tolist()[0] == [float(m) for m in t.agent_mask]
    assert (tensors["rollout_log_probs"] * (1 - tensors["loss_mask"])).abs().sum() == 0
    assert tensors["turn_index"].tolist()[0] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    samples = turn_samples([t])
    step_tensors = turn_sample_tensors(samples, 0)
    assert [s.turn for s in samples] == [0, 1, 2]
    assert step_tensors["prompt_lengths"].tolist() == [3, 8, 13]  # the episode's ids before each turn
    assert step_tensors["response_mask"].sum(-1).tolist() == [2, 2, 2]


def test_sequence_length_truncates_and_invalid_actions_count(tok):
    runner = EpisodeRunner(ChatStitcher(tok), _setups([None], max_steps=20), sequence_length=12, max_new_tokens=8)
    (t,) = runner.run([EpisodeSpec("ok", 3, "g", 0)], _engine(tok, text="b"), lambda i, n: n)
    assert t.stop_reason == "max_length" and t.length <= 12
    assert t.invalid_actions == t.turns and t.step_rewards == [-0.1] * t.turns


def test_tool_turns_and_instruction(tok):
    runner = EpisodeRunner(ChatStitcher(tok), _setups(["tool", "instr"]), sequence_length=64, max_new_tokens=8)
    tool, instr = runner.run([EpisodeSpec("tool", 1, "g", 0), EpisodeSpec("instr", 1, "h", 1)], _engine(tok),
                             lambda i, n: n)
    assert tool.tool_calls == 1 and tool.messages[2] == {"role": "tool", "content": "42"}
    assert instr.messages[0]["content"] == "go\ns1:"


def test_env_steps_run_while_the_engine_generates(tok):
    """A slow env and a slow engine: the loop does not wait for every env before generating, so
    an env step and a generation call run at the same time."""
    spans = {"env": [], "gen": []}

    class Timed(ScriptedEnv):
        def step(self, action):
            start = time.monotonic()
            try:
                return super().step(action)
            finally:
                spans["env"].append((start, time.monotonic()))

    config = CustomEnvConfig(env_type="scripted", max_steps=3, max_tokens_per_step=4, agent_system_template="",
                             agent_template="{observation}", env_step_timeout_s=5)
    setups = {"fast": EnvSetup("fast", config, lambda seed: Timed(None, 0.0)),
              "slow": EnvSetup("slow", config, lambda seed: Timed(None, 0.3))}
    base = _engine(tok, delay=0.1)

    def generate(requests):
        start = time.monotonic()
        try:
            return base(requests)
        finally:
            spans["gen"].append((start, time.monotonic()))

    runner = EpisodeRunner(ChatStitcher(tok), setups, sequence_length=64, max_new_tokens=8, batch_window_s=0.02)
    out = runner.run([EpisodeSpec("fast", 1, "a", 0), EpisodeSpec("slow", 1, "b", 1)], generate, lambda i, n: n)
    assert all(t.stop_reason == "terminated" for t in out)
    overlap = sum(max(0.0, min(e1, g1) - max(e0, g0)) for e0, e1 in spans["env"] for g0, g1 in spans["gen"])
    assert overlap > 0.05


def test_format_turn_keeps_unknown_placeholders():
    assert format_turn("{observation}|{turn_idx}|{actions_left}", "o", 2, 3, 9) == "o|2|3"
    assert format_turn("{observation} {nothing}", "o", 1, 1, 1) == "o {nothing}"


# -- advantages ------------------------------------------------------------------------------------
def test_trajectory_advantages_normalise_within_groups():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 1, 1], [0, 1, 0]]).float()
    adv, metrics = trajectory_advantages(scores, mask, torch.tensor([0, 0, 1, 1]), method="mean_std")
    assert adv.tolist() == [[1, 0, 1], [-1, -1, 0], [0, 0, 0], [0, 0, 0]]
    assert metrics["critic/zero_std_sets"] == 1
    raw, _ = normalize_in_sets(scores, torch.zeros(4, dtype=torch.long), "identity")
    assert raw.tolist() == scores.tolist()


def test_step_advantages_credit_each_turn_its_discounted_return():
    returns = discounted_turn_returns([[0.0, 0.0, 1.0], [-0.1, 1.0]], gamma=0.5)
    assert returns == [[0.25, 0.5, 1.0], [0.4, 1.0]]
    turn_index = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, -1, -1]])
    mask = torch.tensor([[1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 0, 0]]).float()
    adv, _ = step_advantages([dict(enumerate(r)) for r in returns], turn_index, mask, torch.tensor([0, 0]),
                             torch.tensor([1.0, 0.9]), method="identity")
    assert torch.allclose(adv, torch.tensor([[0.25, 0, 0.5, 0, 1.0, 0], [0.4, 0, 1.0, 0, 0, 0]]))


# -- episodes, seeds, health --------------------------------------------------------------------------
def test_episode_groups_share_a_seed_and_split_over_tags():
    manager = EnvManagerConfig(tags=["A", "B"], num_groups_partition=[3, 1], num_env_groups=4, group_size=2)
    specs = episode_specs(manager, 8, seed=1, step=5, stream="train")
    assert [s.tag for s in specs] == ["A"] * 6 + ["B"] * 2
    assert [s.index for s in specs] == list(range(8))
    assert specs[0].env_seed == specs[1].env_seed != specs[2].env_seed
    assert specs == episode_specs(manager, 8, seed=1, step=5, stream="train")  # a function of the step
    assert specs != episode_specs(manager, 8, seed=1, step=6, stream="train")
    trajectories = [Trajectory(s) for s in specs]
    assert set_ids(trajectories, "traj_group_id").tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert set_ids(trajectories, "tags").tolist() == [0] * 6 + [1] * 2
    seeds = turn_seed_fn(1, 5, 8, "train")
    assert seeds(0, 1) != seeds(0, 2) and seeds(3, 1) == turn_seed_fn(1, 5, 8, "train")(3, 1)


def test_health_warns_with_numbers():
    monitor = HealthMonitor(tags_with_tools=["T"])
    spec = EpisodeSpec("T", 0, "g", 0)
    same = [Trajectory(spec, step_rewards=[0.0, 0.0], invalid_actions=2) for _ in range(4)]
    warnings = []
    for step in range(1, 4):
        warnings += monitor.check(step, same)
    text = " ".join(warnings)
    assert "every one of the 4 trajectories got reward 0" in text
    assert "8 of 8 actions (100%) were invalid" in text
    assert "no tool call in the last 3 steps" in text


# -- ROLL's YAML surface ----------------------------------------------------------------------------
def test_interpolation_anchors_are_accepted_and_typos_refused():
    from roll_gspo.config.load.loader import interpolation_anchors

    raw = {"action_pattern": "x", "custom_env": {"F": {"m": "${max_a}"}}, "max_a": 3, "typo_key": 1,
           "custom_envs": {"F": "${custom_env.F}"}, "exp_name": "${action_pattern}", "home": "${oc.env:HOME}"}
    assert interpolation_anchors(raw) == {"action_pattern", "custom_env", "max_a"}


def test_step_wise_samples_and_batch_adjustment(tok):
    """env_manager_cls: step: one sample per turn, its context the episode's ids so far; the count
    is made a multiple of the mini-batch (batch_adjust_mode); step_reinforce credits each turn."""
    from types import SimpleNamespace

    from pipelines.agentic_pipeline import EpisodeSamples, adjust_to_mini_batches as _adjust
    from roll_gspo.schema.config import PipelineConfig

    runner = EpisodeRunner(ChatStitcher(tok), _setups([None]), sequence_length=64, max_new_tokens=8)
    trajectories = runner.run([EpisodeSpec("ok", 3, "g0", 0), EpisodeSpec("ok", 3, "g0", 1)], _engine(tok),
                              lambda i, n: n)
    cfg = PipelineConfig(adv_estimator="step_reinforce", step_reward_gamma=0.5)
    cfg.actor_train.training_args.per_device_train_batch_size = 4
    episodes = EpisodeSamples(cfg, pad_id=0, step_wise=True)
    batch = episodes.samples(trajectories, 1)  # 2 episodes x 3 turns = 6 samples -> copy up to 8
    assert len(batch) == 8 and batch["loss_mask"].sum(-1).tolist() == [2.0] * 8
    advantages, _ = episodes.advantages(batch)
    first_turn, last_turn = float(advantages[0, 0]), float(advantages[2, 0])
    assert first_turn > last_turn  # returns G_0 = 1.75 > G_1 = 1.5 > G_2 = 1 (reward 1 a turn, gamma 0.5)
    samples = list(range(6))
    for mode, expected in (("delete", 4), ("copy", 8), ("auto", 8), ("random_sample", 4)):
        assert len(_adjust(samples, SimpleNamespace(mini_batch_size=lambda: 4, batch_adjust_mode=mode, seed=0), 1)) \
            == expected
