"""ROLL's multi-teacher on-policy distillation: named teacher blocks under `teacher:` (read here as
`teachers`), each with its own `opd_kl_coef` and `tag_included` routing rows to it. The combined
term against the sum of each teacher's own (roll_gspo.algorithms.distillation), one teacher exactly
as before, the routing, ROLL's multi-teacher example loaded with only models, data and outputs
changed, the refusals, and a real run with two teacher roles."""
import json
import logging
from pathlib import Path

import pytest
import torch

from roll_gspo.algorithms.distillation import combine_teachers, opd_advantages, routed_rows
from roll_gspo.config import ConfigError, load_config, preflight
from tests.config_helpers import MINIMAL

REPO = Path(__file__).resolve().parents[1]
ROLL_DIR = REPO / "tests" / "data" / "roll"
MULTI = ROLL_DIR / "examples" / "multi_teacher_onpolicy_distill_config.yaml"


def test_combined_teachers_give_the_sum_of_each_teachers_term():
    """Three teachers, each on its own rows with its own weight: W * (s - T) per token equals
    sum_i c_i * (s - t_i) over the teachers of the row, to float rounding."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    student = -torch.rand(B, T, generator=g) * 3
    teachers = {f"t{i}": -torch.rand(B, T, generator=g) * 3 for i in range(3)}
    rows = {"t0": torch.tensor([1, 1, 0, 0, 1, 0], dtype=torch.bool), "t1": torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.bool),
            "t2": torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bool)}
    coefs = {"t0": 1.0, "t1": 0.25, "t2": 2.0}
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    task = torch.randn(B, T, generator=g) * mask
    teacher, weight = combine_teachers({n: (teachers[n], rows[n]) for n in teachers}, coefs, (B, T))
    got, metrics = opd_advantages(task, student, teacher, mask, weight)
    expected = task.clone()
    for n in teachers:
        expected -= coefs[n] * rows[n].float()[:, None] * (student - teachers[n]) * mask
    assert torch.allclose(got, expected, atol=1e-6)
    assert weight.tolist() == [1.25, 3.0, 2.25, 0.0, 3.25, 0.0]
    assert metrics["opd/rows_scored"] == pytest.approx(4 / 6)
    assert torch.equal(got[3], task[3]) and torch.equal(got[5], task[5])  # rows no teacher scored


def test_one_teacher_passes_through_exactly():
    g = torch.Generator().manual_seed(1)
    log_probs = -torch.rand(3, 4, generator=g)
    teacher, weight = combine_teachers({"teacher": (log_probs, torch.ones(3, dtype=torch.bool))}, {"teacher": 0.1}, (3, 4))
    assert torch.equal(teacher, log_probs) and torch.equal(weight, torch.full((3,), 0.1))
    mask, adv, student = torch.ones(3, 4), torch.randn(3, 4, generator=g), -torch.rand(3, 4, generator=g)
    assert torch.equal(opd_advantages(adv, student, teacher, mask, weight)[0], opd_advantages(adv, student, log_probs, mask, 0.1)[0])


def test_rows_are_routed_by_domain_or_its_reward_blocks_tags():
    domains = ["math_rule", "code_rule", "math_rule", "llm_judge"]
    tags = {"math_rule": {"math_dapo", "deepmath"}, "code_rule": {"KodCode"}, "llm_judge": set()}
    assert routed_rows([], domains, tags).tolist() == [True] * 4
    assert routed_rows(["math_dapo"], domains, tags).tolist() == [True, False, True, False]
    assert routed_rows(["KodCode", "llm_judge"], domains, tags).tolist() == [False, True, False, True]


def _model_folder(tmp_path) -> str:
    config = json.loads((REPO / "tests" / "data" / "model_configs" / "Qwen2.5-0.5B.json").read_text())
    config.setdefault("max_position_embeddings", 32768)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _multi_overrides(model: str, out) -> list:
    """Models (student, rewards, both teachers), data (DAPO and KodCode are not in tests/data: ROLL's
    test files) and outputs."""
    return [f"pretrain={model}", f"reward_pretrain={model}",
            f"teacher.teacher_32B.model_args.model_name_or_path={model}",
            f"teacher.teacher_14B.model_args.model_name_or_path={model}",
            "student_train.data_args.file_name=[data/code_KodCode_data.jsonl,data/math_deepmath_deal.jsonl]",
            f"output_dir={out}", f"logging_dir={out}/logs", f"rollout_dump_dir={out}/dump",
            f"checkpoint_config.output_dir={out}/ckpt"]


def test_rolls_multi_teacher_example_loads_as_written(tmp_path, monkeypatch, caplog, capsys):
    """Two named teachers, each routed by its tag with its own weight, as pure OPD; Megatron's
    strategies and model-parallel sizes, vLLM's tensor parallelism and sequence packing adapted
    on this CPU host with their notices; --dry-run plans both teachers' processes."""
    monkeypatch.chdir(ROLL_DIR)
    model = _model_folder(tmp_path)
    with caplog.at_level(logging.WARNING):
        cfg = load_config(str(MULTI), _multi_overrides(model, tmp_path / "out"), cpu_host=True)
    preflight(cfg)
    roles = cfg.teacher_roles()
    assert list(roles) == ["teacher.teacher_32B", "teacher.teacher_14B"] and cfg.teacher is None
    assert [(r.opd_kl_coef, r.tag_included, r.strategy_args.strategy_name) for r in roles.values()] == [
        (1.0, ["math_dapo"], "deepspeed_infer"), (1.0, ["KodCode"], "deepspeed_infer")]
    assert cfg.is_pure_opd and cfg.uses_teacher()
    assert "teacher.teacher_32B.strategy_args.strategy_config.pipeline_model_parallel_size = 4" in caplog.text
    assert "vLLM tensor_parallel_size: 2 -> 1" in caplog.text
    assert "reward domain(s)" not in caplog.text  # both domains are routed to a teacher
    from roll_gspo.cli import main

    capsys.readouterr()
    main(["--config", str(MULTI), "--dry-run", *_multi_overrides(model, tmp_path / "out")])
    out = capsys.readouterr().out
    assert "teacher.teacher_32B: 1 x deepspeed_infer" in out and "teacher.teacher_14B: 1 x deepspeed_infer" in out
    assert "  teacher.teacher_32B (deepspeed_infer" in out and "  teacher.teacher_14B (deepspeed_infer" in out


def _load(tmp_path, overrides):
    path = tmp_path / "cfg.yaml"
    path.write_text(MINIMAL)
    return load_config(str(path), list(overrides))


TWO = ["use_opd=true", "+teachers.a.model_args.model_name_or_path=builtin:tiny-arith",
       "+teachers.a.strategy_args.strategy_name=hf_infer",
       "+teachers.b.model_args.model_name_or_path=builtin:tiny-arith",
       "+teachers.b.strategy_args.strategy_name=hf_infer"]


@pytest.mark.parametrize("extra, reason", [
    (["+teacher.model_args.model_name_or_path=builtin:tiny-arith"], "one block and named teachers (a, b) are both given"),
    (["+teachers.a.opd_kl_coef=-1"], "teacher.a.opd_kl_coef = -1.0: must be >= 0"),
    (["+teachers.b.tag_included=[nope]"], "teacher.b.tag_included: ['nope'] name no reward domain or tag"),
    (["+actor_train.tag_included=[math_rule]"], "actor_train.tag_included: read on teacher blocks only"),
    (["+reference.opd_kl_coef=0.5"], "reference.opd_kl_coef: read on teacher blocks only"),
    (["+teachers.a.training_args.learning_rate=0.1"], "teacher.a.training_args.learning_rate = 0.1 is never read"),
])
def test_multi_teacher_refusals_name_the_key(tmp_path, extra, reason):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, TWO + extra)
    assert reason in str(info.value)


def test_tag_to_template_naming_another_template_is_refused(tmp_path):
    """ROLL's per-tag templates: one template renders every prompt here, so a tag naming another is
    refused (ROLL's multi-teacher example, every tag naming the one in use, loads above)."""
    with pytest.raises(ConfigError, match=r"tag_to_template: \{'code': 'qwen3'\} differ from the template in use"):
        _load(tmp_path, ["actor_train.data_args.template=chatml", "+tag_to_template={math: chatml, code: qwen3}"])


def test_a_domain_no_tagged_teacher_routes_is_warned_about(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = _load(tmp_path, TWO + ["+rewards.math_rule.tag_included=[arith]", "+teachers.a.tag_included=[arith]",
                                     "+teachers.b.tag_included=[arith]", "+rewards.spare.worker_cls="
                                     "roll_gspo.rewards.workers.MathRuleRewardWorker"])
    assert list(cfg.teacher_roles()) == ["teacher.a", "teacher.b"]
    assert "reward domain(s) ['spare']: no teacher's tag_included routes their rows" in caplog.text


@pytest.mark.e2e
def test_two_teachers_each_score_their_rows_in_a_real_run(tmp_path, tiny_model):
    """Two teacher roles start (hf_infer, the micro model each), both score every row at weights 0.25
    and 0.75, and the run's OPD metrics say all rows got a term; the per-step teacher time is one
    phase for both."""
    from tests.test_pipeline_e2e import run, write_config

    teacher = {"model_args": {"model_name_or_path": tiny_model}, "strategy_args": {"strategy_name": "hf_infer"},
               "num_cpus_per_worker": 0.25}
    cfg = write_config(tmp_path, tiny_model, max_steps=1, rollout_batch_size=4, use_opd=True,
                       importance_sampling="token", pg_clip_low=0.2, pg_clip_high=0.28,
                       teacher={"a": {**teacher, "opd_kl_coef": 0.25}, "b": {**teacher, "opd_kl_coef": 0.75}},
                       actor_infer={"strategy_args": {"strategy_name": "hf_infer", "strategy_config": {}}},
                       actor_train={"world_size": 1, "data_args": {"file_name": ["builtin:arith_easy/train"]}})
    assert list(cfg.teacher_roles()) == ["teacher.a", "teacher.b"] and cfg.teacher is None
    import ray

    before = set(ray.util.placement_group_table()) if ray.is_initialized() else set()
    (record,) = [r for r in run(cfg) if "opd/reverse_kl" in r]
    # Every role's reservation is released at the end, the teachers' too (they once outlived the run,
    # and the next run in the process waited forever for their CPUs).
    table = ray.util.placement_group_table()
    assert all(table[pg]["state"] == "REMOVED" for pg in set(table) - before), table
    assert record["opd/rows_scored"] == 1.0 and record["time/teacher_s"] > 0
    # Same weights as one teacher of weight 1.0 (both are the student's own starting model): the
    # teacher term is the reverse KL to it, 0 at the first step up to bf16/fp32 rounding.
    assert abs(record["opd/reverse_kl"]) < 1e-4, record
