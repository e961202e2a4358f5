"""PPO with a critic (`adv_estimator: gae`): the driver's GAE wiring (token rewards, KL, masks,
warm-up), the value model's alignment with the log-probs, the config's refusals, and one small
end-to-end run that resumes exactly."""
import json
import math
import os
import shutil

import pytest
import torch

from roll_gspo.config import ConfigError, load_config
from roll_gspo.schema.config import PipelineConfig, RoleConfig
from roll_gspo.distributed.batch import Batch

from pipelines.critic import actor_trains, gae_advantages_and_returns
from tests.test_roll_recipes import in_roll_dir, model_folder  # noqa: F401  (fixtures)


def ppo_config(**changes) -> PipelineConfig:
    cfg = PipelineConfig(adv_estimator="gae", importance_sampling="token", num_return_sequences_in_group=2,
                         whiten_advantages=False, gamma=1.0, lambd=1.0, critic=RoleConfig())
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def gae_batch(values=None):
    """Two responses of 3 and 1 tokens (widths 3), scores 1 and 0.5."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return Batch({"scores": torch.tensor([1.0, 0.5]), "response_mask": mask,
                  "values": torch.zeros(2, 3) if values is None else values})


# --------------------------------------------------------------------------------------------
# The driver's GAE wiring
# --------------------------------------------------------------------------------------------
def test_sequence_reward_lands_on_the_last_response_token():
    batch = gae_batch()
    gae_advantages_and_returns(ppo_config(gamma=0.5), batch, None)
    # gamma 0.5, lambda 1, values 0: A_t = 0.5^(steps to the last token) * reward; 0 past the response.
    expected = torch.tensor([[0.25, 0.5, 1.0], [0.5, 0.0, 0.0]])
    assert torch.allclose(batch["advantages"], expected)
    assert torch.allclose(batch["returns"], expected)  # values 0: returns = advantages


def test_values_are_subtracted_and_ignored_past_the_response():
    garbage = torch.tensor([[0.2, 0.4, 0.6], [0.3, float("nan"), 99.0]])  # past row 1's token: not read
    batch = gae_batch(garbage)
    gae_advantages_and_returns(ppo_config(lambd=0.0), batch, None)
    # lambda 0: A_t = r_t + V_{t+1} - V_t (the one-step TD error); returns = A + V.
    expected = torch.tensor([[0.4 - 0.2, 0.6 - 0.4, 1.0 - 0.6], [0.5 - 0.3, 0.0, 0.0]])
    assert torch.allclose(batch["advantages"], expected)
    assert torch.allclose(batch["returns"], torch.tensor([[0.4, 0.6, 1.0], [0.5, 0.0, 0.0]]))
    assert torch.isfinite(batch["advantages"]).all()


def test_token_level_kl_is_subtracted_from_every_token_reward():
    batch = gae_batch()
    batch["old_log_probs"] = torch.tensor([[0.0, -1.0, -2.0], [-1.0, 5.0, 5.0]])
    batch["ref_log_probs"] = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])  # kl [[1, 0, -1], [0, ., .]]
    metrics = gae_advantages_and_returns(ppo_config(add_token_level_kl=True, init_kl_coef=0.1), batch, None)
    # gamma = lambda = 1, values 0: A_t = sum of the token rewards from t on.
    rewards = torch.tensor([[-0.1, 0.0, 1.0 + 0.1], [0.5, 0.0, 0.0]])
    expected = rewards.flip(-1).cumsum(-1).flip(-1) * batch["response_mask"]
    assert torch.allclose(batch["advantages"], expected)
    assert metrics["critic/kl_penalty_mean"] == pytest.approx(0.0)  # (1 + 0 - 1 + 0) / 4


def test_whitening_and_metrics():
    batch = gae_batch(torch.full((2, 3), 0.25))
    metrics = gae_advantages_and_returns(ppo_config(whiten_advantages=True), batch, None)
    valid = batch["advantages"][batch["response_mask"].bool()]
    assert abs(float(valid.mean())) < 1e-5 and float(valid.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    assert metrics["critic/values_mean"] == pytest.approx(0.25)
    # returns (the critic's targets) are GAE's before whitening
    assert metrics["critic/returns_mean"] == pytest.approx(float(batch["returns"][batch["response_mask"].bool()].mean()))


def test_actor_waits_for_critic_warmup():
    cfg = ppo_config(critic_warmup=2)
    assert [actor_trains(cfg, step) for step in (1, 2, 3, 4)] == [False, False, True, True]
    assert actor_trains(PipelineConfig(critic_warmup=2), 1)  # no critic: the warm-up does not apply


# --------------------------------------------------------------------------------------------
# The value model
# --------------------------------------------------------------------------------------------
def test_value_model_is_the_policy_body_with_a_head_and_aligns_with_log_probs(tiny_model):
    from roll_gspo.models.causal_lm import build_sequences, load_causal_lm
    from roll_gspo.models.value_model import load_value_model
    from roll_gspo.workers.critic import batch_values

    policy, critic = load_causal_lm(tiny_model), load_value_model(tiny_model)
    body = policy.state_dict()
    own = critic.state_dict()
    assert sorted(k for k in own if k not in body) == ["score.bias", "score.weight"]
    assert all(torch.equal(own[k], body[k]) for k in own if k in body)
    ids, attention, prompt_lengths, response_mask = build_sequences([[5, 6, 7], [5, 6]], [[8, 9], [8, 9, 10]], 0)
    batch = Batch({"input_ids": ids, "attention_mask": attention, "prompt_lengths": prompt_lengths,
                   "response_mask": response_mask})
    with torch.no_grad():
        values = batch_values(critic, batch)
        per_position = critic(input_ids=ids, attention_mask=attention).logits[..., 0]
    assert values.shape == response_mask.shape == (2, 3)
    # Response token t's value is read where its log-prob is: the position predicting it, prompt_len - 1 + t.
    assert torch.allclose(values[0, :2], per_position[0, 2:4])
    assert torch.allclose(values[1, :3], per_position[1, 1:4])


# --------------------------------------------------------------------------------------------
# Config checks
# --------------------------------------------------------------------------------------------
PPO_YAML = """\
pretrain: builtin:tiny-arith
adv_estimator: gae
importance_sampling: token
rollout_batch_size: 4
num_return_sequences_in_group: 4
prompt_length: 16
response_length: 8
max_steps: 4
pg_clip_low: 0.2
pg_clip_high: 0.28
actor_train:
  training_args: {per_device_train_batch_size: 8, gradient_accumulation_steps: 1}
  data_args: {file_name: [builtin:arith/train]}
  world_size: 1
critic:
  training_args: {learning_rate: 1.0e-3, per_device_train_batch_size: 8, gradient_accumulation_steps: 1}
  strategy_args: {strategy_name: deepspeed_train}
"""


def load_ppo(tmp_path, text=PPO_YAML, overrides=()):
    path = tmp_path / "ppo.yaml"
    path.write_text(text)
    return load_config(str(path), list(overrides))


def refusal(tmp_path, text=PPO_YAML, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_ppo(tmp_path, text, overrides)
    return str(info.value)


def test_ppo_config_loads_with_the_critic_following_pretrain(tmp_path):
    cfg = load_ppo(tmp_path, overrides=["value_clip=0.2"])
    assert cfg.uses_critic() and cfg.critic.model_args.model_name_or_path == "builtin:tiny-arith"
    assert (cfg.gamma, cfg.lambd, cfg.critic_warmup) == (1.0, 0.95, 0)


def test_gae_without_a_critic_and_a_critic_without_gae_are_refused(tmp_path):
    without = PPO_YAML.split("critic:")[0]
    assert "adv_estimator: gae needs a `critic` block" in refusal(tmp_path, without)
    assert "critic: the block is set but adv_estimator is 'grpo'" in refusal(tmp_path, overrides=["adv_estimator=grpo"])


def test_sequence_ratio_with_gae_is_refused_with_the_reason(tmp_path):
    message = refusal(tmp_path, overrides=["importance_sampling=seq"])
    assert "importance_sampling: seq with adv_estimator: gae is refused" in message
    assert "averaged away" in message and "importance_sampling: token" in message and "gspo-token" in message


def test_unset_importance_sampling_becomes_token_with_gae(tmp_path, caplog):
    text = PPO_YAML.replace("importance_sampling: token\n", "")
    with caplog.at_level("WARNING"):
        cfg = load_ppo(tmp_path, text)
    assert cfg.importance_sampling == "token" and "importance_sampling not set: token" in caplog.text


@pytest.mark.parametrize("override, message", [
    ("critic_warmup=4", "critic_warmup = 4 >= max_steps = 4"),
    ("gamma=1.5", "gamma: must be in [0, 1], got 1.5"),
    ("lambd=-0.1", "lambd: must be in [0, 1], got -0.1"),
    ("critic.strategy_args.strategy_name=hf_infer", "critic.strategy_args.strategy_name: the critic trains"),
    ("critic.training_args.per_device_train_batch_size=3", "not divisible by the critic's mini-batch"),
    ("+critic.generating_args.temperature=0.5", "critic.generating_args.temperature = 0.5 is never read"),
])
def test_bad_ppo_keys_are_refused_by_name(tmp_path, override, message):
    assert message in refusal(tmp_path, overrides=[override])


def test_value_clip_warns_only_without_a_critic(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        load_ppo(tmp_path, overrides=["value_clip=0.2"])
    assert "value_clip = 0.2 has no effect" not in caplog.text


def test_dry_run_plans_the_critic_like_a_trainer(tmp_path, capsys, session_cache):
    from roll_gspo.cli import main

    path = tmp_path / "ppo.yaml"
    path.write_text(PPO_YAML)
    assert main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "critic 1 x" in out  # placed
    assert "critic (DeepSpeed ZeRO-0, fp32, micro-batch 8 x 24 tokens)" in out  # its memory counted


# --------------------------------------------------------------------------------------------
# End to end: two steps with a critic (the actor after one warm-up step), resumed exactly
# --------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_ppo_trains_the_critic_and_resumes_exactly(tmp_path, tiny_model, ray_session):
    from pipelines.rlvr_pipeline import run_rlvr
    from tests.test_pipeline_e2e import write_config

    def ppo(**changes):
        return write_config(tmp_path, tiny_model, adv_estimator="gae", importance_sampling="token",
                            pg_clip_low=0.2, pg_clip_high=0.28, loss_agg_mode="token-mean", critic_warmup=1,
                            value_clip=0.5, save_steps=1, max_steps=2, whiten_advantages=True,
                            critic={"training_args": {"learning_rate": 1e-3, "per_device_train_batch_size": 8,
                                                      "gradient_accumulation_steps": 1},
                                    "strategy_args": {"strategy_name": "deepspeed_train"},
                                    "num_cpus_per_worker": 0.25, "infer_batch_size": 16}, **changes)

    cfg = ppo()
    run_rlvr(cfg)
    path = os.path.join(cfg.output_dir, "metrics.jsonl")
    first = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in first] == [1, 2]
    assert "actor/pg_loss" not in first[0] and "actor/pg_loss" in first[1]  # critic_warmup: 1
    for record in first:
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/returns_mean",
                    "critic/values_mean", "critic/grad_norm", "critic/lr"):
            assert record.get(key) is not None and math.isfinite(record[key]), key
    assert os.path.isdir(os.path.join(cfg.output_dir, "checkpoints", "step_1", "critic"))
    # Step 2 again from step 1's checkpoint (actor, critic, data): the same numbers.
    shutil.rmtree(os.path.join(cfg.output_dir, "checkpoints", "step_2"))
    shutil.rmtree(os.path.join(cfg.output_dir, "final_model"))
    run_rlvr(ppo(resume_from_checkpoint="auto"))
    again = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in again] == [1, 2]
    for key in ("reward/mean", "critic/values_mean", "critic/vf_loss", "critic/vpred_mean", "critic/advantages_mean",
                "actor/pg_loss", "actor/clipfrac"):
        assert again[1][key] == pytest.approx(first[1][key], rel=1e-6, abs=1e-7), key


# --------------------------------------------------------------------------------------------
# ROLL's full-options recipe as PPO: its keys with adv_estimator gae and a critic block in ROLL's form
# --------------------------------------------------------------------------------------------
ROLL_CRITIC_BLOCK = ("+critic={model_args: {disable_gradient_checkpointing: false, dtype: bf16, model_type: trl}, "
                     "training_args: {learning_rate: 1.0e-5, weight_decay: 0, per_device_train_batch_size: 2, "
                     "gradient_accumulation_steps: 32, warmup_steps: 20}, data_args: {template: qwen2_5}, "
                     "strategy_args: {strategy_name: deepspeed_train, strategy_config: null}, "
                     "device_mapping: 'list(range(8,16))', infer_batch_size: 4}")


def test_roll_total_options_recipe_as_ppo_passes_dry_run(tmp_path, in_roll_dir, model_folder):
    from roll_gspo.cli import main
    from tests.test_roll_recipes import ROLL_DIR, model_overrides

    recipe = ROLL_DIR / "recipes" / "example_total_rl_options.yaml"
    over = model_overrides(recipe, model_folder) + ["adv_estimator=gae", ROLL_CRITIC_BLOCK]
    assert main(["--config", str(recipe), "--dry-run", "--nodes", "2", "--gpus-per-node", "8", *over]) == 0
    cfg = load_config(str(recipe), over)
    assert cfg.uses_critic() and cfg.importance_sampling == "token"  # ROLL's default ratio, not GSPO's
    assert cfg.critic.device_mapping == list(range(8, 16)) and cfg.critic.world_size == 8


@pytest.mark.e2e
def test_roll_total_options_recipe_as_ppo_trains_two_steps_on_cpu(tmp_path, session_cache, ray_session, monkeypatch):
    from tests.test_roll_recipes import ROLL_DIR, recipe_cpu_overrides, run_recipe

    recipe = ROLL_DIR / "recipes" / "example_total_rl_options.yaml"
    over = recipe_cpu_overrides(recipe, tmp_path) + [
        "adv_estimator=gae", ROLL_CRITIC_BLOCK, "critic.device_mapping=null", "critic.model_args.dtype=fp32",
        "critic.training_args.gradient_accumulation_steps=5", "critic.num_cpus_per_worker=0.25"]
    assert run_recipe(["--config", recipe.relative_to(ROLL_DIR), *over], monkeypatch) == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if m.get("step", 0) > 0]
    assert [m["step"] for m in steps] == [1, 2]
    for record in steps:
        for key in ("critic/vf_loss", "critic/values_mean", "critic/grad_norm", "actor/pg_loss"):
            assert record.get(key) is not None and math.isfinite(record[key]), key
