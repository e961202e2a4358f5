"""The catalog of estimators and reward workers: each fact declared once, and every reader agrees."""
import subprocess
import sys

from roll_gspo.catalog.estimators import ESTIMATORS, names
from roll_gspo.catalog.reward_workers import REWARD_WORKERS, kind_of, loads_model, model_workers
from roll_gspo.schema.config import ADV_ESTIMATORS, PipelineConfig


def test_the_schema_reads_its_estimator_choices_from_the_catalog():
    assert ADV_ESTIMATORS == list(ESTIMATORS) == ["reinforce", "grpo", "rloo", "gdpo", "step_reinforce", "gae"]
    help_text = PipelineConfig.__dataclass_fields__["adv_estimator"].metadata["help"]
    assert all(f"`{name}`" in help_text for name in ESTIMATORS)


def test_the_torch_registry_holds_the_rlvr_estimators_without_a_critic():
    # The per-response functions compute_advantages dispatches to; gae runs beside the critic, and
    # step_reinforce in the agentic pipeline.
    from roll_gspo.algorithms.advantages import ADV_ESTIMATORS as FUNCTIONS

    plain = [e.name for e in ESTIMATORS.values() if "rlvr" in e.pipelines and not e.needs_critic]
    assert [n for n in FUNCTIONS if not n.startswith("test-")] == plain


def test_estimator_facts():
    assert names(needs_critic=True) == ["gae"]
    assert names("agentic") == ["reinforce", "grpo", "step_reinforce"]
    assert [e.name for e in ESTIMATORS.values() if e.granularity == "turn"] == ["step_reinforce"]
    assert {n for n, e in ESTIMATORS.items() if e.min_group > 1} == {"grpo", "rloo", "gdpo"}
    assert [n for n, e in ESTIMATORS.items() if e.components] == ["gdpo"]
    assert names("rlvr") == ["reinforce", "grpo", "rloo", "gdpo", "gae"]


def test_uses_critic_follows_the_facts():
    cfg = PipelineConfig(adv_estimator="gae")
    assert not cfg.uses_critic()  # no critic block
    cfg.critic = cfg.actor_train
    assert cfg.uses_critic()
    cfg.adv_estimator = "grpo"
    assert not cfg.uses_critic()


def test_the_config_checks_import_no_torch():
    code = ("import sys, roll_gspo.schema.config, roll_gspo.config.checks.validate, roll_gspo.catalog.estimators; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_reward_worker_of_the_catalog_is_a_class_carrying_its_kind():
    import roll_gspo.workers.rewards as package

    for name, kind in REWARD_WORKERS.items():
        cls = getattr(package, name)
        assert cls.__module__ == f"roll_gspo.workers.rewards.{kind.module}"
        assert cls.kind is kind
    assert package.RewardWorker.kind is None


def test_a_users_subclass_carries_no_built_in_kind():
    from roll_gspo.workers.rewards import MathRuleRewardWorker

    class MyReward(MathRuleRewardWorker):
        pass

    assert MyReward.kind is None


def test_reward_worker_facts():
    assert model_workers() == ("LLMJudgeRewardWorker", "RewardModelWorker")
    assert loads_model("roll_gspo.workers.rewards.RewardModelWorker")
    assert not loads_model("roll_gspo.workers.rewards.MathRuleRewardWorker")
    assert not loads_model("my_pkg.rewards.MyWorker") and kind_of("my_pkg.rewards.MyWorker") is None
    from roll_gspo.schema.config import RewardConfig

    worker_help = RewardConfig.__dataclass_fields__["worker_cls"].metadata["help"]
    assert all(f"`{name}`" in worker_help for name in REWARD_WORKERS)
