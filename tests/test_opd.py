"""On-policy distillation (`use_opd`, `is_pure_opd`, `opd_kl_coef`, the `teacher` block, `opsd`): the
per-token reverse-KL term against a hand computation (roll_gspo.algorithms.distillation), the refusals
before workers start (roll_gspo.config.checks.opd: no teacher, a negative coefficient, the agentic
pipeline, a teacher whose tokenizer is not the student's, pure and mixed modes at once, opsd without
a mode or with a template that holds no answer), self-distillation's privileged prompts lined up with
the student's tokens, and a trained teacher teaching a random student in two steps (pure OPD and
OPD beside a task reward)."""
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
    assert not cfg.uses_teacher() and any("use_opd and is_pure_opd are false" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------
# Pure OPD (ROLL's is_pure_opd) and self-distillation (opsd): keys and refusals
# --------------------------------------------------------------------------------------------
PURE = ["is_pure_opd=true"] + TEACHER[1:]


def test_pure_opd_starts_the_teacher_and_is_refused_beside_use_opd(tmp_path):
    cfg = load(tmp_path, PURE)
    assert cfg.is_pure_opd and not cfg.use_opd and cfg.uses_teacher()
    message = refusal(tmp_path, PURE + ["use_opd=true"])
    assert "is_pure_opd and use_opd are both true" in message
    assert "is_pure_opd: true needs a `teacher` block" in refusal(tmp_path, ["is_pure_opd=true"])


def test_opsd_teacher_follows_the_student_and_needs_a_distillation_mode(tmp_path):
    cfg = load(tmp_path, ["use_opd=true", "opsd=true", "+teacher.strategy_args.strategy_name=hf_infer"])
    assert cfg.uses_teacher() and cfg.teacher.model_args.model_name_or_path == cfg.actor_train.model_args.model_name_or_path
    message = refusal(tmp_path, ["opsd=true"])
    assert message.count("opsd:") >= 1 and "use_opd: true" in message and "is_pure_opd: true" in message


@pytest.mark.parametrize("template, reason", [
    ("Be careful.\n", "no {demonstration} field"),
    ("{demonstration} for {question}", "fields other than {demonstration}: ['question']"),
    ("{demonstration", "does not format"),
])
def test_an_opsd_template_that_cannot_hold_the_answer_is_refused(tmp_path, template, reason):
    message = refusal(tmp_path, PURE + ["opsd=true", f"opsd_template='{template}'"])
    assert "opsd_template" in message and reason in message


def test_opsd_hint_and_privileged_prompts():
    from roll_gspo.algorithms.distillation import opsd_hint, privileged_prompts

    assert opsd_hint("Reference answer: {demonstration}\n", "12") == "Reference answer: 12\n"
    assert opsd_hint("{{literal}} {demonstration}", "3") == "{literal} 3"
    assert privileged_prompts([[5, 6], [7]], [[1, 2], []]) == [[1, 2, 5, 6], [7]]
    with pytest.raises(ValueError, match="2 prompts but 1 hints"):
        privileged_prompts([[5], [6]], [[1]])


def test_the_opsd_teacher_scores_the_students_tokens_after_the_hint(tmp_path, tiny_model):
    """The teacher's view lays out hint + prompt + response per row, and the teacher's (B, T)
    log-probs from it are those of the response tokens the student sampled, read one by one from
    a forward pass over each row's hinted sequence alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.teacher import teacher_view
    from roll_gspo.distributed.batch import Batch
    from roll_gspo.models.causal_lm import build_sequences, response_token_log_probs

    cfg = load(tmp_path, PURE + ["opsd=true", "opsd_template='={demonstration};'"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    prompts, responses = [tokenizer.encode("3+4=", add_special_tokens=False), tokenizer.encode("12+30=", add_special_tokens=False)], [tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id], tokenizer.encode("402", add_special_tokens=False)]
    batch = Batch(meta={"prompt_ids": prompts, "response_ids": responses, "ground_truth": ["7", "42"]})
    ids, attention, lengths, mask = build_sequences(prompts, responses, tokenizer.pad_token_id)
    trainer = Batch({"input_ids": ids, "attention_mask": attention, "prompt_lengths": lengths, "response_mask": mask})
    assert teacher_view(load(tmp_path, PURE), tokenizer, batch, trainer) is trainer  # without opsd: unchanged
    view = teacher_view(cfg, tokenizer, batch, trainer)
    assert torch.equal(view["response_mask"], mask)
    hints = [tokenizer.encode("=7;", add_special_tokens=False), tokenizer.encode("=42;", add_special_tokens=False)]
    assert view["prompt_lengths"].tolist() == [len(h) + len(p) for h, p in zip(hints, prompts)]
    with torch.no_grad():
        scored, _ = response_token_log_probs(model, view["input_ids"], view["attention_mask"], view["prompt_lengths"],
                                             mask.shape[1])
        plain, _ = response_token_log_probs(model, ids, attention, lengths, mask.shape[1])
        for row, (hint, prompt, response) in enumerate(zip(hints, prompts, responses)):
            sequence = torch.tensor([hint + prompt + response])
            logp = torch.log_softmax(model(input_ids=sequence).logits[0].float(), -1)
            start = len(hint) + len(prompt)
            expected = torch.stack([logp[start - 1 + t, token] for t, token in enumerate(response)])
            assert torch.allclose(scored[row, :len(response)], expected, atol=1e-5)
    assert not torch.allclose(scored * mask, plain * mask)  # the hint reached the teacher's context


# --------------------------------------------------------------------------------------------
# Learning: a trained teacher teaches a random student (pure OPD, and OPD beside a task reward)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_teacher(tmp_path_factory, tiny_model, ray_session):
    """The session's random micro model after a short run of the built-in warm start's SFT config
    (configs/sft_tiny_arith.yaml: 512 rows, 2 epochs): it has learnt the answer format (digits,
    then <eos>) that the random student has not."""
    from pipelines.sft_pipeline import run_sft

    output = tmp_path_factory.mktemp("opd_teacher")
    cfg = load_config("sft_tiny_arith.yaml", [f"output_dir={output}", f"pretrain={tiny_model}", "track_with=none",
                                              "actor_train.data_args.max_samples=512",
                                              "actor_train.training_args.num_train_epochs=2",
                                              "actor_train.training_args.per_device_train_batch_size=32",
                                              "actor_train.world_size=1", "actor_train.num_cpus_per_worker=1"])
    run_sft(cfg)
    return str(output / "final_model")


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["is_pure_opd", "use_opd"])
def test_a_trained_teacher_teaches_a_random_student_in_two_steps(tmp_path, tiny_model, trained_teacher, mode):
    """Two steps of 8 prompts x 4: the student's samples become likelier under the teacher (its
    token mean log-prob up by > 1 nat from about -8) and the reverse KL falls, with the teacher
    term alone (is_pure_opd: the digit-fraction reward is logged, not trained on, and rises
    anyway: the teacher answers in digits) and beside that reward (use_opd). Measured on an idle
    machine's first run: teacher log-prob -7.99 -> -5.74 (pure) / -6.00; reverse KL 3.41 -> 2.92 / 2.76."""
    from tests.test_pipeline_e2e import run, write_config

    cfg = write_config(tmp_path, tiny_model, max_steps=2, rollout_batch_size=8, opd_kl_coef=1.0,
                       importance_sampling="token", pg_clip_low=0.2, pg_clip_high=0.28, **{mode: True},
                       teacher={"model_args": {"model_name_or_path": trained_teacher},
                                "strategy_args": {"strategy_name": "hf_infer"}, "num_cpus_per_worker": 0.25},
                       actor_infer={"strategy_args": {"strategy_name": "hf_infer", "strategy_config": {}}},
                       actor_train={"world_size": 1, "training_args": {"learning_rate": 2e-2,
                                                                       "per_device_train_batch_size": 8},
                                    "data_args": {"file_name": ["builtin:arith_easy/train"]}})
    assert cfg.uses_teacher() and cfg.is_pure_opd == (mode == "is_pure_opd")
    records = [r for r in run(cfg) if "opd/reverse_kl" in r]
    assert [r["step"] for r in records] == [1, 2] and all(r["time/teacher_s"] > 0 for r in records)
    first, second = records
    assert second["opd/teacher_logp"] > first["opd/teacher_logp"] + 1.0, (first, second)
    assert second["opd/reverse_kl"] < first["opd/reverse_kl"] - 0.2, (first, second)
    assert second["reward/mean"] > first["reward/mean"]
