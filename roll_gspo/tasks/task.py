"""A task: prompts from a source, their template, and the reward that scores a reply to them.

`TaskSpec` is one `tasks.<key>` block of a run (or one `--tasks` name of the evaluation command).
Its rows are chat rows (`messages`: an optional system turn, the question as the user turn),
`ground_truth` (the JSON of how to score a reply) and `domain` (the task's key: the per-task
metrics' name). `score_reply` is the one scorer of a reply: the reward worker and the evaluation
command call it, so training rewards, validation and evaluation read answers the same way.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence

from roll_gspo.rewards.answers import extract_answer, has_answer_format
from roll_gspo.rewards.scoring import ScoreWithMetrics
from roll_gspo.tasks.sources import SOURCES, resolve_task

# Validation rows start this far from the train seed by default: a train set of fewer rows never
# shares a seed with them (reasoning-gym draws entry i from seed + i).
VAL_SEED_OFFSET = 1_000_000
TASK_DATA_VERSION = "v1"  # bump when rows change for the same spec


@dataclasses.dataclass
class TaskSpec:
    """One task of a run, its fields as `tasks.<key>` writes them (schema: `TaskConfig`)."""
    key: str
    name: Optional[str] = None  # in its source; null: the key
    source: Optional[str] = None  # null: the source holding `name` (or its prefix's)
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    weight: float = 1.0
    train_size: int = 1000
    val_size: int = 100
    seed: int = 0
    val_seed: Optional[int] = None
    system_prompt: Optional[str] = None
    format_weight: float = 0.0
    partial_credit: bool = False
    reward: str = "tasks"

    def resolved(self) -> "TaskSpec":
        """The spec with `source`, `name`, `val_seed` and `system_prompt` filled in; ValueError for
        an unknown task (`resolve_task`)."""
        source, name = resolve_task(self.name or self.key, self.source)
        system = self.system_prompt if self.system_prompt is not None else SOURCES[source].default_system_prompt
        val_seed = self.val_seed if self.val_seed is not None else self.seed + VAL_SEED_OFFSET
        return dataclasses.replace(self, source=source, name=name, val_seed=val_seed, system_prompt=system)


def task_rows(spec: TaskSpec, split: str) -> List[dict]:
    """The rows of one split ("train" or "val") of a resolved spec: `{messages, ground_truth,
    domain, answer}`, `ground_truth` a JSON string `{task, source, format_weight, partial_credit, ...truth}`."""
    source = SOURCES[spec.source]
    pairs = source.generate(spec.name, dict(spec.config), split=split,
                            seeds={"train": spec.seed, "val": spec.val_seed},
                            sizes={"train": spec.train_size, "val": spec.val_size})
    rows = []
    for question, truth in pairs:
        messages = ([{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []) + [
            {"role": "user", "content": question}]
        full = {"task": spec.key, "source": spec.source, "format_weight": spec.format_weight,
                "partial_credit": spec.partial_credit, **truth}
        rows.append({"messages": messages, "ground_truth": json.dumps(full, sort_keys=True), "domain": spec.key,
                     "answer": truth["answer"]})
    return rows


def score_reply(prompt: str, response: str, ground_truth: str, **_) -> ScoreWithMetrics:
    """A task's reward for one reply: 1 when the extracted answer (`extract_answer`, no format
    needed) is correct, else 0, plus `format_weight` when a correct answer was written in the
    rewarded `<answer>` format. A wrong one earns no format credit: paid for the tags alone, SmolLM2
    learnt to reply `<answer>N</answer>` (the prompt's placeholder) and its accuracy collapsed
    (docs/benchmarks.md, LoRA seed 7). Near misses earn nothing: group normalisation would turn a part-paid wrong answer into
    a positive advantage. With `partial_credit` the answer term is the task's own score instead
    (reasoning-gym pays part of it for an answer holding the gold string). Carries per-reply
    metrics: `accuracy` (correct), `format_rate` (the format was written) and `answer_score`
    (the task's own score, partial credit included).

    ground_truth: a row's JSON (`task_rows`). A reward function (`fn(prompt, response, truth)`)."""
    truth = json.loads(ground_truth)
    answer = extract_answer(response)
    source = SOURCES[truth["source"]]
    score = source.score(answer, truth) if answer else 0.0
    correct = float(bool(answer) and source.is_correct(answer, truth, score))
    earned = max(score, correct) if truth.get("partial_credit", False) else correct
    formatted = float(has_answer_format(response))
    return ScoreWithMetrics(earned + float(truth.get("format_weight", 0.0)) * formatted * correct,
                            {"accuracy": correct, "format_rate": formatted, "answer_score": score})


def write_task_data(specs: Sequence[TaskSpec], split: str, cache_dir: Optional[str] = None) -> str:
    """The rows of `split` of every spec (resolved) in one JSONL file under the cache, named by the
    specs' content (written once); returns its path."""
    from roll_gspo.builtin.cache import build_atomically, cache_root

    resolved = [s.resolved() for s in specs]
    digest = hashlib.sha256(json.dumps([dataclasses.asdict(s) for s in resolved], sort_keys=True)
                            .encode()).hexdigest()[:16]
    folder = os.path.join(cache_root(cache_dir), "data", f"tasks-{TASK_DATA_VERSION}-{digest}")

    def build(tmp: str) -> None:
        for part in ("train", "val"):
            with open(os.path.join(tmp, f"{part}.jsonl"), "w", encoding="utf-8") as fh:
                for spec in resolved:
                    for row in task_rows(spec, part):
                        fh.write(json.dumps(row, ensure_ascii=False) + "\n")

    build_atomically(folder, build, what=f"task rows of {', '.join(s.key for s in resolved)}")
    return os.path.join(folder, f"{split}.jsonl")


def spec_problems(spec: TaskSpec, path: str) -> List[str]:
    """What is wrong with one spec, each problem naming its key under `path` (e.g. `tasks.sum`):
    an unknown task (with the nearest names), a config its source refuses (the source's message),
    a size below 1, a negative weight, validation seeds overlapping the training seeds."""
    problems = []
    for key in ("train_size", "val_size"):
        if getattr(spec, key) < 1:
            problems.append(f"{path}.{key} = {getattr(spec, key)}: a task needs at least 1 row (drop the task, "
                            f"or eval_steps: 0 for no validation)")
    if spec.weight < 0:
        problems.append(f"{path}.weight = {spec.weight}: must be >= 0")
    try:
        resolved = spec.resolved()
    except ValueError as e:
        return problems + [f"{path}.name: {e}"]
    refusal = SOURCES[resolved.source].config_problem(resolved.name, dict(resolved.config))
    if refusal:
        problems.append(f"{path}.config: {resolved.source} task {resolved.name!r} refuses it: {refusal}")
    if resolved.source == "reasoning_gym":
        train = range(resolved.seed, resolved.seed + resolved.train_size)
        val = range(resolved.val_seed, resolved.val_seed + resolved.val_size)
        if train.start < val.stop and val.start < train.stop:
            problems.append(f"{path}.val_seed = {resolved.val_seed}: validation seeds {val.start}..{val.stop - 1} "
                            f"overlap the training seeds {train.start}..{train.stop - 1} (seed, train_size)")
    return problems
