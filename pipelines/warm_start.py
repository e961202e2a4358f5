"""Builders of the built-in models that are warm starts. `builtin:tiny-arith` and `builtin:tiny-moe`:
the random-init base models after a short SFT run (configs/sft_tiny_arith.yaml,
configs/sft_tiny_moe.yaml), so RL starts from a model that knows the answer format but is still often
wrong, and `builtin:tiny-arith-teacher` (the same SFT on the true answers: on-policy distillation's
teacher); `builtin:tiny-frozenlake` and `builtin:tiny-calculator`: SFT on scripted episodes
(agentic_warm_start.py). roll_gspo.builtin lists their names and shapes; `register_warm_starts`,
called when `pipelines` is imported, gives them these builders, run on first use, then cached."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

from roll_gspo.builtin.models import register_builtin_model

logger = logging.getLogger("roll_gspo")
SFT_CONFIG = "sft_tiny_arith.yaml"
MOE_SFT_CONFIG = "sft_tiny_moe.yaml"
TEACHER_SFT_CONFIG = "sft_tiny_arith_teacher.yaml"


def warm_start(folder: str, sft_config: str, name: str) -> None:
    """Run the SFT pipeline with `sft_config` and copy its final model into `folder`."""
    from roll_gspo.config import load_config

    from pipelines.sft_pipeline import greedy_accuracy, run_sft

    with tempfile.TemporaryDirectory(prefix="roll_gspo_sft_") as work:
        cfg = load_config(sft_config, [f"output_dir={work}"])
        logger.info("warm-starting %s with SFT (%s); runs once, then cached", name, sft_config)
        run_sft(cfg)
        for entry in os.listdir(os.path.join(work, "final_model")):
            shutil.copy2(os.path.join(work, "final_model", entry), folder)
    accuracy = greedy_accuracy(folder, ["builtin:arith/val"], max_new_tokens=8)
    logger.info("%s warm start: greedy validation accuracy %.3f", name, accuracy)


def build_tiny_arith(folder: str) -> None:
    warm_start(folder, SFT_CONFIG, "builtin:tiny-arith")


def build_tiny_arith_teacher(folder: str) -> None:
    warm_start(folder, TEACHER_SFT_CONFIG, "builtin:tiny-arith-teacher")


def build_tiny_moe(folder: str) -> None:
    warm_start(folder, MOE_SFT_CONFIG, "builtin:tiny-moe")


def build_tiny_frozenlake(folder: str) -> None:
    from pipelines.agentic_warm_start import build_agentic_warm_start  # torch: only when it builds

    build_agentic_warm_start(folder, "builtin:tiny-frozenlake")


def build_tiny_calculator(folder: str) -> None:
    from pipelines.agentic_warm_start import build_agentic_warm_start

    build_agentic_warm_start(folder, "builtin:tiny-calculator")


def register_warm_starts() -> None:
    """Give the warm starts their builders (roll_gspo.builtin, a lower layer, names them without)."""
    register_builtin_model("builtin:tiny-arith", build_tiny_arith)
    register_builtin_model("builtin:tiny-arith-teacher", build_tiny_arith_teacher)
    register_builtin_model("builtin:tiny-moe", build_tiny_moe)
    register_builtin_model("builtin:tiny-frozenlake", build_tiny_frozenlake)
    register_builtin_model("builtin:tiny-calculator", build_tiny_calculator)
