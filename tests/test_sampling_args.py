"""Sampling uses exactly the YAML's generating_args: nothing from the model folder's
generation_config.json, no library defaults, and vLLM's reported log-probs are the trainer's
(full distribution) under top-p/top-k where that can be exact. Real transformers and vLLM."""
import json
import os
import shutil

import pytest
import torch

from roll_gspo.schema.config import GeneratingArgs, RoleConfig

# What a chat model's folder may ship (Qwen2.5-Instruct ships repetition_penalty 1.05, top_k 20,
# top_p 0.8, temperature 0.7), pushed to values whose effect cannot be missed.
HOSTILE_GENERATION_CONFIG = {"repetition_penalty": 5.0, "top_k": 1, "top_p": 0.05, "temperature": 0.05,
                             "no_repeat_ngram_size": 1, "min_new_tokens": 4, "do_sample": True,
                             "max_new_tokens": 2}


@pytest.fixture(scope="module")
def hostile_model(tiny_model, tmp_path_factory):
    """The tiny model's folder with a generation_config.json that would change sampling."""
    folder = str(tmp_path_factory.mktemp("hostile") / "model")
    shutil.copytree(tiny_model, folder)
    path = os.path.join(folder, "generation_config.json")
    with open(path) as handle:
        config = json.load(handle)
    config.update(HOSTILE_GENERATION_CONFIG)
    with open(path, "w") as handle:
        json.dump(config, handle)
    return folder


def role_for(folder, **generating):
    role = RoleConfig(infer_batch_size=64)
    role.model_args.model_name_or_path = folder
    role.generating_args = GeneratingArgs(**generating)
    return role


PROMPTS = [[20, 21, 15, 22], [23, 24, 15]]


def hf_samples(folder, gen, n):
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy

    strategy = HfInferStrategy(role_for(folder), seed=0)
    torch.manual_seed(123)
    return strategy.generate(PROMPTS, gen, n)


def test_hf_infer_ignores_the_model_folders_generation_config(tiny_model, hostile_model):
    gen = GeneratingArgs(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=-1)
    plain, hostile = hf_samples(tiny_model, gen, 4), hf_samples(hostile_model, gen, 4)
    assert [[s[0] for s in p] for p in hostile] == [[s[0] for s in p] for p in plain]
    assert [[s[1] for s in p] for p in hostile] == [[s[1] for s in p] for p in plain]
    assert any(len(s[0]) > 2 for p in hostile for s in p)  # the folder's max_new_tokens 2 is not used


def test_hf_infer_with_top_k_off_samples_the_whole_vocabulary(tiny_model):
    """top_k: -1 means no cut; transformers' own default (top_k 50) must not sneak in. The random
    tiny model is near uniform over ~100 tokens, so 600 draws of one token reach far beyond 50."""
    samples = hf_samples(tiny_model, GeneratingArgs(max_new_tokens=1, temperature=1.0, top_k=-1), 600)
    distinct = {s[0][0] for s in samples[0]}
    assert len(distinct) > 60, len(distinct)


def test_vllm_uses_only_the_yaml_and_reports_full_distribution_log_probs_under_top_p(tiny_model, hostile_model):
    """One in-process vLLM engine on the hostile folder, sampling at top_p 0.5 (temperature 1):
    no default comes from generation_config.json, and the sampled tokens' log-probs are the
    full-distribution ones the trainer scores (vLLM's processed log-probs would be renormalised
    over the nucleus: ~0.7 nats higher per token here)."""
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy
    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    gen = GeneratingArgs(max_new_tokens=6, temperature=1.0, top_p=0.5, top_k=-1)
    strategy = VllmStrategy(role_for(hostile_model, max_new_tokens=6, temperature=1.0, top_p=0.5),
                            max_model_len=32, seed=0)
    try:
        defaults = strategy.llm.get_default_sampling_params()
        assert (defaults.repetition_penalty, defaults.top_k, defaults.top_p, defaults.temperature) == (1.0, 0, 1.0, 1.0)
        samples = strategy.generate(PROMPTS, gen, 4)
    finally:
        del strategy
    responses = [s[0] for per_prompt in samples for s in per_prompt]
    engine_log_probs = [s[1] for per_prompt in samples for s in per_prompt]
    assert any(len(r) > 2 for r in responses)  # the folder's max_new_tokens 2 is not used
    prompts = [p for p in PROMPTS for _ in range(4)]
    trainer_log_probs = HfInferStrategy(role_for(tiny_model), seed=0).score(prompts, responses, temperature=1.0)
    for engine, trainer in zip(engine_log_probs, trainer_log_probs):
        assert torch.allclose(torch.tensor(engine), torch.tensor(trainer), atol=1e-3), (engine, trainer)


def test_hf_infer_greedy_gives_n_copies_of_the_greedy_response(tiny_model):
    """Greedy with n > 1 (e.g. validation.generating_args.num_return_sequences: 2 at temperature 0):
    transformers refuses num_return_sequences > 1 without sampling; vLLM returns n copies."""
    samples = hf_samples(tiny_model, GeneratingArgs(max_new_tokens=4, temperature=0.0), 3)
    assert [len(per_prompt) for per_prompt in samples] == [3, 3]
    for per_prompt in samples:
        assert all(s[0] == per_prompt[0][0] for s in per_prompt)


# --------------------------------------------------------------------------------------------
# hf_infer's own sampler applies temperature, top-k and top-p (transformers' warpers would run
# after it, on its one-hot row, so seeded rollouts used to sample softmax(raw logits)).
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (0, 1.0), (1, 1.0), (3, 1.0), (-1, 0.5), (-1, 0.9),
                                         (4, 0.7), (40, 1.0), (-1, 1e-6)])
def test_warp_logits_keeps_the_tokens_vllm_keeps(top_k, top_p):
    """Same cut as vLLM's own top-k/top-p (after the temperature); top_k -1/0 (or the whole
    vocabulary, 40 here) and top_p 1 are off."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from roll_gspo.strategies.hf_infer_strategy import warp_logits

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[0, :3] = logits[0, 3]  # a tie at the top-k boundary is kept whole
    ours = warp_logits(logits, 0.7, top_k, top_p)
    k = torch.full((6,), top_k) if top_k > 0 else None
    p = torch.full((6,), top_p, dtype=torch.float64) if top_p < 1.0 else None
    theirs = apply_top_k_top_p_pytorch(logits / 0.7, k, p)
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], logits[~ours.isinf()] / 0.7)
    assert (~ours.isinf()).any(dim=-1).all()  # the most likely token always stays


def test_warp_logits_hand_values():
    from roll_gspo.strategies.hf_infer_strategy import warp_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    kept = lambda **kw: (~warp_logits(logits, 1.0, **kw).isinf()).long().tolist()  # noqa: E731
    assert kept(top_k=2) == [[1, 1, 0, 0]]
    assert kept(top_p=0.75) == [[1, 1, 0, 0]]  # 0.5 + 0.3 reach 0.75, 0.5 alone does not
    assert kept(top_p=0.85) == [[1, 1, 1, 0]]
    assert kept(top_k=-1, top_p=1.0) == kept(top_k=0) == [[1, 1, 1, 1]]
    torch.testing.assert_close(warp_logits(logits, 0.5).softmax(-1), (logits * 2).softmax(-1))
    with pytest.raises(ValueError, match="greedy"):
        warp_logits(logits, 0.0)


def test_seeded_sampler_draws_from_the_tempered_truncated_distribution():
    """4000 rows (own seeds) of one tiny logit vector: token frequencies match softmax(logits / T)
    after the top-k cut within sampling noise."""
    from roll_gspo.strategies.hf_infer_strategy import PerRowSampler, warp_logits

    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0]])
    rows = 4000
    for temperature, top_k in ((0.5, -1), (2.0, -1), (1.0, 3)):
        sampler = PerRowSampler(range(rows), temperature, top_k, 1.0)
        chosen = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, -1).clone())
        assert torch.equal((chosen == 0).sum(-1), torch.ones(rows, dtype=torch.long))  # one token left per row
        frequencies = torch.bincount(chosen.argmax(-1), minlength=5).double() / rows
        expected = warp_logits(logits.double(), temperature, top_k).softmax(-1)[0]
        assert torch.allclose(frequencies, expected, atol=0.03), (temperature, top_k, frequencies, expected)
        if top_k > 0:
            assert frequencies[top_k:].sum() == 0


def seeded_hf_samples(folder, gen, n):
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy

    return HfInferStrategy(role_for(folder), seed=0).generate(PROMPTS, gen, n, seeds=[11, 12])


def test_seeded_hf_infer_at_low_temperature_samples_what_it_scores(tiny_model):
    """At temperature 0.05 the rollout's tokens are the tempered distribution's likely ones: the
    log-probs scored at 0.05 stay near 0 (the untempered sampler drew tokens at ~-20 nats)."""
    samples = seeded_hf_samples(tiny_model, GeneratingArgs(max_new_tokens=6, temperature=0.05), 4)
    log_probs = torch.tensor([lp for per_prompt in samples for s in per_prompt for lp in s[1]])
    assert len(log_probs) > 20
    assert log_probs.min() > -6 and log_probs.mean() > -1, log_probs


@pytest.mark.parametrize("cut", [{"top_k": 1}, {"top_p": 1e-3}])
def test_seeded_hf_infer_with_a_one_token_cut_is_greedy(tiny_model, cut):
    greedy = seeded_hf_samples(tiny_model, GeneratingArgs(max_new_tokens=6, temperature=0.0), 1)
    cut_samples = seeded_hf_samples(tiny_model, GeneratingArgs(max_new_tokens=6, temperature=1.0, **cut), 4)
    for per_prompt, (want, _, _) in zip(cut_samples, [p[0] for p in greedy]):
        assert [s[0] for s in per_prompt] == [want] * 4


# --------------------------------------------------------------------------------------------
# Seeded vLLM sampling whatever the prompt lengths (roll_gspo.config.plan.vllm_prefill): on CPU a
# prompt split over scheduler steps crashed seeded sampling (RuntimeError: CPU Generator does not
# use offset), so the CPU engine admits prompts whole.
# --------------------------------------------------------------------------------------------
def test_seeded_vllm_rollout_of_a_batch_beyond_the_engines_token_budget(tiny_model):
    """A token budget (max_num_batched_tokens 32) below the batch's prompt tokens (8 prompts x 2
    samples x 20 tokens): vLLM with chunked prefill split the second prompt and crashed; admitted
    whole, every sample depends on its seed alone: the same tokens from another batch order and
    from a prompt alone."""
    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    role = role_for(tiny_model)
    role.strategy_args.strategy_config = {"max_num_batched_tokens": 32}
    prompts = [[20 + (i * 7 + j) % 40 for j in range(20)] for i in range(8)]
    seeds = [1000 + 10 * i for i in range(8)]
    gen = GeneratingArgs(max_new_tokens=4, temperature=1.0)
    strategy = VllmStrategy(role, max_model_len=32, seed=0)
    try:
        tokens = lambda samples: [[s[0] for s in per_prompt] for per_prompt in samples]  # noqa: E731
        batch = tokens(strategy.generate(prompts, gen, 2, seeds=seeds))
        reversed_batch = tokens(strategy.generate(prompts[::-1], gen, 2, seeds=seeds[::-1]))[::-1]
        alone = tokens(strategy.generate(prompts[5:6], gen, 2, seeds=seeds[5:6]))
    finally:
        del strategy
    assert batch == reversed_batch and alone == batch[5:6], (batch, reversed_batch, alone)
    assert all(len(sample) == 4 for per_prompt in batch for sample in per_prompt)
    assert len({tuple(sample) for per_prompt in batch for sample in per_prompt}) > 8  # sampled, not all alike
