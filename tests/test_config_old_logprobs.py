"""Where the old log-probs come from (old_logprob_source): rollout log-probs refused where they are
not the trainer's, `auto`'s choice and the measured gap it follows, the engine's logprobs_mode,
sampling defaults from a model folder refused. Fast: no Ray, no model loading."""
import pytest

from tests.config_helpers import load, problems, warning_messages
from tests.config_helpers import config_log  # noqa: F401  (the fixture)


# --------------------------------------------------------------------------------------------
# Rollout log-probs and old_logprob_source
# --------------------------------------------------------------------------------------------
ROLLOUT = ["old_logprob_source=rollout"]


@pytest.mark.parametrize("overrides", [
    ROLLOUT + ["actor_infer.generating_args.top_p=0.9", "actor_infer.generating_args.temperature=0.7"],
    ROLLOUT + ["actor_infer.generating_args.top_k=20", "actor_infer.generating_args.temperature=0.7"],
    ROLLOUT + ["+actor_infer.strategy_args.strategy_config.logprobs_mode=processed_logprobs"],
])
def test_rollout_log_probs_that_are_not_the_trainers_are_refused(tmp_path, overrides):
    message = problems(tmp_path, overrides=overrides)
    assert "old_logprob_source: rollout would bias every importance ratio" in message
    assert "old_logprob_source: trainer" in message  # the way out


@pytest.mark.parametrize("overrides, exact", [
    (ROLLOUT + ["actor_infer.generating_args.top_p=0.9"], True),             # temperature 1: raw log-probs
    (ROLLOUT + ["actor_infer.generating_args.temperature=0.7"], True),       # no cut: processed log-probs
    (ROLLOUT + ["actor_infer.generating_args.top_p=0.9", "actor_infer.generating_args.temperature=0.7",
                "actor_infer.strategy_args.strategy_name=hf_infer"], True),  # hf_infer re-scores
    (ROLLOUT + ["actor_infer.model_args.dtype=bf16"], False),                # allowed, but not exact
])
def test_exact_rollout_log_probs_are_accepted(tmp_path, overrides, exact):
    from roll_gspo.config.plan.engine_logprobs import rollout_logprobs_are_exact

    cfg = load(tmp_path, overrides=overrides)
    ok, reason = rollout_logprobs_are_exact(cfg)
    assert ok == exact and (ok or "bf16" in reason)


AUTO_CASES = [  # (overrides, moe, source, a fragment of the reason)
    ([], False, "rollout", "forward pass is skipped"),  # the seed block: seq ratio, fp32 vLLM at temperature 1
    (["actor_infer.generating_args.top_p=0.9"], False, "rollout", "forward pass is skipped"),  # raw log-probs
    (["actor_infer.generating_args.temperature=0.7"], False, "rollout", "forward pass is skipped"),  # processed
    (["importance_sampling=gspo-token"], False, "rollout", "forward pass is skipped"),  # the sequence ratio
    (["actor_infer.strategy_args.strategy_name=hf_infer", "actor_infer.generating_args.top_p=0.9",
      "actor_infer.generating_args.temperature=0.7"], False, "rollout", "hf_infer"),  # re-scored exactly
    (["actor_infer.generating_args.top_p=0.9", "actor_infer.generating_args.temperature=0.7"], False, "trainer",
     "never the full distribution"),
    (["+actor_infer.strategy_args.strategy_config.logprobs_mode=raw_logprobs"], False, "trainer", "overrides"),
    (["actor_infer.model_args.dtype=bf16"], False, "trainer", "until a step measures a mean gap below"),
    (["actor_train.model_args.dtype=bf16", "old_logprob_auto_max_gap=0"], False, "trainer", "outside fp32"),
    # token ratios: in fp32 each token's engine mismatch is ~1e-6 against a 0.2 clip; in bf16 it is not averaged
    (["importance_sampling=token", "pg_clip_low=0.2", "pg_clip_high=0.28"], False, "rollout", "forward pass is skipped"),
    (["importance_sampling=token", "pg_clip_low=0.2", "pg_clip_high=0.28", "actor_infer.model_args.dtype=bf16"], False,
     "trainer", "importance_sampling: token"),
    (["router_replay=true"], True, "trainer", "router_replay"),
    ([], True, "trainer", "Mixture-of-Experts"),
    (["model_update_frequency=2"], False, "trainer", "stale weights"),
    (["old_logprob_source=trainer"], False, "trainer", "in the config"),
    (["old_logprob_source=rollout", "importance_sampling=token", "pg_clip_low=0.2", "pg_clip_high=0.28"], False,
     "rollout", "in the config"),  # explicit wins (and warns)
]


@pytest.mark.parametrize("overrides, moe, source, reason", AUTO_CASES)
def test_old_logprob_source_auto_takes_rollout_log_probs_only_where_exact_and_unneeded(
        tmp_path, overrides, moe, source, reason):
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    cfg = load(tmp_path, overrides=overrides)
    choice = choose_old_logprob_source(cfg, model_is_moe=moe)
    assert (choice.source, reason in choice.reason) == (source, True), choice.reason


def test_old_logprob_source_auto_outside_fp32_follows_the_measured_gap(tmp_path):
    """bf16: the trainer's old log-probs until a step's gap is below the threshold (default a
    tenth of pg_clip_low), then the rollout engine's, and back when the gap grows again."""
    from types import SimpleNamespace

    from pipelines.trainer_loop import TrainerLoop
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    cfg = load(tmp_path, overrides=["actor_infer.model_args.dtype=bf16", "pg_clip_low=3e-3"])
    choice = choose_old_logprob_source(cfg)
    assert (choice.source, choice.max_gap) == ("trainer", pytest.approx(3e-4))
    pipeline = SimpleNamespace(old_logprobs=choice)
    sources = []
    for step, gap in enumerate([2e-2, 1e-4, None, 2e-4, 5e-4, 4e-4], start=1):
        TrainerLoop._follow_logprob_gap(pipeline, step, gap)
        sources.append(pipeline.old_logprobs.source)
    assert sources == ["trainer", "rollout", "rollout", "rollout", "trainer", "trainer"]
    assert "5e-04" in pipeline.old_logprobs.reason or "0.0005" in pipeline.old_logprobs.reason
    assert choose_old_logprob_source(load(tmp_path, overrides=["actor_infer.model_args.dtype=bf16",
                                                               "old_logprob_auto_max_gap=0"])).max_gap is None
    assert "old_logprob_auto_max_gap must be >= 0" in problems(tmp_path, overrides=["old_logprob_auto_max_gap=-1"])


def test_old_logprob_source_defaults_to_auto_and_router_replay_is_refused_only_with_rollout(tmp_path):
    assert load(tmp_path).old_logprob_source == "auto"
    assert load(tmp_path, overrides=["router_replay=true"]).router_replay  # auto: the trainer's pass
    assert "it needs old_logprob_source: trainer" in problems(
        tmp_path, overrides=["router_replay=true", "old_logprob_source=rollout"])


def test_folder_is_moe_reads_the_models_config(tmp_path):
    from transformers import Qwen2Config, Qwen3MoeConfig

    from roll_gspo.models.moe_routing import folder_is_moe

    Qwen2Config(hidden_size=32, num_hidden_layers=1).save_pretrained(tmp_path / "dense")
    Qwen3MoeConfig(hidden_size=32, num_hidden_layers=1, num_experts=4).save_pretrained(tmp_path / "moe")
    assert not folder_is_moe(str(tmp_path / "dense")) and folder_is_moe(str(tmp_path / "moe"))


def test_async_generation_with_auto_takes_rollout_log_probs_or_is_refused(tmp_path):
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    cfg = load(tmp_path, overrides=["async_generation_ratio=1", "actor_infer.model_args.dtype=bf16"])
    choice = choose_old_logprob_source(cfg, model_is_moe=True)  # neither bf16 nor an MoE brings the trainer's
    assert (choice.source, choice.max_gap) == ("rollout", None) and "async_generation_ratio" in choice.reason
    assert "needs the rollout engine's old log-probs" in problems(
        tmp_path, overrides=["async_generation_ratio=1", "router_replay=true"])
    assert "would bias every ratio" in problems(
        tmp_path, overrides=["async_generation_ratio=1", "actor_infer.generating_args.top_p=0.9",
                             "actor_infer.generating_args.temperature=0.7"])


# --------------------------------------------------------------------------------------------
# The engine's log-probs and sampling keys
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("generating, mode", [
    ({}, "processed_logprobs"), ({"temperature": 0.6}, "processed_logprobs"),
    ({"top_p": 0.9}, "raw_logprobs"), ({"top_k": 20, "temperature": 0.0}, "raw_logprobs"),
    ({"top_p": 0.9, "temperature": 0.6}, "processed_logprobs"),  # no exact mode: refused with rollout
])
def test_vllm_engine_args_pick_the_log_probs_the_trainer_scores_and_ignore_generation_config(generating, mode):
    from roll_gspo.schema.config import GeneratingArgs, RoleConfig
    from roll_gspo.strategies.vllm_strategy import vllm_engine_args

    role = RoleConfig(generating_args=GeneratingArgs(**generating))
    args = vllm_engine_args(role, max_model_len=32, seed=0)
    assert args["logprobs_mode"] == mode and args["generation_config"] == "vllm"


@pytest.mark.parametrize("key", ["+actor_infer.strategy_args.strategy_config.generation_config=auto",
                                 "+actor_infer.strategy_args.strategy_config.override_generation_config={top_k: 5}"])
def test_sampling_defaults_from_the_model_folder_are_refused(tmp_path, key):
    assert "sampling comes from actor_infer.generating_args only" in problems(tmp_path, overrides=[key])


def test_logprobs_mode_override_with_trainer_log_probs_warns(tmp_path, config_log):
    load(tmp_path, overrides=["+actor_infer.strategy_args.strategy_config.logprobs_mode=raw_logits"])
    assert any("logprobs_mode = 'raw_logits' only changes the logged rollout/logprob_gap" in m
               for m in warning_messages(config_log))
