"""The request pool of partial rollouts (async_generation_ratio k >= 2;
roll_gspo.strategies.request_pool) on real engines in-process, without Ray: the quota of complete
groups comes back, partials are held and continued by re-prefill with new seeds, held groups past
the staleness bound are dropped, runs are deterministic and a saved pool continues as the live
one; and a forced mid-generation weight update in vLLM (fp32): each token's rollout log-prob is
its own version's, as the trainer-side model (HF forward) scores it under that version's weights,
for partial responses and for agentic episodes held between turns across the update
(roll_gspo.agentic.episode_pool, on the same engine)."""
import io
import os

import pytest
import torch

from roll_gspo.strategies.engine import Sampling
from roll_gspo.strategies.request_pool import RequestPool, continuation_seed
from tests.test_rollout_engine import PROMPTS, role_for

ROWS = [{"prompt_ids": p, "sample_seed": 1000 * (i + 1), "domain": "math"} for i, p in enumerate(PROMPTS)]
# One response per prompt on vLLM: the tiny random model's response of seed 3 stops at 26 tokens, those
# of seeds 1, 2 and 7 run longer, so the first group completes while the others are mid-response.
STREAM = [{"prompt_ids": p, "sample_seed": seed, "domain": "math"} for p, seed in zip(PROMPTS, (3, 1, 2, 7))]


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    return VllmStrategy(role_for(tiny_model), max_model_len=96, seed=0)


class Recording:
    """The real engine, with the seeds of its submissions noted (by request id)."""

    def __init__(self, engine):
        self.engine, self.seeds = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, request_id, prompt_ids, sampling, seed=None, group=None):
        self.seeds[request_id] = (list(prompt_ids), seed)
        return self.engine.submit(request_id, prompt_ids, sampling, seed, group=group)


def tokens(groups):
    return [[(r.token_ids, r.log_probs, r.weight_versions, r.finish_reason) for r in g.requests] for g in groups]


def test_hf_infer_pool_returns_the_quota_and_holds_the_rest(tiny_model):
    """hf_infer runs one group per engine step here: two of four groups finish, the other two are
    cut in the queue (no tokens) and held; the next call resubmits them with new seeds and returns
    them; nothing is ever left in the engine."""
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy

    engine = Recording(HfInferStrategy(role_for(tiny_model, infer_batch_size=1), seed=0))
    pool = RequestPool(engine)
    sampling = Sampling(max_new_tokens=8, temperature=1.0)
    first, counts = pool.advance(ROWS, 2, step=1, bound=2, sampling=sampling, n=2)
    assert [g.meta["sample_seed"] for g in first] == [1000, 2000] and all(g.complete for g in first)
    assert (counts.complete, counts.partial_groups, counts.new_groups, counts.dropped_past_bound) == (2, 2, 4, 0)
    assert not engine.unfinished() and [len(r.token_ids) for g in pool.held for r in g.requests] == [0] * 4
    second, counts = pool.advance([], 2, step=2, bound=2, sampling=sampling, n=2)
    assert [g.meta["sample_seed"] for g in second] == [3000, 4000] and counts.partial_groups == 0
    assert (counts.continuations, counts.reprefill_tokens) == (0, 0)  # nothing sampled yet: no re-prefill
    resubmitted = {rid: seed for rid, (_, seed) in engine.seeds.items() if rid.endswith("/1")}
    assert resubmitted == {f"p{g}/{j}/1": continuation_seed(1000 * (g + 1) + j, 1) for g in (2, 3) for j in (0, 1)}
    assert all(seed != continuation_seed(seed, 1) for seed in (3000, 3001, 4000, 4001))


def test_vllm_partials_are_continued_by_reprefill(vllm_engine):
    """One group's quota from four: the others are cut mid-response and held with their tokens;
    the next call resubmits each as prompt + tokens so far (its cap reduced, a new seed) and the
    responses it returns begin with the held tokens."""
    vllm_engine.llm.reset_prefix_cache()
    engine = Recording(vllm_engine)
    pool = RequestPool(engine)
    sampling = Sampling(max_new_tokens=40, temperature=1.0)
    first, counts = pool.advance(STREAM, 1, step=1, bound=2, sampling=sampling, n=1)
    assert len(first) == 1 and counts.partial_groups == 3 and not vllm_engine.unfinished()
    held = {g.key: [list(r.token_ids) for r in g.requests] for g in pool.held}
    cut = [r for g in pool.held for r in g.requests if r.token_ids and not r.finished]
    assert cut, "no response was cut mid-way"
    expected = (len(cut), sum(len(r.token_ids) for r in cut))
    rest, counts = pool.advance([], 3, step=2, bound=2, sampling=sampling, n=1)
    assert (counts.continuations, counts.reprefill_tokens) == expected
    for group in rest:
        for j, (before, request) in enumerate(zip(held[group.key], group.requests)):
            assert request.token_ids[:len(before)] == before and request.finished
            assert len(request.log_probs) == len(request.weight_versions) == len(request.token_ids)
            if before and request.segments == 2:
                prompt, seed = engine.seeds[f"{group.key}/{j}/1"]
                assert prompt == group.prompt_ids + before and seed == continuation_seed(request.seed, 1) != request.seed


def test_vllm_pool_drops_past_the_bound_and_is_deterministic(vllm_engine):
    """Held tokens of version 0: kept while step - 0 <= bound, dropped (and counted) beyond; two
    identical runs, one through a saved and reloaded pool, give identical tokens."""
    sampling = Sampling(max_new_tokens=40, temperature=1.0)

    def run(reload: bool):
        vllm_engine.llm.reset_prefix_cache()
        pool = RequestPool(vllm_engine)
        first, _ = pool.advance(STREAM, 1, step=1, bound=2, sampling=sampling, n=1)
        if reload:
            buffer = io.BytesIO()
            torch.save(pool.state(), buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            pool = RequestPool(vllm_engine)
            pool.load_state(saved)
        vllm_engine.llm.reset_prefix_cache()
        second, counts = pool.advance(STREAM[:1], 1, step=2, bound=2, sampling=sampling, n=1)
        return tokens(first) + tokens(second), counts, pool

    plain, counts, pool = run(reload=False)
    assert counts.dropped_past_bound == 0 and counts.partial_groups == 3
    assert run(reload=True)[0] == plain
    held = len(pool.held)
    assert all(g.oldest_version() in (0, None) for g in pool.held)
    _, counts = pool.advance([], 0, step=3, bound=2, sampling=sampling, n=1)  # 3 - 0 > 2: past the bound
    with_tokens = counts.dropped_past_bound
    assert with_tokens >= 1 and counts.partial_groups == held - with_tokens == len(pool.held)


def test_weight_update_mid_generation_keeps_each_version_exact(vllm_engine, tiny_model):
    """Partials cut under version 0, new weights loaded (version 1), continued: responses of tokens
    of both versions, and every token's rollout log-prob is within 1e-4 of the trainer-side model's
    (HF forward, fp32) under the weights of that token's version."""
    from safetensors.torch import load_file

    from roll_gspo.models.causal_lm import build_sequences, load_causal_lm, response_token_log_probs

    original = load_file(os.path.join(tiny_model, "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    updated = {name: t + 0.05 * t.std() * torch.randn(t.shape, generator=generator) if t.dim() > 1 else t
               for name, t in original.items()}
    sampling = Sampling(max_new_tokens=40, temperature=1.0)
    vllm_engine.llm.reset_prefix_cache()
    base = vllm_engine.weight_version
    pool = RequestPool(vllm_engine)
    pool.advance(STREAM, 1, step=base + 1, bound=2, sampling=sampling, n=1)
    try:
        vllm_engine.begin_weight_update()
        vllm_engine.load_weights(list(updated.items()))
        vllm_engine.finish_weight_update(base + 1)
        groups, _ = pool.advance([], 3, step=base + 2, bound=2, sampling=sampling, n=1)
    finally:
        vllm_engine.begin_weight_update()
        vllm_engine.load_weights(list(original.items()))
        vllm_engine.finish_weight_update(base + 2)
    requests = [(g.prompt_ids, r) for g in groups for r in g.requests]
    mixed = [r for _, r in requests if len(set(r.weight_versions)) == 2]
    assert mixed, "no response spans the update"
    model = load_causal_lm(tiny_model, "fp32").eval()
    input_ids, attention, prompt_lengths, mask = build_sequences([p for p, _ in requests],
                                                                 [r.token_ids for _, r in requests], 0)
    rollout = torch.zeros(mask.shape)
    versions = torch.full(mask.shape, -1)
    for i, (_, r) in enumerate(requests):
        rollout[i, :len(r.log_probs)] = torch.tensor(r.log_probs)
        versions[i, :len(r.weight_versions)] = torch.tensor(r.weight_versions)
    for version, weights in ((base, original), (base + 1, updated)):
        model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            trainer, _ = response_token_log_probs(model, input_ids, attention, prompt_lengths, mask.shape[1], 1.0)
        own = (versions == version) & mask.bool()
        assert own.sum() > 0
        gap = (trainer - rollout).abs()[own].max().item()
        assert gap <= 1e-4, (version, gap)
        other = (versions == (base + 1 if version == base else base)) & mask.bool()
        assert (trainer - rollout).abs()[other].max().item() > 1e-3  # the versions really differ


def test_episodes_held_across_a_weight_update_keep_each_turns_version_exact(vllm_engine, tiny_model):
    """Agentic k >= 2: FrozenLake episodes of at most 2 and 5 turns; the pool's first advance (version
    v) cuts between turns when the short groups end, new weights are loaded (v + 1), the second
    advance continues the held episodes. Their trajectories carry turns of both versions, and every
    generated token's rollout log-prob is within 1e-4 of the HF forward under its turn's version."""
    from concurrent.futures import Future

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from roll_gspo.agentic.episode_pool import EpisodePool
    from roll_gspo.agentic.episodes import episode_specs, turn_seed_bases
    from roll_gspo.agentic.rollout import EnvSetup, EpisodeRunner, TurnOutput
    from roll_gspo.agentic.tokens import ChatStitcher
    from roll_gspo.schema.config import CustomEnvConfig, EnvManagerConfig
    from roll_gspo.envs.registry import make_env
    from roll_gspo.models.causal_lm import build_sequences, load_causal_lm, response_token_log_probs
    from roll_gspo.strategies.engine import generate_groups

    env_config = {"size": 3, "p": 0.8, "is_slippery": False, "action_pattern": "^(.*)$", "env_instruction": ""}
    setups = {tag: EnvSetup(tag, CustomEnvConfig(env_type="frozen_lake", max_steps=turns, max_tokens_per_step=3,
                                                 agent_system_template="", agent_template="{observation}\n",
                                                 env_config=env_config),
                            lambda seed: make_env("frozen_lake", dict(env_config)))
              for tag, turns in (("Short", 2), ("Long", 5))}
    runner = EpisodeRunner(ChatStitcher(AutoTokenizer.from_pretrained(tiny_model)), setups, sequence_length=90,
                           max_new_tokens=3)

    def submit(request):  # one turn on the engine, at once (the rank's engine loop does this in a thread)
        ((out,),) = generate_groups(vllm_engine, [request.prompt_ids], Sampling(max_new_tokens=request.max_new_tokens,
                                                                                temperature=1.0), 1, [request.seed])
        turn = Future()
        turn.set_result(TurnOutput(list(out.token_ids), list(out.log_probs), out.weight_version))
        return turn

    original = load_file(os.path.join(tiny_model, "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    updated = {name: t + 0.05 * t.std() * torch.randn(t.shape, generator=generator) if t.dim() > 1 else t
               for name, t in original.items()}
    vllm_engine.llm.reset_prefix_cache()
    base = vllm_engine.weight_version
    manager = EnvManagerConfig(tags=["Short", "Long"], num_env_groups=4, group_size=2)
    specs = episode_specs(manager, 8, 5, 1, "train")
    pool = EpisodePool(runner)
    first, _ = pool.advance(specs, turn_seed_bases(5, 1, 8, "train"), 2, 2, step=base + 1, bound=2, submit=submit)
    try:
        vllm_engine.begin_weight_update()
        vllm_engine.load_weights(list(updated.items()))
        vllm_engine.finish_weight_update(base + 1)
        second, _ = pool.advance([], [], 2, 2, step=base + 2, bound=2, submit=submit)
    finally:
        vllm_engine.begin_weight_update()
        vllm_engine.load_weights(list(original.items()))
        vllm_engine.finish_weight_update(base + 2)
    episodes = [t for g in first + second for t in g.episodes]
    assert any(len(set(t.turn_versions)) == 2 for t in episodes), "no episode spans the update"
    model = load_causal_lm(tiny_model, "fp32").eval()
    input_ids, attention, prompt_lengths, mask = build_sequences([t.prompt_ids for t in episodes],
                                                                 [t.response_ids for t in episodes], 0)
    rollout = torch.zeros(mask.shape)
    versions = torch.full(mask.shape, -1)
    for i, t in enumerate(episodes):
        rollout[i, :len(t.log_probs)] = torch.tensor(t.log_probs)
        versions[i, :len(t.response_ids)] = torch.tensor(
            [v if generated else -1 for v, generated in zip(t.token_versions(), t.agent_mask)])
    for version, weights in ((base, original), (base + 1, updated)):
        model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            trainer, _ = response_token_log_probs(model, input_ids, attention, prompt_lengths, mask.shape[1], 1.0)
        own = versions == version
        assert own.sum() > 0
        assert (trainer - rollout).abs()[own].max().item() <= 1e-4, version
        other = versions == (base + 1 if version == base else base)
        assert (trainer - rollout).abs()[other].max().item() > 1e-3  # the versions really differ


class LengthEngine:
    """The `RolloutEngine` contract, scripted: a prompt [kind, 0] gets `LENGTHS[kind]` response
    tokens in all, one per engine step (a continuation's prompt holds its earlier ones)."""

    LENGTHS = {9: 10}  # kind 9: a long response; every other kind: one token

    def __init__(self):
        from roll_gspo.strategies.engine import RequestTable

        self.requests, self.weight_version, self.left = RequestTable(), 0, {}

    def submit(self, request_id, prompt_ids, sampling, seed=None, group=None):
        self.requests.add(request_id, self.weight_version)
        self.left[request_id] = self.LENGTHS.get(prompt_ids[0], 1) - (len(prompt_ids) - 2)

    def step(self):
        done = []
        for rid in self.requests.unfinished():
            self.requests.extend(rid, [5], [-0.5], self.weight_version)
            self.left[rid] -= 1
            if not self.left[rid]:
                self.requests.finish(rid, "stop")
                done.append(rid)
        return done

    def unfinished(self):
        return self.requests.unfinished()

    def abort(self, request_ids):
        return self.requests.abort(request_ids)


def test_a_long_response_is_finished_at_its_last_chance_not_dropped():
    """k = 2: a response still running after its first advance is at its last chance in the second
    (incomplete at that cut it would be past the bound). The advance waits for it beyond the quota
    and it is taken first (oldest), so the pool trains long responses too instead of dropping them;
    the short groups that completed meanwhile are held, complete, for the next step."""
    engine, sampling = LengthEngine(), Sampling(max_new_tokens=16)
    pool = RequestPool(engine)
    rows = [{"prompt_ids": [kind, 0], "sample_seed": 10 * i} for i, kind in enumerate((9, 1, 2, 3))]
    taken, counts = pool.advance(rows, 2, step=2, bound=2, sampling=sampling, n=1)
    assert [g.meta["prompt_ids"][0] for g in taken] == [1, 2] and counts.partial_groups == 2  # 9 running, 3 done
    engine.weight_version = 1
    taken, counts = pool.advance([{"prompt_ids": [k, 0], "sample_seed": 50 + k} for k in (4, 5)], 2, step=3,
                                 bound=2, sampling=sampling, n=1)
    assert counts.dropped_past_bound == 0
    assert [g.meta["prompt_ids"][0] for g in taken] == [9, 3]  # version 0 first: the long one and the held one
    (long,) = taken[0].requests
    assert len(long.token_ids) == 10 and long.weight_versions == [0] + [1] * 9 and long.finish_reason == "stop"
    assert sorted(g.meta["prompt_ids"][0] for g in pool.held) == [4, 5] and all(g.complete for g in pool.held)


class HeavyTailEngine(LengthEngine):
    """`LengthEngine` with the length in the prompt: [L, 0] gets min(L, cap) response tokens in all,
    one per engine step, every request in flight advancing together (as vLLM's continuous batch)."""

    def submit(self, request_id, prompt_ids, sampling, seed=None, group=None):
        self.requests.add(request_id, self.weight_version)
        self.left[request_id] = min(prompt_ids[0] - (len(prompt_ids) - 2), sampling.max_new_tokens)


def heavy_tailed_run(pool_batches: float, k: int, steps: int = 40, quota: int = 4, n: int = 2):
    """A scripted run as the RLVR source drives a rank's pool: each step tops the pool up to
    pool_batches * quota groups of heavy-tailed lengths (Pareto, cut at 64 tokens), advances it with
    the weights of step - 2 (generation one step ahead) and takes `quota` groups. Returns the groups
    dropped past the bound, the groups trained and their lengths, checking on the way that each
    taken group is complete and within the bound."""
    import math
    import random

    rng, engine, sampling = random.Random(7), HeavyTailEngine(), Sampling(max_new_tokens=64)
    pool, dropped, trained = RequestPool(engine), 0, []
    for step in range(1, steps + 1):
        engine.weight_version = max(0, step - 2)
        new = math.ceil(pool_batches * quota) - len(pool.held)
        rows = [{"prompt_ids": [max(1, int(2 * rng.paretovariate(1.1))), 0], "sample_seed": 100 * step + i}
                for i in range(new)]
        taken, counts = pool.advance(rows, quota, step, k, sampling, n)
        assert len(taken) == quota and all(g.complete for g in taken) and not engine.unfinished()
        assert all((step - 1) - g.oldest_version() <= k for g in taken)  # trained by version step - 1
        dropped += counts.dropped_past_bound
        trained += [min(g.meta["prompt_ids"][0], 64) for g in taken]
    return dropped, trained


@pytest.mark.parametrize("pool_batches, k", [(4, 4), (3, 3), (4, 5), (2, 2)])
def test_a_heavy_tailed_run_drops_no_group_at_its_last_chance(pool_batches, k):
    """With async_pool_batches up to k (more is refused: more groups than the
    steps can take would reach their bound together), every held group is finished and trained
    before its bound, the long ones included, however many reach it in the same advance."""
    dropped, trained = heavy_tailed_run(pool_batches, k)
    assert dropped == 0
    assert max(trained) == 64  # the longest responses are trained too


def test_more_pool_batches_than_k_are_refused():
    """Pool 4 at k = 2 cannot train every group in time (the scripted run drops
    hundreds of groups whatever the cut waits for), so the config refuses it, naming the key; up to
    k is accepted."""
    from roll_gspo.config import ConfigError, load_config

    assert heavy_tailed_run(4, 2, steps=12)[0] > 0  # what the refusal spares
    with pytest.raises(ConfigError) as info:
        load_config("example_gspo.yaml", ["async_generation_ratio=2", "async_pool_batches=4"])
    assert "async_pool_batches = 4 with async_generation_ratio = 2 is refused: at most 2" in str(info.value)
    assert load_config("example_gspo.yaml", ["async_generation_ratio=4", "async_pool_batches=4"]).async_pool_batches == 4
