"""The evaluation command: a model on a task set through vLLM, per task greedy accuracy, pass@k and
maj@k (`python -m roll_gspo.eval --model M --tasks chain_sum builtin:arith_easy`).

It reads the validation rows training reads (`write_task_data(..., "val")`, the same template and
prompt filter through `roll_gspo.data.prompts.load_prompts`), scores every reply with the reward
workers' scorer (`roll_gspo.tasks.score_reply`: the same answer extraction) and computes pass@k with
`roll_gspo.tasks.sample_metrics`, as training validation does (`val/pass@k`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from roll_gspo.eval.errors import EvalInputError
from roll_gspo.tasks import TaskSpec

if TYPE_CHECKING:
    from roll_gspo.schema.config import ModelArgs

logger = logging.getLogger(__name__)
# Replies generated between two progress lines: a few engine batches, so chunking costs nothing.
PROGRESS_CHUNK_REPLIES = 1024


def resolve_eval_model(model: str, base_model: Optional[str] = None, model_args: Optional["ModelArgs"] = None) -> str:
    """A Hugging Face folder for what `--model` names: a folder (a run's `final_model/` is one), a
    run's output_dir (its final_model/, else its latest checkpoint), a training checkpoint
    (`checkpoints/step_N/`: its weights with `base_model`'s config and tokenizer, see
    `checkpoint_model`; a LoRA run's with its adapter merged, which needs the run's actor_train
    `model_args`), a `.gguf` file or a `builtin:` name (converted or built once into the cache)."""
    from roll_gspo.builtin.models import resolve_model
    from roll_gspo.eval.checkpoint_model import checkpoint_model, is_checkpoint
    from roll_gspo.lifecycle.checkpoint import complete_checkpoints

    path = os.path.abspath(os.path.expanduser(model)) if not model.startswith("builtin:") else model
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        final = os.path.join(path, "final_model")
        if os.path.isfile(os.path.join(final, "config.json")):  # a run's output_dir
            return final
        if is_checkpoint(path):
            return checkpoint_model(path, base_model, model_args=model_args)
        saved = complete_checkpoints(path)
        if saved:  # a run stopped before its end: no final_model/ yet, its latest checkpoint
            return checkpoint_model(saved[-1], base_model, model_args=model_args)
        raise EvalInputError(f"--model {model!r} is a folder without config.json: give a Hugging Face model folder "
                             f"(a run's final_model/ or output_dir), a training checkpoint (checkpoints/step_N/, with "
                             f"--config), a .gguf file or a builtin: name")
    return resolve_model(model)


def specs_from_names(names: Sequence[str], *, val_size: Optional[int] = None,
                     configs: Optional[Dict[str, Dict[str, Any]]] = None) -> List[TaskSpec]:
    """One spec per task name (`chain_sum`, `rg:chain_sum`, `builtin:arith`), keyed by the name
    without its prefix; `configs`: name -> the generator's config."""
    specs = []
    for name in names:
        key = name.partition(":")[2] or name
        spec = TaskSpec(key=key, name=name, config=dict((configs or {}).get(name) or (configs or {}).get(key) or {}))
        if val_size is not None:
            spec.val_size = val_size
        specs.append(spec)
    return specs


def evaluate(model: str, specs: Sequence[TaskSpec], *, n: int = 8, ks: Optional[Sequence[int]] = None,
             temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 256, prompt_length: int = 1024,
             template: Optional[str] = None, dtype: str = "fp32", seed: int = 0,
             engine_config: Optional[Dict[str, Any]] = None, env: Optional[Dict[str, str]] = None,
             keep_replies: int = 3, base_model: Optional[str] = None,
             model_args: Optional["ModelArgs"] = None) -> Dict[str, Any]:
    """Greedy accuracy (one greedy reply per prompt) and, with n > 1, pass@k and maj@k over n
    sampled replies (temperature, top_p), per task and over all prompts.

    Returns `{"model", "settings", "tasks": {key: metrics}, "all": metrics, "examples"}`; metrics:
    `prompts`, `greedy_accuracy`, `greedy_format_rate`, `pass@k`, `maj@k`, `mean_reply_tokens`,
    `greedy_truncated_rate`.
    `env`: environment variables for vLLM (default: the rollout workers', e.g. its 1 GiB CPU KV cache).
    `base_model`: the run's model when `model` is a training checkpoint (`resolve_eval_model`);
    `model_args`: the run's actor_train.model_args (a LoRA checkpoint's adapter settings)."""
    from transformers import AutoTokenizer

    from roll_gspo.schema.config import GeneratingArgs, RoleConfig
    from roll_gspo.data.prompts import load_prompts
    from roll_gspo.lifecycle.seeding import rollout_seeds
    from roll_gspo.rewards.answers import extract_answer
    from roll_gspo.rewards.shaping import decode_for_reward
    from roll_gspo.strategies.vllm_strategy import VllmStrategy
    from roll_gspo.tasks import (answer_spread, grouped_sample_metrics, reference_answer, score_reply, spec_problems,
                                 write_task_data)

    problems = [p for spec in specs for p in spec_problems(spec, f"--tasks {spec.name or spec.key}")]
    if problems:
        raise EvalInputError("; ".join(problems))
    started = time.perf_counter()
    folder = resolve_eval_model(model, base_model, model_args)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    items, stats = load_prompts([write_task_data(specs, "val")], default_domain="tasks", tokenizer=tokenizer,
                                max_prompt_length=prompt_length, template=template)
    from roll_gspo.distributed.cluster import DEFAULT_WORKER_ENV

    for key, value in {**DEFAULT_WORKER_ENV, **(env or {})}.items():  # what a rollout worker runs with
        os.environ.setdefault(key, str(value))
    role = RoleConfig()
    role.model_args.model_name_or_path, role.model_args.dtype = folder, dtype
    role.strategy_args.strategy_config = dict(engine_config or {})
    engine = VllmStrategy(role, max_model_len=stats["max_prompt_tokens"] + max_new_tokens, seed=seed,
                          config_key="--engine-config")
    loaded = time.perf_counter()
    prompt_ids = [item["prompt_ids"] for item in items]

    def replies(gen: GeneratingArgs, count: int, step: int):
        seeds = rollout_seeds(seed, step, len(items), "validation")
        what = "greedy replies" if count == 1 else f"x {count} sampled replies (temperature {gen.temperature})"
        out = []
        # In chunks of ~PROGRESS_CHUNK_REPLIES replies, each a full engine batch, so a long evaluation
        # says how far it is (a CPU run of 600 prompts x 8 takes tens of minutes).
        chunk, t0 = max(1, PROGRESS_CHUNK_REPLIES // count), time.perf_counter()
        for start in range(0, len(prompt_ids), chunk):
            out += engine.generate(prompt_ids[start:start + chunk], gen, count, seeds=seeds[start:start + chunk])
            spent = time.perf_counter() - t0
            left = spent / len(out) * (len(prompt_ids) - len(out))
            logger.info("%d/%d prompts %s: %.0f s, ~%.0f s left", len(out), len(prompt_ids), what, spent, left)
        flat = [sample for samples in out for sample in samples]
        texts = decode_for_reward(tokenizer, [ids for ids, _, _ in flat])
        rows = [item for item in items for _ in range(count)]
        scores = [score_reply(r["prompt_text"], t, r["ground_truth"]) for r, t in zip(rows, texts)]
        return rows, texts, scores, [len(ids) for ids, _, _ in flat], [not done for _, _, done in flat]

    g_rows, g_texts, g_scores, g_lengths, g_cut = replies(GeneratingArgs(temperature=0.0, max_new_tokens=max_new_tokens), 1, 0)
    sampled = None
    if n > 1:
        sampled = replies(GeneratingArgs(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens), n, 1)
    done = time.perf_counter()

    def summary(keep) -> Dict[str, float]:
        picked = [i for i, r in enumerate(g_rows) if keep(r["domain"])]
        found = {"prompts": float(len(picked)),
                 "greedy_accuracy": _mean(g_scores[i].metrics["accuracy"] for i in picked),
                 "greedy_format_rate": _mean(g_scores[i].metrics["format_rate"] for i in picked),
                 "mean_reply_tokens": _mean(g_lengths[i] for i in picked),
                 # greedy replies cut at max_new_tokens (no end-of-sequence token): scored as written
                 "greedy_truncated_rate": _mean(float(g_cut[i]) for i in picked)}
        domains = {g_rows[i]["domain"] for i in picked}
        if len(domains) == 1:  # one task: could one answer repeated score this? (training validation's too)
            spread = answer_spread([g_rows[i]["domain"] for i in picked], [extract_answer(g_texts[i]) for i in picked],
                                   [reference_answer(g_rows[i]["ground_truth"]) for i in picked])
            found.update({k.split("/", 1)[1]: v for k, v in spread.items()})
        if sampled is not None:
            rows, texts, scores, _, _ = sampled
            kept = [i for i, r in enumerate(rows) if keep(r["domain"])]
            found.update(grouped_sample_metrics([rows[i]["domain"] for i in kept],
                                                [scores[i].metrics["accuracy"] for i in kept],
                                                [extract_answer(texts[i]) for i in kept], n, ks))
            found = {k: v for k, v in found.items() if "/" not in k}  # this summary's own, not per domain
        return found

    keys = [spec.key for spec in specs]
    examples = {key: [{"prompt": r["prompt_text"], "reply": t, "answer": extract_answer(t),
                       "gold": json.loads(r["ground_truth"]).get("answer"), "accuracy": s.metrics["accuracy"]}
                      for r, t, s in zip(g_rows, g_texts, g_scores) if r["domain"] == key][:keep_replies]
                for key in keys}
    return {"model": model, "model_folder": folder,
            "settings": {"n": n, "ks": list(ks) if ks else None, "temperature": temperature, "top_p": top_p,
                         "max_new_tokens": max_new_tokens, "template": template, "dtype": dtype, "seed": seed,
                         "tasks": [{k: v for k, v in vars(s.resolved()).items()} for s in specs]},
            "tasks": {key: summary(lambda d, key=key: d == key) for key in keys},
            "all": summary(lambda d: True),
            "seconds": {"load": round(loaded - started, 1), "generate": round(done - loaded, 1)},
            "examples": examples}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def format_table(result: Dict[str, Any]) -> str:
    """The console table: one row per task and `all`, one column per metric. `top_ans`: the share of
    greedy replies giving the task's most common answer; `const`: the accuracy of the best constant
    answer (both per task: accuracy near `const` with `top_ans` near 1 is one answer repeated)."""
    rows = {**result["tasks"], "all": result["all"]}
    columns = ["prompts", "greedy_accuracy", "greedy_format_rate", "greedy_truncated_rate", "top_answer_share",
               "constant_answer_accuracy"]
    columns += sorted({k for r in rows.values() for k in r if k.startswith("pass@")}, key=_k_order)
    columns += sorted({k for r in rows.values() for k in r if k.startswith("maj@")}, key=_k_order)
    heads = {"prompts": "prompts", "greedy_accuracy": "greedy", "greedy_format_rate": "format",
             "greedy_truncated_rate": "cut", "top_answer_share": "top_ans", "constant_answer_accuracy": "const"}
    width = max(len("task"), *(len(k) for k in rows))
    lines = ["  ".join(["task".ljust(width)] + [heads.get(c, c).rjust(7) for c in columns])]
    for key, metrics in rows.items():
        cells = [f"{int(metrics[c]):7d}" if c == "prompts" else
                 (f"{metrics[c]:7.3f}" if c in metrics else "      -") for c in columns]
        lines.append("  ".join([key.ljust(width)] + cells))
    return "\n".join(lines)


def _k_order(name: str) -> int:
    return int(name.split("@")[1])


# Screening candidate tasks for RL (issue 54): RL mostly turns pass@k into pass@1, so a task is worth
# training where the model already solves some prompts (greedy 5-50 %), sampling solves more (the
# headroom, pass@k minus greedy) and no single answer wins by being repeated.
SCREEN_GREEDY_RANGE = (0.05, 0.5)
SCREEN_DOMINANCE = 2.0  # the most common greedy answer's share over this many times the gold's top share


def screen_tasks(result: Dict[str, Any], greedy_range: Tuple[float, float] = SCREEN_GREEDY_RANGE,
                 dominance: float = SCREEN_DOMINANCE) -> List[Dict[str, Any]]:
    """`evaluate`'s per-task figures as screening rows, best first: eligible tasks by headroom, then
    the others by headroom with why each was left out. A row: task, greedy, pass@k (the largest k
    measured), k, headroom, top_answer_share, gold_top_share, reply_tokens, format_rate, eligible, why."""
    rows = []
    for task, m in result["tasks"].items():
        ks = sorted((k for k in m if k.startswith("pass@")), key=_k_order)
        best = m[ks[-1]] if ks else None
        greedy = m.get("greedy_accuracy", 0.0)
        top, gold = m.get("top_answer_share"), m.get("constant_answer_accuracy")
        why = []
        if not greedy_range[0] <= greedy <= greedy_range[1]:
            why.append(f"greedy {greedy:.2f} outside {greedy_range[0]:.2f}-{greedy_range[1]:.2f}")
        if best is None:
            why.append("no pass@k (run with --n > 1)")
        if top is not None and gold is not None and top > dominance * max(gold, 1e-9):
            why.append(f"one answer dominates ({top:.2f} of replies, {gold:.2f} of the gold)")
        rows.append({"task": task, "greedy": greedy, "pass@k": best, "k": _k_order(ks[-1]) if ks else None,
                     "headroom": None if best is None else best - greedy, "top_answer_share": top,
                     "gold_top_share": gold, "reply_tokens": m.get("mean_reply_tokens"),
                     "format_rate": m.get("greedy_format_rate"), "eligible": not why, "why": "; ".join(why)})
    return sorted(rows, key=lambda r: (not r["eligible"], -(r["headroom"] if r["headroom"] is not None else -1)))


def format_screen(rows: Sequence[Dict[str, Any]]) -> str:
    """The screening table, one line per task, best first."""
    width = max([len("task")] + [len(r["task"]) for r in rows])
    lines = [f"{'task'.ljust(width)}  greedy  pass@k  headroom  top_ans  gold_top  tokens  format  verdict"]
    for r in rows:
        cell = lambda v, f="{:7.3f}": f.format(v) if v is not None else "      -"  # noqa: E731
        lines.append(f"{r['task'].ljust(width)}  {cell(r['greedy'], '{:6.3f}')}  {cell(r['pass@k'], '{:6.3f}')}  "
                     f"{cell(r['headroom'], '{:8.3f}')}  {cell(r['top_answer_share'])}  {cell(r['gold_top_share'], '{:8.3f}')}"
                     f"  {cell(r['reply_tokens'], '{:6.1f}')}  {cell(r['format_rate'], '{:6.3f}')}  "
                     f"{'train' if r['eligible'] else 'skip: ' + r['why']}")
    return "\n".join(lines)
