"""The registry of config steps (roll_gspo.config.checks.registry): phases in order, checks that cannot
change the config, findings that carry their key, and the readers that group by it (roll_check,
the config reference). Fast: no Ray, no model loading."""
from pathlib import Path

import pytest

from roll_gspo.config import ConfigError, load_config
from roll_gspo.config.findings import Finding, error, notice
from roll_gspo.config.checks.registry import PHASES, Step, _REGISTRY, registered_steps, run_steps
from roll_gspo.schema.config import PipelineConfig

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "example_gspo.yaml"


@pytest.fixture
def cfg() -> PipelineConfig:
    """A valid config, loaded before a test registers its step."""
    return load_config(str(EXAMPLE))


@pytest.fixture
def extra_step(monkeypatch):
    """Register a step for one test (removed afterwards)."""
    def add(phase, fn, name="test.step", **kwargs):
        registered_steps()  # the project's steps first, so the test's runs after them
        monkeypatch.setitem(_REGISTRY, name, Step(name, phase, ("kl_loss_coef",), "a test step", fn, "tests",
                                                  **kwargs))
    return add


def test_every_module_of_checks_is_found_and_declares_steps():
    # Discovery: a module in roll_gspo/config/checks/ runs because it is there (no list to forget it in);
    # one that declares no step is not a check module (the facts a run reads belong in plan/), unless it is
    # the registry, the runner or preflight.
    from roll_gspo.config.checks import registry

    files = sorted(p.stem for p in (REPO / "roll_gspo" / "config" / "checks").glob("*.py") if p.stem != "__init__")
    found = [module.rpartition(".")[2] for module in registry.check_modules()]
    assert found == [name for name in files if name not in registry.NOT_STEP_MODULES]
    assert set(registry.NOT_STEP_MODULES) <= set(files)
    declaring = {s.module for s in registered_steps() if s.module.startswith("roll_gspo.")}
    assert declaring == set(registry.check_modules())


def test_steps_run_phase_by_phase_and_after_what_they_name():
    steps = registered_steps()
    ranks = [PHASES.index(s.phase) for s in steps]
    assert ranks == sorted(ranks)
    position = {s.name: i for i, s in enumerate(steps)}
    for step in steps:
        for first in step.after + step.requires:
            assert position[first] < position[step.name], (step.name, first)
    # The dependencies the old fixed call order held in side comments, now declared.
    assert position["agentic.defaults"] < position["defaults.derived"] < position["critic.defaults"]
    colocation = next(s for s in steps if s.name == "placement.colocation")
    assert "placement.device_mapping" in colocation.requires


def test_every_step_documents_itself_in_one_line_and_the_reference_lists_it():
    from roll_gspo.config.load.config_reference import checks_section

    section = "\n".join(checks_section())
    for step in registered_steps():
        assert step.doc and "\n" not in step.doc and step.keys, step.name
        assert f"`{step.name}`: {step.doc}." in section


def test_a_check_that_changes_the_config_is_refused(cfg, extra_step):
    def mutating(cfg, yaml_keys):
        cfg.kl_loss_coef = 0.5
        return []

    extra_step("check", mutating)
    with pytest.raises(RuntimeError, match="test.step .check phase. changed the config"):
        run_steps(cfg, None)


def test_a_warning_step_cannot_change_the_config(cfg, extra_step):
    extra_step("warn", lambda cfg, keys: cfg.system_envs.update(X="1") or [])
    with pytest.raises(RuntimeError, match="changed the config"):
        run_steps(cfg, None)


def test_a_warning_step_cannot_refuse(cfg, extra_step):
    extra_step("warn", lambda cfg, keys: [error("kl_loss_coef", "no")])
    with pytest.raises(RuntimeError, match="refusals are checks"):
        run_steps(cfg, None)


def test_a_step_yields_findings_only(cfg, extra_step):
    extra_step("check", lambda cfg, keys: ["kl_loss_coef: a plain string"])
    with pytest.raises(TypeError, match="not a Finding"):
        run_steps(cfg, None)


def test_a_step_that_requires_another_is_skipped_when_it_refused(cfg, extra_step):
    ran = []
    extra_step("normalise", lambda cfg, keys: [error("kl_loss_coef", "first refuses")], name="test.first")
    extra_step("check", lambda cfg, keys: ran.append(1) or [], name="test.second", requires=("test.first",))
    with pytest.raises(ConfigError) as info:
        run_steps(cfg, None)
    assert "first refuses" in info.value.problems and ran == []


def test_errors_of_every_step_are_raised_together_before_the_settle_phase(extra_step):
    settled = []
    extra_step("settle", lambda cfg, keys: settled.append(1) or [], name="test.settle")
    with pytest.raises(ConfigError) as info:
        load_config(str(EXAMPLE), ["kl_loss_coef=-1", "pg_clip_low=2"])
    keys = [f.key for f in info.value.findings]
    assert "kl_loss_coef" in keys and "pg_clip_low" in keys and settled == []


def test_findings_carry_their_key_path():
    with pytest.raises(ConfigError) as info:
        load_config(str(EXAMPLE), ["actor_train.training_args.learning_rate=-1", "actor_trian.world_size=2"])
    findings = info.value.findings  # the walk stops at the unknown key: that stage's finding
    assert [f.key for f in findings] == ["actor_trian"] and all(f.level == "error" for f in findings)
    with pytest.raises(ConfigError) as info:
        load_config(str(EXAMPLE), ["actor_train.training_args.learning_rate=-1"])
    (finding,) = info.value.findings
    assert finding.key == "actor_train.training_args.learning_rate"
    assert info.value.problems == [finding.text]


def test_a_finding_reads_as_before():
    assert notice("eval_steps", "eval_steps = 5 is ignored").text == "notice: eval_steps = 5 is ignored"
    assert error("k", "k: bad", "use 1").text == "k: bad; use 1"
    with pytest.raises(ValueError):
        Finding("k", "fatal", "no such level")
    assert ConfigError(["a plain line"]).findings == [Finding("", "error", "a plain line")]


def test_a_remedy_said_apart_keeps_the_line():
    with pytest.raises(ConfigError) as info:
        load_config(str(EXAMPLE), ["reference.training_args.learning_rate=0.5"])
    (finding,) = [f for f in info.value.findings if f.key == "reference.training_args.learning_rate"]
    assert finding.remedy.startswith("the setting that acts is none: the reference is frozen")
    assert finding.text == (f"reference.training_args.learning_rate = 0.5 is never read (reference does not use "
                            f"training_args); {finding.remedy}")
    assert finding.source == "role_reads.unread"


def test_roll_check_groups_refusals_by_the_findings_key(extra_step):
    from roll_gspo.config.load.roll_check import roll_report

    # The message names another key; the finding's key decides where the report puts it.
    extra_step("check", lambda cfg, keys: [error("kl_loss_coef", "rollout_batch_size is fine; this is about "
                                                                 "the other key")])
    report = roll_report(str(EXAMPLE), ["kl_loss_coef=0.01"])
    assert not report.complete
    assert report.refused["kl_loss_coef"].startswith("rollout_batch_size is fine")
    assert "rollout_batch_size" not in report.refused


def test_roll_check_puts_a_finding_without_a_written_key_under_other_problems(extra_step):
    from roll_gspo.config.load.roll_check import roll_report

    extra_step("check", lambda cfg, keys: [error("", "about no key"), error("weight_sync_transport", "unwritten")])
    report = roll_report(str(EXAMPLE), [])
    assert report.other_problems == ["about no key", "unwritten"]


def test_async_generation_ratio_has_one_check_module():
    # Its rules live in checks/async_rollout (what a run derives from it is plan/'s); the schema
    # (roll_gspo/schema, below config) declares it.
    folder = REPO / "roll_gspo" / "config" / "checks"
    naming = sorted(p.name for p in folder.glob("*.py") if "async_generation_ratio" in p.read_text())
    assert naming == ["async_rollout.py"]
    assert "async_generation_ratio" in (REPO / "roll_gspo" / "schema" / "config.py").read_text()
