"""The catalog of estimators, reward workers and engines: each fact declared once, and every reader agrees."""
import dataclasses
import pathlib
import re
import subprocess
import sys
import types

import pytest

from roll_gspo.catalog import engines
from roll_gspo.catalog.engines import ENGINES
from roll_gspo.catalog.estimators import ESTIMATORS, names
from roll_gspo.catalog.reward_workers import REWARD_WORKERS, kind_of, loads_model, model_workers
from roll_gspo.schema.config import ADV_ESTIMATORS, PipelineConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


# --- engines (roll_gspo.catalog.engines) ---------------------------------------------------------

# A comparison of a strategy name with vLLM's (`== "vllm"`, `!= "vllm"`, `in ("vllm", ...)`):
# the question belongs in the engine catalog as a named fact.
VLLM_NAME_TEST = re.compile(r"""[!=]=\s*["']vllm["']|["']vllm["']\s*[!=]=|\bin\s*[(\[{][^)\]}]*["']vllm["']""")
# Files that are vLLM's own engine or weight transport and may name it.
VLLM_OWN = re.compile(r"^roll_gspo/(catalog/engines\.py|strategies/vllm_[^/]*\.py|sync/vllm_[^/]*\.py)$")


def test_the_schema_reads_its_strategy_choices_from_the_catalog():
    from roll_gspo.schema.config import FROZEN_STRATEGIES, INFER_STRATEGIES, TRAIN_STRATEGIES, StrategyArgs

    assert TRAIN_STRATEGIES == ["deepspeed_train", "fsdp2_train"] == engines.names("actor_train")
    assert INFER_STRATEGIES == ["vllm", "hf_infer"] == engines.names("actor_infer") == engines.names("judge")
    assert FROZEN_STRATEGIES == ["deepspeed_infer", "fsdp2_infer"]
    assert StrategyArgs.__dataclass_fields__["strategy_name"].metadata["choices"] == [""] + engines.names()
    assert StrategyArgs(strategy_name="vllm").engine is ENGINES["vllm"]
    assert StrategyArgs().engine is engines.NO_ENGINE and StrategyArgs(strategy_name="sglang").engine is engines.NO_ENGINE


def test_engine_facts():
    assert {n: e.kind for n, e in ENGINES.items()} == {
        "deepspeed_train": "train", "fsdp2_train": "train", "vllm": "rollout", "hf_infer": "rollout",
        "deepspeed_infer": "frozen", "fsdp2_infer": "frozen"}
    assert engines.names("reference") == ["deepspeed_train", "fsdp2_train", "hf_infer", "deepspeed_infer", "fsdp2_infer"]
    assert [n for n, e in ENGINES.items() if e.sleep_levels] == ["vllm"]
    assert [n for n, e in ENGINES.items() if e.spans_gpus] == ["vllm"]
    assert [n for n, e in ENGINES.items() if e.logprobs_modes] == ["vllm"]
    assert [n for n, e in ENGINES.items() if not e.reads_attn_implementation] == ["vllm"]
    no = engines.NO_ENGINE
    assert not (no.roles or no.serves_requests or no.trains or no.train_engine or no.sleep_levels or no.spans_gpus
                or no.logprobs_modes or no.loads_lora_adapters or no.vllm_engine_args or no.reads_attn_implementation)
    with pytest.raises(ValueError, match="roles must be a subset"):
        engines.EngineKind("x", "m", "C", ("policy",), "x")


def test_every_engine_of_the_catalog_imports_and_keeps_its_contract():
    """Each entry's class imports from its module; a rollout engine has the `RolloutEngine`
    members, a training engine is a `TrainEngineStrategy`, and the training names share a class."""
    from roll_gspo.strategies import engine_class
    from roll_gspo.strategies.engine import RolloutEngine
    from roll_gspo.strategies.train_engine import TrainEngineStrategy

    members = [name for name in dir(RolloutEngine) if not name.startswith("_")]
    for name, kind in ENGINES.items():
        cls = engine_class(name)
        assert (cls.__module__, cls.__name__) == (kind.path, kind.cls)
        assert issubclass(cls, TrainEngineStrategy) == kind.train_engine, name
        assert all(callable(getattr(cls, member, None)) for member in members) == kind.serves_requests, name
    assert engine_class("deepspeed_infer") is engine_class("deepspeed_train")
    assert engine_class("fsdp2_infer") is engine_class("fsdp2_train")
    with pytest.raises(ValueError, match="names no engine; built: deepspeed_train"):
        engine_class("sglang")


class Recorded:
    """An engine class that keeps what the worker built it with."""

    def __init__(self, role, **options):
        self.role, self.options = role, options


def test_the_workers_build_the_class_the_catalog_names(monkeypatch, tiny_model):
    """actor_infer builds whatever class the catalog's entry names, with its options (the engine takes
    those it uses), and the training roles' class comes from the catalog, refusing a rollout engine."""
    from roll_gspo.strategies import engine_class
    from roll_gspo.workers.actor_infer import ActorInferWorker
    from roll_gspo.workers.actor_train import train_strategy_class

    module = types.ModuleType(f"{engines.PACKAGE}.recorded_engine")
    module.Recorded = Recorded
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(ENGINES, "hf_infer", dataclasses.replace(ENGINES["hf_infer"], module="recorded_engine",
                                                                 cls="Recorded"))
    cfg = PipelineConfig(seed=7)
    cfg.actor_infer.strategy_args.strategy_name = "hf_infer"
    cfg.actor_infer.model_args.model_name_or_path = tiny_model
    worker = ActorInferWorker.__new__(ActorInferWorker)  # no Ray: setup alone
    worker.cfg, worker.plan, worker.rank, worker.set_up = cfg, types.SimpleNamespace(sleep_level=None), 0, False
    worker.setup()
    assert isinstance(worker.strategy, Recorded) and worker.strategy.role is cfg.actor_infer
    assert worker.strategy.options["seed"] == 7 and worker.strategy.options["sleep_level"] is None
    for name in ("deepspeed_train", "fsdp2_train", "deepspeed_infer", "fsdp2_infer"):
        assert train_strategy_class(name) is engine_class(name)
    with pytest.raises(ValueError, match="is no training engine"):
        train_strategy_class("vllm")


def test_no_strategy_name_is_compared_with_vllm_outside_the_catalog():
    """A new rollout engine is an entry in roll_gspo/catalog/engines.py: no module of the package or
    the pipelines tests `strategy_name == "vllm"` (there were 25 such tests in 14 files)."""
    found = []
    for top in ("roll_gspo", "pipelines"):
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if VLLM_OWN.match(relative):
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if VLLM_NAME_TEST.search(line):
                    found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "ask roll_gspo.catalog.engines instead:\n" + "\n".join(found)


def test_the_vllm_name_test_finds_each_form():
    for line in ('if name == "vllm":', "if name != 'vllm':", 'if "vllm" == name:', 'if name in ("vllm", "hf_infer"):',
                 'if name not in ["hf_infer", "vllm"]:'):
        assert VLLM_NAME_TEST.search(line), line
    for line in ('StrategyArgs(strategy_name="vllm")', 'loggers = {"vllm": handler}', 'find_spec("vllm")'):
        assert not VLLM_NAME_TEST.search(line), line
