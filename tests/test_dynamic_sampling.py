"""Dynamic sampling (ROLL's query_filter_config) and domain_interleave_probs: the filters, the
per-domain sampler, and a pipeline run where half the prompts are always solved."""
import json
import math

import pytest
import torch

from roll_gspo.algorithms.query_filter import keep_groups
from roll_gspo.data.prompts import PromptSampler, allot


def test_filters_keep_what_roll_keeps():
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.6])
    assert keep_groups(scores, 4, "std_filter", {"std_threshold": 0}).tolist() == [False, True, False, True]
    assert keep_groups(scores, 4, "std_filter", {}).tolist() == [True] * 4  # default -1: keeps all
    assert keep_groups(scores, 4, "mean_filter", {"threshold_up": 1.0, "threshold_down": 0.0}).tolist() == \
        [False, True, False, True]
    assert keep_groups(scores, 4, "mean_filter", {"threshold_up": 0.9}).tolist() == [False, True, True, True]
    assert keep_groups(scores, 4, "no_filter", {}).all()


def test_allot_splits_exactly_by_largest_remainder():
    assert allot(8, {"math": 0.75, "code": 0.25}) == {"math": 6, "code": 2}
    assert allot(4, {"a": 1, "b": 1, "c": 1}) == {"a": 2, "b": 1, "c": 1}
    assert sum(allot(7, {"a": 0.2, "b": 0.3, "c": 0.5}).values()) == 7


def test_domain_interleave_probs_mix_every_batch_and_resume():
    items = [{"i": i, "domain": "a"} for i in range(10)] + [{"i": 100 + i, "domain": "b"} for i in range(3)]
    sampler = PromptSampler(items, 4, seed=3, domain_probs={"a": 0.75, "b": 0.25})
    for _ in range(5):  # b has 3 prompts: it wraps into new epochs, the mix holds
        assert sorted(x["domain"] for x in sampler.next_batch()) == ["a", "a", "a", "b"]
    assert [x["domain"] for x in sampler.next_batch(per_domain={"b": 2})] == ["b", "b"]
    state = json.loads(json.dumps(sampler.state_dict()))
    expected = [sampler.next_batch() for _ in range(3)]
    again = PromptSampler(items, 4, seed=3, domain_probs={"a": 0.75, "b": 0.25})
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(3)] == expected
    with pytest.raises(ValueError, match="domain_interleave_probs changed"):
        PromptSampler(items, 4, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"no training prompt belongs to it"):
        PromptSampler(items, 4, domain_probs={"a": 0.5, "c": 0.5})


def test_query_filter_keys_are_checked(tmp_path):
    from omegaconf import OmegaConf

    from roll_gspo.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    OmegaConf.save(OmegaConf.create({
        "actor_train": {"data_args": {"file_name": ["builtin:arith/train"], "domain_interleave_probs": {"mth": 1.0}}},
        "rewards": {"math_rule": {"query_filter_config": {"type": "std_filter", "filter_args": {"std_thresh": 0}}}}}), path)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    message = str(err.value)
    assert "rewards.math_rule.query_filter_config.filter_args: ['std_thresh'] do nothing with type 'std_filter'" in message
    assert "domain_interleave_probs: ['mth'] are not reward domains" in message


@pytest.mark.e2e
def test_dynamic_sampling_trains_only_informative_groups(tmp_path, tiny_model, ray_session, monkeypatch):
    from pipelines.rlvr_pipeline import PromptGroupSource
    from tests.test_pipeline_e2e import run, write_config

    rows = []
    for i in range(16):  # two domains; in each, every other prompt is always solved
        answer = str(i % 10 + 1)
        rows.append({"prompt": f"{i % 10}+1=", "ground_truth": ("s" + answer) if i % 2 else answer,
                     "domain": "a" if i < 8 else "b"})
    data = tmp_path / "half_solved.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = {"worker_cls": "roll_gspo.workers.rewards.FunctionRewardWorker", "reward_fn": "tests.reward_fns:half_solved",
              "num_cpus_per_worker": 0.25, "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0}}}
    cfg = write_config(tmp_path, tiny_model, query_filter_max_rounds=12,
                       actor_train={"world_size": 1, "data_args": {"file_name": [str(data)], "domain_interleave_probs": {"a": 0.75, "b": 0.25}}},
                       rewards={"a": reward, "b": reward}, validation={"data_args": {"file_name": []}})
    cfg.rewards.pop("math_rule", None)
    rounds, trained = [], []
    keep = PromptGroupSource._groups_to_keep
    advantages = PromptGroupSource.advantages

    def record_rounds(self, batch):
        kept = keep(self, batch)
        group = cfg.num_return_sequences_in_group
        rounds.append([(d, bool(k), float(batch["scores"][i * group:(i + 1) * group].std()))
                       for i, (d, k) in enumerate(zip(batch["domain"][::group], kept))])
        return kept

    def record_trained(self, batch):
        trained.append((list(batch["domain"]), batch["scores"].clone()))
        return advantages(self, batch)

    monkeypatch.setattr(PromptGroupSource, "_groups_to_keep", record_rounds)
    monkeypatch.setattr(PromptGroupSource, "advantages", record_trained)
    records = [r for r in run(cfg) if "data/filtered_groups" in r]
    assert [r["step"] for r in records] == [1, 2]
    group = cfg.num_return_sequences_in_group
    for domains, scores in trained:  # the trained batch: full, the 3:1 mix, no zero-variance group
        assert len(domains) == cfg.rollout_batch_size * group
        assert sorted(domains[::group]) == ["a", "a", "a", "b"]
        assert (scores.view(-1, group).std(dim=1) > 0).all()
    # Every dropped group was a zero-variance one, and the metric counts exactly those.
    dropped = [g for step_rounds in rounds for g in step_rounds if not g[1]]
    assert dropped and all(std == 0 for _, _, std in dropped)
    assert sum(r["data/filtered_groups"] for r in records) == len(dropped)
    assert all(r["data/extra_prompts"] == r["data/filtered_groups"] and r["data/filter_cap_hit"] == 0 for r in records)
    assert all(math.isfinite(r["actor/pg_loss"]) for r in records)
