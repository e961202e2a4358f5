"""On-policy distillation (`use_opd`, `opd_kl_coef`, the `teacher` block): the per-token reverse-KL
term against a hand computation (roll_gspo.algorithms.distillation), the refusals before workers start
(roll_gspo.config.checks.opd: no teacher, a negative coefficient, the agentic pipeline, a teacher whose
tokenizer is not the student's), and a short run where a teacher scores the student's tokens."""
import math

import pytest
import torch

from roll_gspo.algorithms.distillation import opd_advantages
from roll_gspo.config import ConfigError, load_config
from roll_gspo.config.checks.opd import tokenizer_mismatch
from tests.config_helpers import MINIMAL

TEACHER = ["use_opd=true", "+teacher.model_args.model_name_or_path=builtin:tiny-arith",
           "+teacher.strategy_args.strategy_name=hf_infer"]


def load(tmp_path, overrides=()):
    path = tmp_path / "cfg.yaml"
    path.write_text(MINIMAL)
    return load_config(str(path), list(overrides))


def refusal(tmp_path, overrides):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, overrides)
    return str(info.value)


def test_opd_term_equals_a_hand_computation():
    adv = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]])
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 9.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-0.7, -0.1, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out, metrics = opd_advantages(adv, student, teacher, mask, kl_coef=0.5)
    # reverse KL per token: student - teacher = [[0.5, -1.0, 0.0], [0.5, -2.9, (padding)]]
    expected = torch.tensor([[0.5 - 0.25, 0.5 + 0.5, 0.5 - 0.0], [-1.0 - 0.25, -1.0 + 1.45, 0.0]])
    assert torch.allclose(out, expected)
    assert metrics["opd/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0 + 0.5 - 2.9) / 5)
    assert metrics["opd/reverse_kl_seq_max"] == pytest.approx(max(-0.5 / 3, -2.4 / 2))
    assert metrics["opd/advantage_mean"] == pytest.approx(-0.5 * (0.5 - 1.0 + 0.0 + 0.5 - 2.9) / 5)
    assert metrics["opd/teacher_logp"] == pytest.approx((-1.5 - 1.0 - 0.5 - 0.7 - 0.1) / 5)
    # pure OPD (no task advantage): the term alone; a zero coefficient leaves the advantages as they are
    pure, _ = opd_advantages(torch.zeros(2, 3), student, teacher, mask, kl_coef=1.0)
    assert pure[0].tolist() == pytest.approx([-0.5, 1.0, 0.0]) and pure[1, 2] == 0.0
    same, _ = opd_advantages(adv, student, teacher, mask, kl_coef=0.0)
    assert torch.equal(same, adv * mask)
    with pytest.raises(ValueError, match="kl_coef"):
        opd_advantages(adv, student, teacher, mask, kl_coef=-1.0)
    with pytest.raises(ValueError, match="shapes differ"):
        opd_advantages(adv, student[:, :2], teacher, mask, kl_coef=1.0)
    assert not math.isnan(metrics["opd/student_logp"])


def test_opd_keys_load_and_a_teacher_of_the_same_tokenizer_passes(tmp_path):
    cfg = load(tmp_path, TEACHER + ["opd_kl_coef=0.5"])
    assert cfg.use_opd and cfg.uses_teacher() and cfg.opd_kl_coef == 0.5
    assert cfg.teacher.model_args.model_name_or_path == "builtin:tiny-arith"
    assert not load(tmp_path).uses_teacher() and load(tmp_path).opd_kl_coef == 1.0


def test_use_opd_without_a_teacher_is_refused(tmp_path):
    message = refusal(tmp_path, ["use_opd=true"])
    assert "use_opd" in message and "teacher" in message


def test_a_negative_coefficient_is_refused(tmp_path):
    assert "opd_kl_coef = -0.1" in refusal(tmp_path, TEACHER + ["opd_kl_coef=-0.1"])


def test_a_teacher_without_a_model_is_refused(tmp_path):
    message = refusal(tmp_path, ["use_opd=true", "+teacher.strategy_args.strategy_name=hf_infer"])
    assert "teacher.model_args.model_name_or_path" in message


def test_the_agentic_pipeline_is_refused_with_the_reason(tmp_path):
    from roll_gspo.config.checks.opd import opd_problems

    cfg = load(tmp_path, TEACHER)
    from roll_gspo.schema.frozen import replaced

    found = opd_problems(replaced(cfg, {"pipeline": "agentic"}))
    assert any(f.key == "use_opd" and "pipeline: rlvr" in f.message and f.level == "error" for f in found)


def test_a_teacher_of_another_tokenizer_is_refused_naming_both_models(tmp_path):
    # the built-in tiny model's char tokenizer against SmolLM2's BPE
    message = refusal(tmp_path, ["pretrain=builtin:tiny-arith-base", "use_opd=true",
                                 "+teacher.model_args.model_name_or_path=builtin:smollm2-135m-instruct",
                                 "+teacher.strategy_args.strategy_name=hf_infer"])
    assert "builtin:smollm2-135m-instruct" in message and "builtin:tiny-arith-base" in message
    assert "tokenizer" in message


def test_tokenizer_mismatch_reads_folders(tiny_model, tmp_path):
    assert tokenizer_mismatch(tiny_model, "builtin:tiny-arith-base") is None
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tiny_model)
    other.add_tokens(["<extra_token_for_the_test>"])
    other.save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text("{}")
    assert "vocab_size" in tokenizer_mismatch(tiny_model, str(tmp_path / "other"))


@pytest.mark.e2e
def test_a_teacher_scores_the_students_tokens_end_to_end(tmp_path, tiny_model, ray_session):
    """The teacher is the student's own initial model: before the first update its log-probs are the
    old policy's on every sampled token (positions aligned), so the reverse KL starts at ~0 and moves
    once the student trains; the term is logged under opd/* and the teacher pass is timed."""
    from tests.test_pipeline_e2e import run, write_config

    cfg = write_config(tmp_path, tiny_model, max_steps=2, use_opd=True, opd_kl_coef=0.5,
                       importance_sampling="gspo-token",
                       teacher={"model_args": {"model_name_or_path": tiny_model},
                                "strategy_args": {"strategy_name": "hf_infer"}, "num_cpus_per_worker": 0.25},
                       actor_infer={"strategy_args": {"strategy_name": "hf_infer", "strategy_config": {}}},
                       actor_train={"world_size": 1, "training_args": {"per_device_train_batch_size": 8,
                                                                       "gradient_accumulation_steps": 2}})
    assert cfg.uses_teacher()
    records = [r for r in run(cfg) if "opd/reverse_kl" in r]
    assert [r["step"] for r in records] == [1, 2]
    first, second = records
    assert abs(first["opd/reverse_kl"]) < 1e-3 and first["time/teacher_s"] > 0
    assert math.isfinite(second["opd/reverse_kl"]) and abs(second["opd/reverse_kl"]) > abs(first["opd/reverse_kl"])
    assert second["opd/teacher_logp"] < 0


def test_gspo_sequence_ratio_is_warned_about_and_gspo_token_is_not(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        load(tmp_path, TEACHER + ["importance_sampling=seq"])
    assert any("averaged away" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        load(tmp_path, TEACHER + ["importance_sampling=gspo-token"])
    assert not any("averaged away" in r.getMessage() for r in caplog.records)


def test_a_teacher_block_without_use_opd_is_warned_about(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="roll_gspo.config"):
        cfg = load(tmp_path, TEACHER[1:])
    assert not cfg.uses_teacher() and any("use_opd is false" in r.getMessage() for r in caplog.records)
