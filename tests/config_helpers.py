"""What the tests of roll_gspo.config share: ROLL's GSPO seed block and the least config around it,
loading a config written to a temporary folder (and the ConfigError it must raise), the CLI in a
subprocess, the config logger's warnings, and every schema field by its full path."""
import dataclasses
import logging
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from roll_gspo.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "example_gspo.yaml"

# ROLL's GSPO configuration block, verbatim from its doc page (seed 004).
SEED_004 = """\
# GSPO related
adv_estimator: "reinforce"
importance_sampling: seq
rollout_batch_size: 64 # prompt
num_return_sequences_in_group: 8
prompt_length: 2048
response_length: 4096
# ppo related
ppo_epochs: 1
use_kl_loss: true
kl_loss_coef: 0.001
loss_agg_mode: "seq-mean-token-sum"
# advantage
whiten_advantages: true
advantage_clip: 2.0
dual_clip_loss: true
# clip
reward_clip: 10
# normalize
reward_norm: null
reward_shift: false
reward_scale: false
# reward
add_token_level_kl: false
"""
SEED_KEYS = [
    "adv_estimator", "importance_sampling", "rollout_batch_size", "num_return_sequences_in_group",
    "prompt_length", "response_length", "ppo_epochs", "use_kl_loss", "kl_loss_coef",
    "loss_agg_mode", "whiten_advantages", "advantage_clip", "dual_clip_loss", "reward_clip",
    "reward_norm", "reward_shift", "reward_scale", "add_token_level_kl",
]
# The least the seed block needs besides itself: training prompts and a mini-batch that divides
# 64 * 8 = 512 responses (8 * 8 * 1 = 64: 8 optimizer steps per rollout).
MINIMAL = """\
actor_train:
  training_args:
    per_device_train_batch_size: 8
    gradient_accumulation_steps: 8
  data_args:
    file_name: [builtin:arith/train]
  world_size: 1
"""
BASE = SEED_004 + MINIMAL


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def with_line(text, line):
    """`text` with a top-level `key: value` line replacing the key's line, or appended."""
    key = line.split(":", 1)[0] + ":"
    kept = [old for old in text.splitlines() if not old.startswith(key)]
    return "\n".join(kept + [line.rstrip("\n")]) + "\n"


# The seed config asks for 2048 + 4096 tokens; the built-in model holds 256 (preflight refuses more).
FITS_BUILTIN_MODEL = ["prompt_length=64", "response_length=128"]


def load(tmp_path, text=BASE, overrides=()):
    return load_config(write(tmp_path, text), list(overrides))


def problems(tmp_path, text=BASE, overrides=()):
    """The ConfigError message a config must raise."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, overrides)
    return str(info.value)


def run_cli(*args, timeout=180):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_COMPILE_DISABLE="1")
    return subprocess.run([sys.executable, "run_pipeline.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def config_log(caplog):
    """Records of logger roll_gspo.config, even when setup_logging() turned propagation off."""
    logger = logging.getLogger("roll_gspo.config")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="roll_gspo.config")
    yield caplog
    logger.removeHandler(caplog.handler)


def warning_messages(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "roll_gspo.config" and r.levelno == logging.WARNING]


def schema_fields(cls, prefix=""):
    """(full path, field) of every schema field, nested blocks included."""
    hints = typing.get_type_hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        path = f"{prefix}.{field.name}" if prefix else field.name
        out.append((path, field))
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            out += schema_fields(tp, path)
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            block = typing.get_args(tp)[1]
            out += schema_fields(block, f"{path}.<{'domain' if block.__name__ == 'RewardConfig' else 'tag'}>")
    return out


def small_qwen2_config_folder(folder: Path) -> str:
    """A model folder holding only a config: a small Qwen2 that holds ROLL's 8192-token trajectories
    (the host-memory plan of --dry-run fits it on this machine; nothing is loaded)."""
    import json

    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1024, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128,
        "tie_word_embeddings": True, "max_position_embeddings": 32768}))
    return str(folder)
