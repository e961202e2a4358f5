"""Rollout seeds: a function of (seed, step, prompt, sample), never of an engine's history."""
import torch

from roll_gspo.lifecycle.seeding import rollout_seeds, trainer_seed


def test_rollout_seeds_are_a_function_of_seed_step_and_position():
    assert rollout_seeds(1, 5, 4) == rollout_seeds(1, 5, 4)
    assert rollout_seeds(1, 5, 8)[:4] == rollout_seeds(1, 5, 4)
    assert len({*rollout_seeds(1, 5, 4), *rollout_seeds(1, 6, 4), *rollout_seeds(2, 5, 4),
                *rollout_seeds(1, 5, 4, "validation")}) == 16
    assert all(0 <= s < 2 ** 31 for s in rollout_seeds(7, 10 ** 9, 64))
    assert trainer_seed(1, 3, 0) != trainer_seed(1, 3, 1) != trainer_seed(1, 4, 1)


def test_hf_infer_samples_depend_on_the_seeds_alone(tmp_path, tiny_model):
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy
    from tests.test_pipeline_e2e import write_config

    cfg = write_config(tmp_path, tiny_model, actor_infer={"strategy_args": {"strategy_name": "hf_infer",
                                                                          "strategy_config": {}}})
    strategy = HfInferStrategy(cfg.actor_infer, seed=0)
    gen = cfg.actor_infer.generating_args
    prompts = [[20, 21, 15], [22, 23, 24, 15], [25, 15]]
    seeds = rollout_seeds(1, 3, len(prompts))
    torch.manual_seed(123)
    first = strategy.generate(prompts, gen, 4, seeds=seeds)
    torch.manual_seed(456)  # another global RNG state, and draws in between: the same samples
    strategy.generate(prompts, gen, 4, seeds=rollout_seeds(1, 2, len(prompts)))
    again = strategy.generate(prompts, gen, 4, seeds=seeds)
    assert first == again
    other = strategy.generate(prompts, gen, 4, seeds=rollout_seeds(1, 4, len(prompts)))
    assert [s[0] for p in other for s in p] != [s[0] for p in first for s in p]
    # A prompt's samples differ from each other (seed + i each), not one sample repeated.
    assert len({tuple(s[0]) for s in first[0]}) > 1
