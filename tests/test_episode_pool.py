"""Agentic runs asynchronous, without Ray: the episode pool's cut between turns
(`turn_allowed`), its staleness bound per turn (last chance, drops), its independence of timing,
its checkpoint (held episodes' envs replayed; a non-deterministic env refused), and the agentic
source's modes 1 and k = 2 over a scripted engine: the rollout generated ahead and the one a
checkpoint restores carry the same samples and metrics, and a restored pool plays on as the live
one. The run on the real stack is tests/test_agentic_e2e.py::test_async_agentic_staleness_two_and_exact_resume."""
import dataclasses
import random
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from roll_gspo.agentic.episode_pool import EpisodeGroup, EpisodePool, GroupRounds, group_rounds, turn_allowed
from roll_gspo.agentic.episodes import episode_specs, turn_seed_bases
from roll_gspo.agentic.rollout import EnvSetup, EpisodeProgress, EpisodeRunner, TurnOutput
from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.builtin.tokenizer import build_tokenizer
from roll_gspo.schema.config import CustomEnvConfig, EnvManagerConfig

LENGTHS = {"short": 2, "long": 5}  # turns until the env ends an episode, per tag


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class CountdownEnv:
    """Ends after `length` steps; the reward of a step depends on the action's text (so a replay with
    other actions would show), optionally slow, optionally not deterministic."""

    def __init__(self, length, delay=None, noisy=False):
        self.length, self.delay, self.noisy, self.steps = length, delay, noisy, 0

    def reset(self, seed=None):
        self.steps = 0
        return f"start {seed % 7}", {}

    def step(self, action):
        if self.delay:
            time.sleep(self.delay())
        self.steps += 1
        reward = len(action) / 10 + (random.random() if self.noisy else 0.0)
        return f"at {self.steps}", reward, self.steps >= self.length, False, {}


def make_runner(tok, delay=None, noisy=False):
    setups = {}
    for tag, length in LENGTHS.items():
        config = CustomEnvConfig(env_type="countdown", max_steps=10, max_tokens_per_step=4, agent_system_template="",
                                 agent_template="{observation}:", env_step_timeout_s=30.0)
        setups[tag] = EnvSetup(tag, config, lambda seed, n=length: CountdownEnv(n, delay, noisy))
    return EpisodeRunner(ChatStitcher(tok), setups, sequence_length=400, max_new_tokens=4)


class ScriptedEngine:
    """One turn per request: tokens from its seed alone, log-probs of its version; answered at once or,
    with `delay`, from a thread after a random wait (the engine loop's timing, without an engine)."""

    def __init__(self, delay=None):
        self.version, self.delay, self.prompts = 0, delay, {}

    def submit(self, request):
        ids = [5 + (request.seed + k) % 20 for k in range(1 + request.seed % 4)][:request.max_new_tokens]
        out = TurnOutput(ids, [-0.1 * (self.version + 1)] * len(ids), self.version)
        self.prompts[(request.index, request.seed)] = list(request.prompt_ids)
        future = Future()
        if self.delay is None:
            future.set_result(out)
        else:
            wait = self.delay()
            threading.Thread(target=lambda: (time.sleep(wait), future.set_result(out)), daemon=True).start()
        return future


def new_groups(step, groups, group_size=2):
    """`groups` new groups, tags alternating short / long (their seeds a function of the step)."""
    manager = EnvManagerConfig(tags=["short", "long"], num_env_groups=groups, group_size=group_size)
    specs = episode_specs(manager, groups * group_size, 7, step, "train")
    return specs, turn_seed_bases(7, step, len(specs), "train")


def schedule(pool, engine, steps, *, quota=2, target=4, bound=2, group_size=2):
    """The pipeline's order: step s's advance runs under version max(s - 2, 0) (one rollout ahead of
    the trainer). Returns per step the taken groups and the counts."""
    out = []
    for step in range(1, steps + 1):
        engine.version = max(step - 2, 0)
        specs, bases = new_groups(step, max(0, target - len(pool.held)), group_size)
        out.append(pool.advance(specs, bases, group_size, quota, step, bound, engine.submit))
    return out


def snapshot(results):
    return [([(t.spec.group_id, t.response_ids, t.log_probs, t.turn_versions, t.step_rewards, t.stop_reason)
              for g in groups for t in g.episodes], counts.as_dict()) for groups, counts in results]


# -- the cut ------------------------------------------------------------------------------------
def test_turn_allowed_is_decided_by_what_groups_have_played():
    done = lambda n, order: GroupRounds(n, True, order)  # noqa: E731
    playing = lambda n, order: GroupRounds(n, False, order)  # noqa: E731

    def b_turn(a, b, quota, r, last_chance=(), must=0):  # group b's (order 1) turn of round r
        return turn_allowed({"a": a, "b": b}, quota, [(set(last_chance), must)], r, 1)

    # quota 1: a may still end within 1 round, so b's 2nd turn waits; once a has, it is out.
    assert b_turn(playing(1, 0), playing(3, 1), 1, 2) is None
    assert b_turn(done(1, 0), playing(3, 1), 1, 2) is False
    assert b_turn(playing(3, 0), playing(3, 1), 1, 2) is True  # a needs a 3rd round: b's 2nd comes first
    # Within a round the group that joined first comes first: a ending at round 2 cuts b's 2nd turn,
    # while a's own 2nd turn never waits for b.
    assert b_turn(playing(2, 0), playing(3, 1), 1, 2) is None and b_turn(done(2, 0), playing(3, 1), 1, 2) is False
    assert turn_allowed({"a": playing(2, 0), "b": playing(2, 1)}, 1, [], 2, 0) is True
    # quota 2: both must end; the first ending early does not cut the other.
    assert b_turn(done(1, 0), playing(3, 1), 2, 3) is True
    # A group at its last chance keeps the advance going after the quota's groups are complete ...
    assert b_turn(done(1, 0), playing(3, 1), 1, 3, {"b"}, 1) is True
    assert b_turn(done(1, 0), done(3, 1), 1, 4, {"b"}, 1) is False
    # ... and a later group's turns wait while the last-chance one might still end before them.
    assert turn_allowed({"a": done(1, 0), "b": playing(2, 1), "c": playing(3, 2)}, 1, [({"b"}, 1)], 3, 2) is None
    progress = {0: EpisodeProgress(2, "ready"), 1: EpisodeProgress(1, "ended"), 2: EpisodeProgress(1, "busy"),
                3: EpisodeProgress(1, "ended")}
    a, b = (EpisodeGroup(key, order, [], []) for key, order in (("a", 0), ("b", 1)))
    assert group_rounds(progress, {0: a, 1: a, 2: b, 3: b}) == {"a": playing(3, 0), "b": playing(1, 1)}


def test_advance_cuts_between_turns_and_holds_the_rest(tok):
    """Quota 2 of 4 groups (two short, then two long, in that order): the short groups complete at
    slots (2, 0) and (2, 1), so the long ones play their 1st turn and are cut before their 2nd, held
    after its env step with their envs, nothing in flight."""
    pool, engine = EpisodePool(make_runner(tok)), ScriptedEngine()
    specs, bases = new_groups(1, 4)
    taken, counts = pool.advance(specs, bases, 2, 2, step=1, bound=2, submit=engine.submit)
    assert [t.spec.tag for g in taken for t in g.episodes] == ["short"] * 4
    assert all(t.turns == 2 and t.stop_reason == "terminated" for g in taken for t in g.episodes)
    assert (counts.rounds, counts.turns, counts.new_groups, counts.partial_groups) == (2, 12, 4, 2)
    held = [t for g in pool.held for t in g.episodes]
    assert all(t.spec.tag == "long" and t.turns == 1 and not t.done for t in held)
    assert sorted(pool.envs) == sorted(t.spec.index for t in held) and all(e.steps == 1 for e in pool.envs.values())
    assert all(t.length == len(t.prompt_ids) + len(t.response_ids) and t.agent_mask[-1] == 0 for t in held)
    # The next advance (quota 1, no new group): the first long group ends at its 4th turn of this
    # advance, slot (4, 2); the second is cut before its 4th.
    taken, counts = pool.advance([], [], 2, 1, step=2, bound=2, submit=engine.submit)
    assert [t.turns for g in taken for t in g.episodes] == [5, 5] and counts.rounds == 4
    assert [t.turns for g in pool.held for t in g.episodes] == [4, 4]


def test_staleness_bound_per_turn_over_steps(tok):
    """The pipeline's schedule at k = 2: long episodes span versions; every taken trajectory's oldest
    turn is within 2 versions of the trainer (step - 1); held groups past the bound are dropped."""
    pool, engine = EpisodePool(make_runner(tok)), ScriptedEngine()
    results = schedule(pool, engine, 6)
    spans = 0
    for step, (groups, counts) in enumerate(results, start=1):
        assert len(groups) == 2 and counts.dropped_past_bound == 0
        for t in (t for g in groups for t in g.episodes):
            assert 0 <= step - 1 - min(t.turn_versions) <= 2
            assert t.done and len(t.turn_versions) == t.turns
            spans += len(set(t.turn_versions)) > 1
            lags = {step - 1 - v for v, m in zip(t.token_versions(), t.agent_mask) if m}
            assert max(lags) == step - 1 - t.weight_version
    assert spans > 0
    assert max(step - 1 - g.oldest_version() for step, (gs, _) in enumerate(results, 1) for g in gs) == 2

    # Quota 1, one short and three long groups: the long ones are held after 1 turn of version 0. At
    # step 3 (version 1) all three are at their last chance (3 - 0 > 2); m = 1: the first one's 4 more
    # turns finish it and it is taken; the other two, cut before their last turn, are dropped.
    pool, engine = EpisodePool(make_runner(tok)), ScriptedEngine()
    specs, bases = new_groups(1, 8)  # four short groups, then four long ones
    taken, counts = pool.advance(specs[6:14], bases[6:14], 2, 1, 1, 2, engine.submit)
    assert [g.episodes[0].spec.tag for g in taken] == ["short"] and counts.partial_groups == 3
    engine.version = 1
    taken, counts = pool.advance([], [], 2, 1, 3, 2, engine.submit)
    assert (counts.rounds, len(taken), counts.dropped_past_bound, counts.partial_groups) == (4, 1, 2, 0)
    assert taken[0].episodes[0].turn_versions == [0, 1, 1, 1, 1] and not pool.envs and not pool.held


def test_the_cut_does_not_depend_on_timing(tok):
    """Random env and engine latencies: the same turns, versions and counts as instant ones."""
    plain = snapshot(schedule(EpisodePool(make_runner(tok)), ScriptedEngine(), 4))
    for seed in (1, 2):
        rng = random.Random(seed)
        slow = lambda: rng.random() * 0.004  # noqa: E731
        runner = make_runner(tok, delay=slow)
        assert snapshot(schedule(EpisodePool(runner), ScriptedEngine(delay=slow), 4)) == plain


def test_a_saved_pool_plays_on_as_the_live_one(tok):
    """state() after step 2, loaded into a new pool (the held envs replayed from seed and actions):
    steps 3 and 4 as the uninterrupted pool played them."""
    live, engine = EpisodePool(make_runner(tok)), ScriptedEngine()
    whole = snapshot(schedule(live, engine, 4))
    first, engine = EpisodePool(make_runner(tok)), ScriptedEngine()
    schedule(first, engine, 2)
    saved = first.state()
    assert any(t["turn_versions"] and not t["stop_reason"] for g in saved["held"] for t in g["episodes"])
    resumed = EpisodePool(make_runner(tok))
    resumed.load_state(torch.load(_roundtrip(saved), weights_only=False))
    assert {i: e.steps for i, e in resumed.envs.items()} == {i: e.steps for i, e in first.envs.items()}
    rest = []
    for step in (3, 4):
        engine.version = step - 2
        specs, bases = new_groups(step, max(0, 4 - len(resumed.held)))
        rest.append(resumed.advance(specs, bases, 2, 2, step, 2, engine.submit))
    assert snapshot(rest) == whole[2:]


def test_an_env_that_does_not_replay_is_refused(tok):
    pool, engine = EpisodePool(make_runner(tok, noisy=True)), ScriptedEngine()
    schedule(pool, engine, 1)
    with pytest.raises(ValueError, match="not deterministic given its seed and actions"):
        EpisodePool(make_runner(tok, noisy=True)).load_state(pool.state())


def _roundtrip(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


# -- the agentic source, modes 1 and k = 2 --------------------------------------------------------
LAKE = {"env_type": "frozen_lake", "max_tokens_per_step": 3, "agent_system_template": "",
        "agent_template": "{observation}\n",
        "env_config": {"size": 3, "p": 0.8, "is_slippery": False, "action_pattern": "^(.*)$", "env_instruction": ""}}


def episode_source(tmp_path, tok, ratio):
    """The agentic source the run plan picks for a two-tag FrozenLake config (episodes of at most 2
    and 4 turns), its turns from a scripted engine."""
    from pipelines.agentic_pipeline import make_episode_source
    from roll_gspo.config.plan.run_plan import build_run_plan
    from tests.test_agentic_e2e import small_config

    cfg = small_config(tmp_path, async_generation_ratio=ratio, eval_steps=0,
                       custom_envs={"Short": {**LAKE, "max_steps": 2}, "Long": {**LAKE, "max_steps": 4}},
                       train_env_manager={"tags": ["Short", "Long"], "num_env_groups": 2, "group_size": 4})
    source, engine = make_episode_source(cfg, tok, build_run_plan(cfg)), ScriptedEngine()
    source.submitter = lambda gen, name: engine.submit
    return source, engine


def same_rollout(a, b):
    assert a.metrics == b.metrics and a.weight_versions == b.weight_versions and a.trainable == b.trainable
    for key in ("input_ids", "loss_mask", "rollout_log_probs", "scores"):
        assert torch.equal(a.batch[key], b.batch[key]), key


def checkpointed(source, make):
    """A new source from `source`'s driver state and pool, through torch.save as a checkpoint keeps them."""
    fresh = make()
    fresh.load_state_dict(torch.load(_roundtrip(source.state_dict()), weights_only=False))
    fresh.load_pool_states(torch.load(_roundtrip(source.pool_states()), weights_only=False))
    return fresh


def test_one_step_ahead_plays_the_steps_episodes_and_restores_them_exactly(tmp_path, tok):
    sync, _ = episode_source(tmp_path / "sync", tok, 0)
    ahead, _ = episode_source(tmp_path / "ahead", tok, 1)
    ahead.produce(1, {})
    started = ahead.start_ahead(2)  # played in a driver thread while the trainer would train
    rollout = ahead.finish_ahead(started)
    sync.produce(1, {})
    same_rollout(rollout, sync.produce(2, {}))  # the same episodes (same weights here)
    assert "health/uniform_reward_steps" in rollout.metrics and "traj/reward_mean" in rollout.metrics
    resumed = checkpointed(ahead, lambda: episode_source(tmp_path / "resumed", tok, 1)[0])
    same_rollout(resumed.restore(rollout.batch), rollout)  # traj/* and health/* from the driver state
    assert resumed.health.state_dict() == ahead.health.state_dict()


def test_k2_source_streams_groups_across_versions_and_resumes_exactly(tmp_path, tok):
    make = lambda name: episode_source(tmp_path / name, tok, 2)  # noqa: E731
    live, engine = make("live")
    rollouts = {1: live.produce(1, {})}
    for step in (2, 3):  # generated ahead under version step - 2
        engine.version = step - 2
        rollouts[step] = live.finish_ahead(live.start_ahead(step))
    assert live.pool.held and rollouts[3].metrics["rollout/continuations"] > 0
    resumed = checkpointed(live, lambda: make("resumed")[0])
    same_rollout(resumed.restore(rollouts[3].batch), rollouts[3])
    resumed.submitter = live.submitter
    for step in (4, 5):
        engine.version = step - 2
        again = resumed.finish_ahead(resumed.start_ahead(step))
        rollouts[step] = live.finish_ahead(live.start_ahead(step))
        same_rollout(again, rollouts[step])
    mixed = 0
    for step, rollout in rollouts.items():
        batch = rollout.batch
        assert len(batch) == 8 and all(0 <= step - 1 - v <= 2 for v in batch["weight_version"])
        for row, versions in enumerate(batch["token_weight_versions"]):
            assert len(versions) == int(batch["response_mask"][row].sum()) and min(versions) == batch["weight_version"][row]
            mixed += len(set(versions)) > 1
    assert mixed and max(step - 1 - min(r.weight_versions) for step, r in rollouts.items()) == 2


def test_an_episode_whose_env_fails_at_reset_is_an_empty_sample_of_the_newest_version(tmp_path, tok):
    """k = 2: the first group's envs raise at reset; the group completes with no turn and is taken
    beside a played one; its rows get a pad prompt (no loss) and count as the batch's newest version
    (nothing stale)."""
    source, engine = episode_source(tmp_path, tok, 2)
    setup = source.train_runner.setups["Short"]
    first_seed = episode_specs(source.cfg.train_env_manager, 16, source.cfg.seed, 1, "train")[0].env_seed

    def broken(seed):
        env = setup.make(seed)
        if seed == first_seed:
            env.reset = lambda seed=None: (_ for _ in ()).throw(RuntimeError("no map"))
        return env

    source.train_runner.setups["Short"] = dataclasses.replace(setup, make=broken)
    engine.version = 3
    rollout = source.produce(1, {})
    failed = [row for row, t in enumerate(rollout.batch["prompt_lengths"]) if int(t) == 1]
    assert rollout.metrics["env/errors"] == 4 and len(failed) == 4 and rollout.trainable
    for row in failed:
        assert rollout.batch["loss_mask"][row].sum() == 0 and rollout.batch["weight_version"][row] == 3


# -- larger pools drop no group at its last chance ------------------------------------------------
def test_a_heavy_tailed_pool_of_k_batches_drops_no_group(tok):
    """A pool of k = 5 batches (more than k is refused by the config) of one-turn and nine-turn
    episodes: however many held groups near their bound together, and however long their
    episodes, each is finished and trained within the bound; none is dropped (three were, with
    the last-chance rule that waited for a quota of them at most)."""
    tail = {"one": 1, "long": 9}
    setups = {tag: EnvSetup(tag, CustomEnvConfig(env_type="countdown", max_steps=10, max_tokens_per_step=4,
                                                 agent_system_template="", agent_template="{observation}:"),
                            lambda seed, n=turns: CountdownEnv(n)) for tag, turns in tail.items()}
    pool = EpisodePool(EpisodeRunner(ChatStitcher(tok), setups, sequence_length=400, max_new_tokens=4))
    engine, quota, k, dropped, long_trained = ScriptedEngine(), 2, 5, 0, 0
    for step in range(1, 21):
        engine.version = max(step - 2, 0)
        manager = EnvManagerConfig(tags=list(tail), num_env_groups=k * quota - len(pool.held), group_size=1)
        specs = episode_specs(manager, manager.num_env_groups, 7, step, "train")
        taken, counts = pool.advance(specs, turn_seed_bases(7, step, len(specs), "train"), 1, quota, step, k,
                                     engine.submit)
        assert len(taken) == quota and all((step - 1) - g.oldest_version() <= k for g in taken)
        dropped += counts.dropped_past_bound
        long_trained += sum(t.spec.tag == "long" for g in taken for t in g.episodes)
    assert dropped == 0 and long_trained > 0
