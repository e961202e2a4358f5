"""The policy loss's keys (roll_gspo.config.checks.policy_loss): `policy_loss` and its names from ROLL
(`actor_train.pg_variant`, `worker_cls`), verl and TRL, the keys each loss implies, the refused
combinations (naming the keys), the trainer's keywords and the `--dry-run` line. Config-level only."""
import logging
import shutil
from pathlib import Path

import pytest

from roll_gspo.algorithms import LOSS_SPECS
from roll_gspo.config import ConfigError, load_config
from roll_gspo.config.plan.run_plan import build_run_plan
from roll_gspo.config.plan.policy_loss import policy_loss_options
from tests.config_helpers import MINIMAL

REPO = Path(__file__).resolve().parents[1]
ROLL_DIR = REPO / "tests" / "data" / "roll"


def load(tmp_path, overrides=(), text=MINIMAL):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return load_config(str(path), list(overrides))


def refusal(tmp_path, overrides, text=MINIMAL):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, overrides, text)
    return str(info.value)


def test_default_is_todays_gspo_clip(tmp_path):
    cfg = load(tmp_path)
    assert cfg.policy_loss == "clip" and cfg.importance_sampling == "seq" and cfg.loss_agg_mode == "seq-mean-token-mean"
    assert (cfg.pg_clip_low, cfg.pg_clip_high) == (3e-4, 4e-4)
    assert "policy loss: clip: GSPO (sequence ratio) clipped surrogate" in build_run_plan(cfg).text()
    assert policy_loss_options(cfg) == {}


@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
def test_every_loss_loads_and_dry_run_names_it(tmp_path, name):
    cfg = load(tmp_path, [f"policy_loss={name}"])
    spec = LOSS_SPECS[name]
    assert cfg.policy_loss == name
    assert cfg.importance_sampling in spec.ratio_levels and cfg.loss_agg_mode in spec.agg_modes
    assert f"policy loss: {name}" in build_run_plan(cfg).text()
    assert set(policy_loss_options(cfg)) == set(spec.keys)


def test_token_level_losses_take_token_ratios_when_unwritten_and_say_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        cfg = load(tmp_path, ["policy_loss=cispo", "cispo_epsilon_high=0.2"])
    assert cfg.importance_sampling == "token" and policy_loss_options(cfg)["cispo_epsilon_high"] == 0.2
    assert any("policy_loss 'cispo' with importance_sampling: token (not written)" in r.getMessage()
               for r in caplog.records)
    # written: honoured where the loss is defined on it (CISPO on sequence weights, as TRL allows)
    assert load(tmp_path, ["policy_loss=cispo", "importance_sampling=seq"]).importance_sampling == "seq"


def test_luspo_and_gmpo_fill_their_structure(tmp_path):
    luspo = load(tmp_path, ["policy_loss=luspo"])
    assert (luspo.importance_sampling, luspo.loss_agg_mode) == ("seq", "seq-mean-token-sum")
    gmpo = load(tmp_path, ["policy_loss=gmpo"])
    assert (gmpo.pg_clip_low, gmpo.pg_clip_high) == (0.4, 0.4)
    assert "log-ratio in [-0.4, 0.4]" in build_run_plan(gmpo).text()
    assert load(tmp_path, ["policy_loss=gmpo", "pg_clip_low=0.2", "pg_clip_high=0.3"]).pg_clip_high == 0.3


@pytest.mark.parametrize("overrides, keys, reason", [
    (["policy_loss=luspo", "importance_sampling=token"], ["importance_sampling", "luspo"], "GSPO's sequence ratio"),
    (["policy_loss=luspo", "loss_agg_mode=token-mean"], ["loss_agg_mode", "luspo"], "sums each response's tokens"),
    (["policy_loss=vespo", "importance_sampling=token"], ["importance_sampling", "vespo"], "own sequence weight"),
    (["policy_loss=gmpo", "importance_sampling=gspo-token"], ["importance_sampling", "gmpo"], "geometric mean"),
    (["policy_loss=gmpo", "loss_agg_mode=seq-mean-token-sum"], ["loss_agg_mode", "gmpo"], "mean over responses"),
    (["policy_loss=clip_cov", "importance_sampling=seq"], ["importance_sampling", "clip_cov"], "single tokens"),
    (["policy_loss=kl_cov", "importance_sampling=gspo-token"], ["importance_sampling", "kl_cov"], "token ratios"),
    (["policy_loss=tis", "importance_sampling=seq"], ["importance_sampling", "tis"], "each token's ratio"),
    (["policy_loss=dr_grpo", "loss_agg_mode=token-mean"], ["loss_agg_mode", "dr_grpo"], "TRL loss_type dr_grpo"),
    (["policy_loss=vanilla"], ["policy_loss"], "ambiguous"),
    (["policy_loss=sapo", "sapo_temperature_neg=0"], ["sapo_temperature_neg"], "> 0"),
    (["policy_loss=clip_cov", "clip_cov_ratio=0"], ["clip_cov_ratio"], "(0, 1]"),
    (["policy_loss=clip_cov", "clip_cov_lb=6"], ["clip_cov_lb", "clip_cov_ub"], "no token"),
    (["policy_loss=tis", "tis_lower_bound=2"], ["tis_upper_bound", "tis_lower_bound"], "below"),
    (["policy_loss=cispo", "cispo_epsilon_low=-0.1"], ["cispo_epsilon_low"], ">= 0"),
])
def test_nonsense_combinations_are_refused_naming_the_keys(tmp_path, overrides, keys, reason):
    message = refusal(tmp_path, overrides)
    assert reason in message and all(key in message for key in keys), message


@pytest.mark.parametrize("name, loss, implied", [
    ("ppo", "clip", {"importance_sampling": "token", "pg_clip_low": 0.2, "pg_clip_high": 0.2}),
    ("gspo", "clip", {"importance_sampling": "seq", "pg_clip_low": 3e-4}),
    ("geo_mean", "gmpo", {"importance_sampling": "seq"}),
    ("gpg", "reinforce", {}),
    ("grpo", "clip", {"importance_sampling": "token", "loss_agg_mode": "seq-mean-token-mean"}),
    ("bnpo", "clip", {"loss_agg_mode": "token-mean"}),
    ("dapo", "clip", {"loss_agg_mode": "token-mean", "pg_clip_high": 0.2}),
    ("dr_grpo", "clip", {"loss_agg_mode": "seq-mean-token-sum-norm"}),
])
def test_verl_and_trl_names_map(tmp_path, name, loss, implied):
    cfg = load(tmp_path, [f"policy_loss={name}"])
    assert cfg.policy_loss == loss
    assert {key: getattr(cfg, key) for key in implied} == implied
    # a written ratio level or clip is the user's
    assert load(tmp_path, [f"policy_loss={name}", "pg_clip=0.1"]).pg_clip_high == 0.1


@pytest.mark.parametrize("variant, loss", [("vanilla", "reinforce"), ("ppo", "clip"), ("tis", "tis"),
                                           ("topr", "topr"), ("cispo", "cispo"), ("kimi15", "kimi15")])
def test_roll_pg_variant_acts(tmp_path, variant, loss):
    cfg = load(tmp_path, [f"actor_train.pg_variant={variant}"])
    assert cfg.policy_loss == loss
    assert f"policy loss: {loss}" in build_run_plan(cfg).text()
    if variant == "ppo":
        assert cfg.importance_sampling == "token" and cfg.pg_clip_low == 0.2


def test_roll_pg_worker_is_accepted_with_one_notice_and_its_topr_weights_act(tmp_path, caplog):
    text = MINIMAL.replace("actor_train:\n", "actor_train:\n  worker_cls: roll.pipeline.rlvr.actor_pg_worker."
                                             "ActorPGWorker\n  pg_variant: topr\n  topr_negative_weight: 0.5\n")
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        cfg = load(tmp_path, text=text)
    assert cfg.policy_loss == "topr" and cfg.topr_negative_weight == 0.5
    assert policy_loss_options(cfg)["topr_negative_weight"] == 0.5
    notices = [r.getMessage() for r in caplog.records if "ActorPGWorker" in r.getMessage()]
    assert len(notices) == 1 and "runs policy_loss 'topr'" in notices[0]
    # without pg_variant ROLL's worker runs vanilla
    bare = MINIMAL.replace("actor_train:\n", "actor_train:\n  worker_cls: roll.pipeline.rlvr.actor_pg_worker."
                                             "ActorPGWorker\n")
    assert load(tmp_path, text=bare).policy_loss == "reinforce"


@pytest.mark.parametrize("overrides, keys", [
    (["actor_train.pg_variant=cispo", "policy_loss=sapo"], ["policy_loss", "pg_variant"]),
    (["actor_train.pg_variant=cispo", "pg_variant=tis"], ["pg_variant", "actor_train.pg_variant"]),
    (["reference.pg_variant=cispo"], ["reference.pg_variant", "actor_train"]),
    (["actor_train.worker_cls=my.Worker"], ["actor_train.worker_cls", "ActorPGWorker"]),
    (["actor_train.topr_positive_weight=2", "topr_positive_weight=3"], ["actor_train.topr_positive_weight"]),
])
def test_roll_names_contradicting_or_misplaced_are_refused(tmp_path, overrides, keys):
    message = refusal(tmp_path, overrides)
    assert all(key in message for key in keys), message


def test_pg_variant_agreeing_with_policy_loss_is_accepted(tmp_path):
    assert load(tmp_path, ["actor_train.pg_variant=vanilla", "policy_loss=gpg"]).policy_loss == "reinforce"
    assert load(tmp_path, ["actor_train.pg_variant=cispo", "pg_variant=cispo"]).policy_loss == "cispo"


def test_keys_of_another_loss_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        load(tmp_path, ["policy_loss=cispo", "sapo_temperature_pos=2"])
    assert any("sapo_temperature_pos has no effect" in r.getMessage() for r in caplog.records)


def test_roll_agentic_pg_var_recipe_loads(tmp_path, monkeypatch):
    """ROLL's agent_val_frozen_lake-pg_var.yaml: agent_val_frozen_lake.yaml with actor_train's ROLL agentic
    PG worker and `pg_variant: topr` (and generating_args moved to actor_infer, which loads either way)."""
    shutil.copytree(ROLL_DIR / "config", tmp_path / "config")
    (tmp_path / "agentic").mkdir()
    text = (ROLL_DIR / "agentic_unchanged" / "agent_val_frozen_lake.yaml").read_text()
    assert "\nactor_train:\n" in text
    text = text.replace("\nactor_train:\n", "\nactor_train:\n  # worker_cls: roll.pipeline.rlvr.actor_pg_worker."
                                            "ActorPGWorker\n  worker_cls: roll.pipeline.agentic.agentic_actor_pg_worker"
                                            ".ActorWorker\n  pg_variant: topr # topr, vanilla, tis, cispo, kimi15, ppo\n")
    recipe = tmp_path / "agentic" / "agent_val_frozen_lake-pg_var.yaml"
    recipe.write_text(text)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    cfg = load_config(str(recipe), [f"output_dir={out}", f"logging_dir={out}/logs",
                                    f"checkpoint_config.output_dir={out}/ckpt", f"tracker_kwargs.log_dir={out}/tb"],
                      cpu_host=True)
    assert cfg.pipeline == "agentic" and cfg.policy_loss == "topr" and cfg.importance_sampling == "token"
    assert "policy loss: topr" in build_run_plan(cfg).text()


@pytest.mark.parametrize("loss", ["cispo", "sapo", "tis", "kl_cov"])
def test_the_clip_size_warning_is_for_losses_that_clip_the_ratio(loss):
    """A loss that never reads pg_clip_* (or reads it in log space, GMPO) gets no warning about the
    clip's size against the ratio level; the clipped surrogate still does."""
    from roll_gspo.config.load.loader import load_config_findings

    def clip_warnings(overrides):
        _, findings = load_config_findings("example_gspo.yaml", overrides)
        return [f for f in findings if f.level == "warning" and "clip range" in f.text]

    assert clip_warnings([f"policy_loss={loss}", "importance_sampling=token"]) == []
    assert clip_warnings(["importance_sampling=token"])  # example_gspo's GSPO-sized clip on token ratios
