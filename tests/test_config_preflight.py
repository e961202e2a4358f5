"""Preflight in-process (roll_gspo.config.preflight): data files, reward functions, lengths the model
holds, and the CPU's precision (dtype against its matrix instructions, dtype: auto). Fast."""
import pytest

from roll_gspo.config import ConfigError, preflight
from tests.config_helpers import BASE, FITS_BUILTIN_MODEL, load, problems, write


# --------------------------------------------------------------------------------------------
# Data files and reward functions
# --------------------------------------------------------------------------------------------
def test_preflight_checks_data_files_in_process(tmp_path):
    good = tmp_path / "train.jsonl"
    good.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n')
    cfg = load(tmp_path, overrides=[f"actor_train.data_args.file_name=[{good}]", *FITS_BUILTIN_MODEL,
                                    "actor_infer.strategy_args.strategy_name=hf_infer"])
    preflight(cfg)
    bad = tmp_path / "train.txt"
    bad.write_text("x\n")
    cfg = load(tmp_path, overrides=[f"actor_train.data_args.file_name=[{bad}]",
                                    "validation.data_args.file_name=[builtin:arith/nope]",
                                    "actor_infer.strategy_args.strategy_name=hf_infer"])
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    message = str(info.value)
    assert "is not a .jsonl, .json or .parquet file" in message
    assert "unknown built-in data set 'builtin:arith/nope'" in message


@pytest.mark.parametrize("reward_fn, ok", [
    ("os.path:join", True), ("os.path.join", True),
    ("os.path:no_such_fn", False), ("no_such_module_abc:score", False),
])
def test_preflight_imports_reward_fn_in_process(tmp_path, reward_fn, ok):
    cfg = load(tmp_path, overrides=["rewards.math_rule.worker_cls=roll_gspo.workers.rewards.FunctionRewardWorker",
                                    f"rewards.math_rule.reward_fn={reward_fn}", *FITS_BUILTIN_MODEL,
                                    "actor_infer.strategy_args.strategy_name=hf_infer"])
    if ok:
        preflight(cfg)
    else:
        with pytest.raises(ConfigError, match=f"rewards.math_rule.reward_fn.*{reward_fn}"):
            preflight(cfg)


def test_function_reward_worker_needs_reward_fn(tmp_path):
    message = problems(tmp_path, overrides=["rewards.math_rule.worker_cls=roll_gspo.workers.rewards.FunctionRewardWorker"])
    assert "rewards.math_rule.reward_fn" in message


# --------------------------------------------------------------------------------------------
# Lengths the model holds
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["prompt_length=200", "response_length=100"],
     "prompt_length + response_length = 200 + 100 = 300, but the model 'builtin:tiny-arith' "
     "(actor_train.model_args.model_name_or_path, actor_infer.model_args.model_name_or_path"),
    (FITS_BUILTIN_MODEL + ["+actor_infer.strategy_args.strategy_config.max_model_len=8000"],
     "actor_infer.strategy_args.strategy_config.max_model_len = 8000, but the model 'builtin:tiny-arith'"),
])
def test_preflight_refuses_lengths_the_model_cannot_hold(tmp_path, overrides, expected):
    """A ROLL recipe's max_model_len: 8000 on a 256-position model used to reach vLLM's start-up as
    a worker trace; it is a config error naming the key and the limit now."""
    cfg = load(tmp_path, overrides=overrides)
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert expected in str(info.value) and "holds at most 256 tokens" in str(info.value)


def test_model_max_positions_reads_the_folder_and_rope_scaling(tmp_path):
    from roll_gspo.config.checks.preflight import model_max_positions

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    assert model_max_positions(str(tmp_path)) == 4096
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768, "rope_scaling": '
                                          '{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}')
    assert model_max_positions(str(tmp_path)) == 131072
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert model_max_positions(str(tmp_path)) is None
    assert model_max_positions("builtin:tiny-arith") == 256


# --------------------------------------------------------------------------------------------
# Precision on the CPU
# --------------------------------------------------------------------------------------------
def test_half_precision_on_a_cpu_without_its_matrix_instructions(tmp_path, monkeypatch):
    """fp16 on a CPU without fp16 instructions is refused before workers start, naming the key;
    bf16 without bf16 instructions is a warning (runs, slower than fp32)."""
    from roll_gspo.config.plan import cpu_precision

    cfg = load(tmp_path, BASE + "actor_infer:\n  strategy_args:\n    strategy_name: hf_infer\n",
               overrides=FITS_BUILTIN_MODEL + ["actor_train.model_args.dtype=fp16", "actor_infer.model_args.dtype=bf16"])
    epyc = ("avx2", "avx512f", "avx512_bf16")  # this project's machine: bf16 yes, fp16 no
    found = {f.key: f for f in cpu_precision.cpu_precision_findings(cfg, epyc)}
    assert list(found) == ["actor_train.model_args.dtype"] and found["actor_train.model_args.dtype"].level == "error"
    assert "use bf16" in found["actor_train.model_args.dtype"].text
    old = {f.key: f for f in cpu_precision.cpu_precision_findings(cfg, ("avx2", "avx512f"))}
    assert old["actor_train.model_args.dtype"].level == "error" and "use fp32" in old["actor_train.model_args.dtype"].text
    assert old["actor_infer.model_args.dtype"].level == "warning"
    assert old["actor_infer.model_args.dtype"].remedy == "fp32 is faster here and exact"
    assert cpu_precision.cpu_precision_findings(cfg, ("avx512_fp16", "amx_bf16")) == []
    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: epyc)
    with pytest.raises(ConfigError, match="actor_train.model_args.dtype = fp16 on a CPU without fp16"):
        preflight(cfg)


@pytest.mark.parametrize("flags, dtype, old_logprobs", [
    (("avx2", "avx512f"), "fp32", "rollout"),  # no bf16 instructions: fp32, vLLM's log-probs are the trainer's
    (("avx512f", "avx512_bf16"), "bf16", "trainer"),  # bf16 ones: bf16, the trainer's pass and the correction
    (("amx_bf16",), "bf16", "trainer"),
])
def test_dtype_auto_takes_the_cpus_faster_precision_with_one_notice(tmp_path, monkeypatch, flags, dtype, old_logprobs):
    from roll_gspo.config.plan import cpu_precision
    from roll_gspo.config.load.loader import load_config_findings
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    monkeypatch.setattr(cpu_precision, "cpu_flags", lambda: flags)
    text = BASE + "train_infer_correction: {is_weight: {enabled: true, weight_type: geometric, upper_bound: 1.2}}\n"
    cfg, findings = load_config_findings(write(tmp_path, text), FITS_BUILTIN_MODEL + [
        "actor_train.model_args.dtype=auto", "actor_infer.model_args.dtype=auto", "reference.model_args.dtype=fp32"])
    assert (cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype) == (dtype, dtype)
    assert cfg.reference.model_args.dtype == "fp32"  # written, not auto: left alone
    said = [f for f in findings if f.text.startswith(f"notice: dtype: auto -> {dtype}")]
    assert [f.key for f in said] == ["actor_train.model_args.dtype", "actor_infer.model_args.dtype"]
    assert len({f.text for f in said}) == 1 and "actor_train.model_args.dtype, actor_infer.model_args.dtype" in said[0].text
    assert choose_old_logprob_source(cfg).source == old_logprobs  # the correction acts only where the gap opens
    assert cpu_precision.cpu_precision_findings(cfg, flags) == []  # auto never picks what the CPU warns of


def test_dtype_auto_on_a_gpu_role_is_bf16(tmp_path):
    from roll_gspo.config.plan import cpu_precision

    cfg = load(tmp_path, overrides=FITS_BUILTIN_MODEL)
    cfg.actor_train.model_args.dtype = cfg.actor_infer.model_args.dtype = "auto"
    cfg.actor_infer.device_mapping = [0]
    texts = {f.key: f.text for f in cpu_precision.resolve_auto_dtypes(cfg, ("avx2",))}
    assert (cfg.actor_train.model_args.dtype, cfg.actor_infer.model_args.dtype) == ("fp32", "bf16")
    assert "GPU" in texts["actor_infer.model_args.dtype"] and "no bf16" in texts["actor_train.model_args.dtype"]
    assert cpu_precision.resolve_auto_dtypes(cfg, ("avx2",)) == []  # nothing left to choose
