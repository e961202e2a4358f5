"""Dynamic sampling with request pools (`async_generation_ratio` k >= 2 and `query_filter_config`),
without Ray: after an advance the complete groups are scored, the rejected ones
dropped, and the pools advanced again under the same weights, with new prompts of the dropped
groups' domains, until rollout_batch_size groups are kept or query_filter_max_rounds; the
synchronous path's `data/*` metrics; every round its own seeds, and two runs agree exactly."""
import types

import torch

from roll_gspo.config import load_config
from roll_gspo.strategies.engine import RequestTable, TabledEngine
from roll_gspo.workers.actor_infer import ActorInferWorker

K2_FILTERED = ["async_generation_ratio=2", "rollout_batch_size=4", "num_return_sequences_in_group=2",
               "response_length=8", "actor_train.training_args.per_device_train_batch_size=4",
               "rewards.math_rule.query_filter_config.type=std_filter",
               "rewards.math_rule.query_filter_config.filter_args.std_threshold=0", "query_filter_max_rounds=3"]


class StepEngine(TabledEngine):
    """A request samples 1 + seed % 6 tokens, one per engine step (token seed + t), log-prob -0.5."""

    def __init__(self):
        self.requests, self.weight_version, self.plan = RequestTable(), 0, {}

    def submit(self, request_id, prompt_ids, sampling, seed=None, group=None):
        self.requests.add(request_id, self.weight_version)
        self.plan[request_id] = (1 + (seed or 0) % 6, seed or 0)

    def step(self):
        done = []
        for rid in self.requests.unfinished():
            length, seed = self.plan[rid]
            have = len(self.requests.outputs[rid].token_ids)
            self.requests.extend(rid, [3 + (seed + have) % 20], [-0.5], self.weight_version)
            if have + 1 >= length:
                self.requests.finish(rid, "stop")
                done.append(rid)
        return done

    def abort(self, request_ids):
        return self.requests.abort(request_ids)


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeRank:
    """An ActorInferWorker's `advance` on the fake engine; `.advance.remote` runs it at once."""

    def __init__(self, tokenizer, cfg):
        worker = types.SimpleNamespace(strategy=StepEngine(), pool=None, tokenizer=tokenizer, cfg=cfg)
        worker._rows = types.MethodType(ActorInferWorker._rows, worker)
        self.worker = worker
        self.advance = Remote(lambda *a, **k: ActorInferWorker.advance(worker, *a, **k))


class FakeCluster:
    def __init__(self, ranks):
        self.workers, self.world_size = ranks, len(ranks)

    def call_async(self, rank, method, *args, **kwargs):
        return getattr(self.workers[rank], method).remote(*args, **kwargs)

    def gather(self, refs):
        return list(refs)


class FakeScorer:
    """Scores by the prompt's first character: even code -> every response 1 (no variance: the std
    filter drops the group), odd -> 0 and 1 alternating (kept)."""

    def score(self, batch):
        group = 2
        batch["scores"] = torch.tensor([1.0 if p[0] % 2 == 0 else float(i % group) for i, p in
                                        enumerate(batch["prompt_ids"])])

    def metrics(self, batch, prefix="reward"):
        return {}


def pooled_source(cfg, tokenizer, cluster, scorer):
    """The source the run plan of `cfg` (k >= 2) picks, connected to `cluster`'s ranks, scoring with `scorer`."""
    from pipelines.rlvr_pipeline import PooledPromptGroupSource, make_prompt_group_source
    from roll_gspo.config.plan.run_plan import build_run_plan

    source = make_prompt_group_source(cfg, tokenizer, build_run_plan(cfg))
    assert isinstance(source, PooledPromptGroupSource)
    source.connect(types.SimpleNamespace(actor_infer=cluster, rewards={}))
    source.scorer = scorer
    return source


def source_with_fakes(ranks=2):
    from roll_gspo.builtin.tokenizer import build_tokenizer

    cfg = load_config("example_gspo.yaml", K2_FILTERED)
    tokenizer = build_tokenizer()
    return pooled_source(cfg, tokenizer, FakeCluster([FakeRank(tokenizer, cfg) for _ in range(ranks)]), FakeScorer())


def run_steps(source, steps):
    out = []
    for step in range(1, steps + 1):
        rollout = source.produce(step, {}) if step == 1 else source.finish_ahead(source.start_ahead(step))
        out.append(rollout)
        for rank in source.actor_infer.workers:
            assert not rank.worker.strategy.unfinished()  # every advance ends with the cut
    return out


def test_pool_groups_are_filtered_and_refilled_under_the_same_weights():
    source = source_with_fakes()
    rollouts = run_steps(source, 3)
    for rollout in rollouts:
        batch, metrics = rollout.batch, rollout.metrics
        assert len(batch) == 4 * 2 and "scores" in batch
        kept_frac = metrics["data/kept_group_frac"]
        assert metrics["data/sampling_rounds"] >= 1 and 0 < kept_frac <= 1
        # Kept groups first; a cap hit tops up with dropped ones (as the synchronous path).
        informative = [bool(batch["scores"][i:i + 2].std() > 0) for i in range(0, len(batch), 2)]
        assert sum(informative) == round(kept_frac * 4)
        assert metrics["data/filter_cap_hit"] == float(kept_frac < 1)
        assert set(metrics) >= {"data/filtered_groups", "data/extra_prompts", "rollout/partial_groups",
                                "rollout/new_groups", "rollout/dropped_past_bound"}
        assert rollout.rewards.result() == {}  # scored already: nothing to start
    refilled = [r.metrics for r in rollouts if r.metrics["data/sampling_rounds"] > 1]
    assert refilled, [r.metrics for r in rollouts]
    for metrics in refilled:
        assert metrics["data/extra_prompts"] > 0
    # The refill rounds' prompts carry seeds of their own stream (not the first round's).
    seeds = [g.meta["sample_seed"] for rank in source.actor_infer.workers for g in rank.worker.pool.held]
    assert len(seeds) == len(set(seeds))


def test_filtered_pools_are_deterministic():
    first, second = (run_steps(source_with_fakes(), 3) for _ in range(2))
    for a, b in zip(first, second):
        assert a.metrics == b.metrics
        assert a.batch["response_ids"] == b.batch["response_ids"] and torch.equal(a.batch["scores"], b.batch["scores"])


def test_query_filter_is_accepted_with_k2():
    cfg = load_config("example_gspo.yaml", K2_FILTERED)
    assert cfg.rewards["math_rule"].query_filter_config.type == "std_filter" and cfg.async_generation_ratio == 2


def test_each_ranks_pool_is_k_quotas_of_its_own_at_an_uneven_split():
    """rollout_batch_size 5 on 2 rollout ranks: quotas 3 and 2, pools of 2 batches each 2 x its own
    quota (6 and 4; split apart they were 5 and 5, rank 1 holding 2.5 quotas, past the bound)."""
    from pipelines.sources import RewardFuture
    from roll_gspo.builtin.tokenizer import build_tokenizer

    cfg = load_config("example_gspo.yaml", ["async_generation_ratio=2", "rollout_batch_size=5",
                                            "num_return_sequences_in_group=2", "response_length=8",
                                            "actor_train.training_args.per_device_train_batch_size=5"])
    tokenizer = build_tokenizer()
    cluster = FakeCluster([FakeRank(tokenizer, cfg) for _ in range(2)])
    advanced = []
    call = cluster.call_async
    cluster.call_async = lambda rank, method, prompts, quota, *a, **k: (
        advanced.append((rank, len(prompts), quota)) or call(rank, method, prompts, quota, *a, **k))
    source = pooled_source(cfg, tokenizer, cluster, types.SimpleNamespace(future=lambda batch: RewardFuture.ready()))
    source.produce(1, {})
    assert advanced == [(0, 6, 3), (1, 4, 2)]
