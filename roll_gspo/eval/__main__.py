"""`python -m roll_gspo.eval --model M --tasks T [T ...]`: see roll_gspo.eval."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from roll_gspo.eval import evaluate, format_table, specs_from_names
from roll_gspo.eval.errors import EvalInputError
from roll_gspo.tasks import TaskSpec


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m roll_gspo.eval",
        description="Greedy accuracy, pass@k and maj@k (unbiased pass@k, Chen et al. 2021) of a model on tasks "
                    "(reasoning-gym and built-in), through vLLM: a table on the console and a JSON file.")
    p.add_argument("--list-tasks", action="store_true", help="print every task name (source:task) and exit")
    p.add_argument("--model", help="HF folder (a run's final_model/ or output_dir: its final_model/, else its "
                                   "latest checkpoint), a training checkpoint (checkpoints/step_N/, with --config; a LoRA "
                                   "one gets its adapter merged), "
                                   ".gguf file, or builtin: name")
    p.add_argument("--tasks", nargs="*", default=[], help="task names: chain_sum, rg:basic_arithmetic, "
                                                          "builtin:arith_easy, ...")
    p.add_argument("--task-config", action="append", default=[], metavar="NAME=JSON",
                   help="a task's generator config, e.g. chain_sum='{\"max_terms\": 2}' (repeatable)")
    p.add_argument("--config", help="a run's YAML: its `tasks`, template, lengths and vLLM strategy_config "
                                    "(what its validation reads); --tasks then adds tasks")
    p.add_argument("--val-size", type=int, help="validation rows per task (default: the task's val_size, 100)")
    p.add_argument("--n", type=int, default=8, help="sampled replies per prompt for pass@k / maj@k (1: greedy only)")
    p.add_argument("--k", type=int, nargs="*", help="ks of pass@k and maj@k (default 1, 2, 4, .., n)")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature of the --n replies (default: the config's rollout temperature, "
                        "actor_infer.generating_args.temperature, where pass@k measures what RL samples; else 1.0)")
    p.add_argument("--top-p", type=float, help="default: the config's rollout top_p, else 1.0")
    p.add_argument("--max-new-tokens", type=int, help="default: the config's validation max_new_tokens, else 256")
    p.add_argument("--prompt-length", type=int, help="longer prompts are dropped (default: the config's, else 1024)")
    p.add_argument("--template", help="chat template name (default: the config's data_args.template; else the "
                                      "tokenizer's own)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--screen", action="store_true",
                   help="rank the tasks for RL: greedy accuracy, pass@k, headroom (pass@k - greedy), the most "
                        "common answer's share beside the gold's, reply length, format rate; a task is kept at "
                        "5-50 %% greedy without one answer dominating, best headroom first (JSON: `screen`)")
    p.add_argument("--out", help="JSON file (default: eval_<model name>.json)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of --config, as run_pipeline.py takes them "
                                                "(a run's LoRA keys given on its command line, for example)")
    return p.parse_args(argv)


def _first_set(*values):
    return next(v for v in values if v is not None)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.list_tasks:
        from roll_gspo.tasks.sources import all_task_names

        print("\n".join(all_task_names()))
        return 0
    if not args.model:
        raise SystemExit("--model is required (a model folder, .gguf file or builtin: name)")
    if args.screen and args.n < 2:
        raise SystemExit("--screen needs --n >= 2 (pass@k from sampled replies)")
    from roll_gspo.utils.logging import setup_logging

    from pipelines.warm_start import register_warm_starts

    setup_logging()
    register_warm_starts()  # a warm start named by --model is built by its pipeline
    configs = {}
    for item in args.task_config:
        name, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--task-config {item!r}: expected NAME=JSON")
        configs[name] = json.loads(text)
    specs: List[TaskSpec] = []
    settings: Dict[str, Any] = {}
    if args.overrides and not args.config:
        raise SystemExit(f"overrides {args.overrides} need --config (they change the run's YAML)")
    if args.config:
        from roll_gspo.config.load.loader import load_config
        from roll_gspo.config.plan.tasks import task_specs

        cfg = load_config(args.config, args.overrides)
        specs = task_specs(cfg)
        settings = {"template": cfg.validation.data_args.template, "prompt_length": cfg.prompt_length,
                    "max_new_tokens": cfg.validation.generating_args.max_new_tokens,
                    "dtype": cfg.actor_infer.model_args.dtype,
                    "engine_config": dict(cfg.actor_infer.strategy_args.strategy_config),
                    "env": {**cfg.system_envs, **(cfg.actor_infer.system_envs or {})},
                    "base_model": cfg.actor_train.model_args.model_name_or_path,
                    "model_args": cfg.actor_train.model_args,  # a LoRA checkpoint's adapter settings
                    "temperature": cfg.actor_infer.generating_args.temperature,
                    "top_p": cfg.actor_infer.generating_args.top_p}
        if args.val_size is not None:
            for spec in specs:
                spec.val_size = args.val_size
    specs += specs_from_names(args.tasks, val_size=args.val_size, configs=configs)
    if not specs:
        raise SystemExit("no tasks: give --tasks or a --config with `tasks`")
    out = args.out or f"eval_{os.path.basename(os.path.normpath(args.model)).replace(':', '_')}.json"
    from roll_gspo.utils.logging import capture_output, configure_vllm_logging, use_log_dir

    # vLLM's, transformers' and the model build's output go to a log file beside the JSON, as a
    # run's go to its logs/; the console gets the table (and errors).
    log_dir = os.path.splitext(out)[0] + "_logs"
    use_log_dir(log_dir)
    configure_vllm_logging()
    restore = capture_output()
    try:
        result = evaluate(
            args.model, specs, n=args.n, ks=args.k,
            temperature=_first_set(args.temperature, settings.get("temperature"), 1.0),
            top_p=_first_set(args.top_p, settings.get("top_p"), 1.0),
            max_new_tokens=args.max_new_tokens or settings.get("max_new_tokens") or 256,
            prompt_length=args.prompt_length or settings.get("prompt_length") or 1024,
            template=args.template or settings.get("template"), dtype=args.dtype or settings.get("dtype") or "fp32",
            seed=args.seed, engine_config=settings.get("engine_config"), env=settings.get("env"),
            base_model=settings.get("base_model"), model_args=settings.get("model_args"))
    except EvalInputError as e:
        raise SystemExit(f"error: {e}") from None
    finally:
        if restore is not None:
            restore()
    print(format_table(result))
    if args.screen:
        from roll_gspo.eval import format_screen, screen_tasks

        result["screen"] = screen_tasks(result)
        print(format_screen(result["screen"]))
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out} (load {result['seconds']['load']} s, generate {result['seconds']['generate']} s; "
          f"logs: {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
