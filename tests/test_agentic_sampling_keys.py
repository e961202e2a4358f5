"""An agentic run samples its training episodes with train_env_manager's
generating_args while the trainer, the reference, vLLM's logprobs_mode, the exactness of the rollout
log-probs and the endpoint read actor_infer's. The two are one set: a key written on one side only is
taken by the other, a key written on both sides with two values is refused naming both."""
import pytest

from roll_gspo.config import ConfigError, load_config
from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

from pipelines.endpoint import endpoint_sampling


@pytest.mark.parametrize("override", ["train_env_manager.generating_args.temperature=0.7",
                                      "train_env_manager.generating_args.top_p=0.8"])
def test_a_training_manager_key_differing_from_actor_infers_is_refused(override):
    """example_agentic.yaml writes actor_infer's temperature and top_p; a different value for the
    training episodes would start every GSPO ratio off 1 (measured 0.868-1.306 at theta = theta_old)."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config("example_agentic.yaml", [override])
    message = str(info.value)
    assert key in message and f"actor_infer.generating_args.{key.rsplit('.', 1)[1]}" in message


def test_a_key_written_for_the_training_episodes_only_is_actor_infers_too():
    """ROLL's own agentic YAMLs write sampling under train_env_manager only: actor_infer takes it, so
    every consumer reads what the episodes sample with; validation keeps its own."""
    cfg = load_config("example_agentic.yaml", ["~actor_infer.generating_args",
                                               "train_env_manager.generating_args.temperature=0.7",
                                               "train_env_manager.generating_args.top_p=0.8",
                                               "val_env_manager.generating_args.temperature=0.0"])
    infer, train = cfg.actor_infer.generating_args, cfg.train_env_manager.generating_args
    assert (infer.temperature, infer.top_p) == (train.temperature, train.top_p) == (0.7, 0.8)
    assert cfg.val_env_manager.generating_args.temperature == 0.0
    sampling = endpoint_sampling(cfg)  # agents through the endpoint sample with it too
    assert (sampling.temperature, sampling.top_p) == (0.7, 0.8)
    # top_p < 1 at T 0.7: no vLLM logprobs_mode gives the trainer's quantity, so auto scores itself
    # (before: actor_infer's T 1 / top_p 1 called the rollout's log-probs exact)
    choice = choose_old_logprob_source(cfg)
    assert choice.source == "trainer" and "top_p = 0.8" in choice.reason, choice.reason


def test_a_key_written_for_actor_infer_only_is_the_training_episodes_too():
    cfg = load_config("example_agentic.yaml", ["actor_infer.generating_args.top_k=20",
                                               "actor_infer.generating_args.temperature=1.0"])
    assert cfg.train_env_manager.generating_args.top_k == 20
