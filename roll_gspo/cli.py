"""`python run_pipeline.py --config NAME [overrides...]`: load, check, then run a pipeline."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from roll_gspo.config import ConfigError, config_to_yaml, load_config, preflight
from roll_gspo.utils.logging import setup_logging

logger = logging.getLogger("roll_gspo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_pipeline.py",
        description="Run a roll_gspo pipeline from one YAML config plus Hydra-style overrides.",
        epilog="Overrides use Hydra's grammar: key=value, +new.key=value, ~key. "
               "Example: run_pipeline.py --config example_gspo.yaml max_steps=2 "
               "actor_train.training_args.learning_rate=1e-6")
    parser.add_argument("--config", required=True,
                        help="YAML path, or a name found in examples/ or configs/ (e.g. example_gspo.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults filled in) and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate config, data files, model folder and reward functions without "
                             "starting Ray; exit 0 if all is well, 1 with the errors otherwise")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="with --dry-run: print an estimate of memory per device (weights, gradients, "
                             "optimizer by ZeRO stage, activations, vLLM KV cache) for devices of this many GiB "
                             "and exit 1 when a role does not fit")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device_memory_gb is not None and (not args.dry_run or args.device_memory_gb <= 0):
        # Accepted flags act: the estimate only runs with --dry-run, for a positive device size.
        parser.error("--device-memory-gb needs --dry-run and a size > 0 (GiB per device)")
    setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(config_to_yaml(cfg), end="")
            return 0
        preflight(cfg)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        if args.device_memory_gb and _memory_plan_fails(cfg, args.device_memory_gb):
            return 1
        print(f"dry run: config {args.config!r} is valid ({cfg.pipeline} pipeline, "
              f"{cfg.max_steps} steps, output in {cfg.output_dir})")
        return 0
    from pipelines import run_pipeline_from_config
    from roll_gspo.checkpoint import CheckpointError
    from roll_gspo.distributed.cluster import WorkerDiedError
    from roll_gspo.distributed.placement import PlacementError

    try:
        run_pipeline_from_config(cfg)
    except PlacementError as exc:  # the cluster cannot hold the device_mapping: nothing started
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (WorkerDiedError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # a second SIGINT/SIGTERM, or Ctrl-C before the step loop
        print(f"stopped at once ({exc or 'interrupted'}); resume from the last complete checkpoint with "
              f"resume_from_checkpoint=auto", file=sys.stderr)
        return 130
    return 0


def _memory_plan_fails(cfg, device_memory_gb: float) -> bool:
    from roll_gspo.memory_plan import config_memory_plan

    text, problems = config_memory_plan(cfg, device_memory_gb)
    print(text)
    for problem in problems:
        print(f"error: does not fit: {problem}", file=sys.stderr)
    return bool(problems)
