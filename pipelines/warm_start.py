"""Builder of `builtin:tiny-arith`: the random-init base model after a short SFT run
(configs/sft_tiny_arith.yaml), so RL starts from a model that knows the answer format but is
still often wrong. Registered with roll_gspo.builtin and run on first use, then cached."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

from roll_gspo.builtin import register_builtin_model

logger = logging.getLogger("roll_gspo")
SFT_CONFIG = "sft_tiny_arith.yaml"


def build_tiny_arith(folder: str) -> None:
    from roll_gspo.config import load_config

    from pipelines.sft_pipeline import greedy_accuracy, run_sft

    with tempfile.TemporaryDirectory(prefix="roll_gspo_sft_") as work:
        cfg = load_config(SFT_CONFIG, [f"output_dir={work}"])
        logger.info("warm-starting builtin:tiny-arith with SFT (%s); runs once, then cached", SFT_CONFIG)
        run_sft(cfg)
        for name in os.listdir(os.path.join(work, "final_model")):
            shutil.copy2(os.path.join(work, "final_model", name), folder)
    accuracy = greedy_accuracy(folder, ["builtin:arith/val"], max_new_tokens=8)
    logger.info("builtin:tiny-arith warm start: greedy validation accuracy %.3f", accuracy)


register_builtin_model("builtin:tiny-arith", build_tiny_arith)
