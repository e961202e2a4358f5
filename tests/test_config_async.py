"""`async_generation_ratio` k >= 2 and `async_pool_batches` (request pools): what is accepted, and each
refusal, before any worker starts, naming the key (roll_gspo.config.checks.async_rollout)."""
import pytest

from roll_gspo.config import ConfigError, load_config
from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source
from roll_gspo.config.plan.run_plan import build_run_plan
from tests.config_helpers import config_log, warning_messages  # noqa: F401  (the fixture)

K2 = ["async_generation_ratio=2"]


def refusal(example, overrides):
    with pytest.raises(ConfigError) as info:
        load_config(example, overrides)
    return str(info.value)


def rollout_mode(example, overrides):
    """(rollout_depth, staleness_bound) of the example's run plan."""
    plan = build_run_plan(load_config(example, overrides))
    return plan.rollout_depth, plan.staleness_bound


@pytest.mark.parametrize("ratio, mode", [(0, (0, None)), (1, (1, None)), ("1.0", (1, None)), (2, (1, 2)), (3, (1, 3))])
def test_the_run_plan_decides_the_rollout_depth_and_the_bound_once(ratio, mode):
    """0: synchronous; 1 (1.0 is 1): one step ahead; k >= 2: one step ahead and a bound of k versions."""
    assert rollout_mode("example_gspo.yaml", [f"async_generation_ratio={ratio}"]) == mode


def test_k2_is_accepted_with_rollout_log_probs_or_trainer_with_a_correction():
    cfg = load_config("example_gspo.yaml", K2)
    assert build_run_plan(cfg).staleness_bound == 2 and cfg.async_pool_batches == 2.0
    assert choose_old_logprob_source(cfg).source == "rollout"
    decoupled = load_config("example_gspo.yaml", K2 + ["old_logprob_source=trainer",
                                                       "train_infer_correction.is_weight.enabled=true"])
    assert choose_old_logprob_source(decoupled).source == "trainer"


@pytest.mark.parametrize("overrides, expected", [
    (["async_generation_ratio=-1"], "async_generation_ratio = -1.0 is refused"),
    (["async_generation_ratio=2.5"], "async_generation_ratio = 2.5 is refused"),
    (K2 + ["old_logprob_source=trainer"], "old_logprob_source: trainer and no rollout correction"),
    (K2 + ["router_replay=true"], "with router_replay is refused"),
    (K2 + ["is_offload_states=true"], "put to sleep between phases"),
    (K2 + ["model_update_frequency=2"], "model_update_frequency = 2 is refused"),
    (K2 + ["async_pool_batches=0.5"], "async_pool_batches = 0.5 is refused"),
])
def test_k2_refusals_name_the_key(overrides, expected):
    message = refusal("example_gspo.yaml", overrides)
    assert expected in message, message


def test_agentic_runs_take_both_modes_but_an_agents_episodes_are_refused():
    assert rollout_mode("example_agentic.yaml", K2) == (1, 2)
    assert choose_old_logprob_source(load_config("example_agentic.yaml", ["async_generation_ratio=1"])).source == \
        "rollout"
    for overrides in (K2, ["async_generation_ratio=1"]):
        message = refusal("example_agent.yaml", overrides)
        assert "with an agent's episodes (agent.agent_func) is not built" in message, message
    message = refusal("example_agentic.yaml", K2 + ["rollout_endpoint.enabled=true"])
    assert "rollout_endpoint is not built for agentic runs" in message, message


def test_pool_key_without_k2_warns(config_log):  # noqa: F811
    load_config("example_gspo.yaml", ["async_pool_batches=3"])
    assert any("async_pool_batches acts only with async_generation_ratio >= 2" in m
               for m in warning_messages(config_log))
