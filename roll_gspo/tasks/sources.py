"""Sources of tasks: where a task's questions come from and how its answers are scored.

A task source knows its task names, checks a task's config, generates `(question, truth)` pairs
from a seed, and scores an extracted answer against a truth. Two are built in: `reasoning_gym`
(every generator of the reasoning-gym package, scored by the generator's own `score_answer`)
and `builtin` (this project's `arith`, `arith_easy` and `choice`). `register_source` adds one.
"""
from __future__ import annotations

import difflib
import functools
import json
import re
from decimal import Decimal
from typing import Any, Dict, List, Optional, Sequence, Tuple

# What a task's system prompt asks for when the task names none: the rewarded format.
ANSWER_TAG_SYSTEM_PROMPT = ("Think briefly, then give the final answer inside <answer></answer> tags, "
                            "e.g. <answer>42</answer>.")


class TaskSource:
    """The interface of a source; `name` is what a task's `source:` (or a `name:` prefix) says."""

    name: str = ""
    #: The system prompt of its tasks when the task config gives none (None: no system turn).
    default_system_prompt: Optional[str] = None

    def task_names(self) -> List[str]:
        raise NotImplementedError

    def config_problem(self, task: str, config: Dict[str, Any]) -> Optional[str]:
        """Why `config` is not a config of `task` (the source's own words), or None."""
        raise NotImplementedError

    def generate(self, task: str, config: Dict[str, Any], *, split: str, seeds: Dict[str, int],
                 sizes: Dict[str, int]) -> List[Tuple[str, Dict[str, Any]]]:
        """`sizes[split]` pairs `(question, truth)` of `split` ("train" or "val"; `seeds` and
        `sizes` give both splits', so a source can keep one out of the other). `truth` is JSON-able
        and holds `answer` (the gold answer as text) and whatever `score` needs."""
        raise NotImplementedError

    def score(self, answer: str, truth: Dict[str, Any]) -> float:
        """The answer's score in [0, 1] by the task's own rule (1: correct; a source may pay part of
        it for a near miss, which a task's reward uses only with `partial_credit`)."""
        raise NotImplementedError

    def is_correct(self, answer: str, truth: Dict[str, Any], score: float) -> bool:
        """Whether `answer` (scored `score`) is right: the training reward without partial credit
        and the accuracy. A full score, unless the source knows more."""
        return score >= 1.0


class ReasoningGymSource(TaskSource):
    """reasoning-gym's generators (`reasoning_gym.create_dataset(name, seed=, size=, **config)`).
    Entry i of a data set is drawn from `seed + i` (most generators), so train rows
    (`seed .. seed+train_size-1`) and validation rows (from `val_seed`) never share a seed when the
    ranges do not overlap. A truth names the generator, its config, seed, size and the entry's index:
    the scorer regenerates the entry and calls the generator's own `score_answer`.

    `score_answer` pays `len(gold) / len(answer)` for any answer holding the gold string (a negated
    answer, a digit slip, a list of guesses), so correct is its full score only, or the gold number
    written another way (`+7`, `07`, `7.0`: generators such as basic_arithmetic and lcm compare
    strings, products compares numbers)."""

    name = "reasoning_gym"
    default_system_prompt = ANSWER_TAG_SYSTEM_PROMPT

    def task_names(self) -> List[str]:
        from reasoning_gym.factory import DATASETS

        return sorted(DATASETS)

    def config_problem(self, task: str, config: Dict[str, Any]) -> Optional[str]:
        try:
            # Some generators read their config only when drawing an entry (simple_equations'
            # `operators_weights` against `operators`): one entry is drawn.
            _rg_dataset(task, json.dumps(config, sort_keys=True), 0, 1)[0]
        except (TypeError, ValueError, AssertionError, IndexError, KeyError) as e:  # the generator's own message
            return f"{type(e).__name__}: {e}"
        return None

    def generate(self, task, config, *, split, seeds, sizes):
        seed, size = seeds[split], sizes[split]
        config_json = json.dumps(config, sort_keys=True)
        out = []
        for index in range(size):
            entry = _rg_entry(task, config_json, seed, size, index)
            out.append((str(entry["question"]), {"name": task, "config": config, "seed": seed, "size": size,
                                                 "index": index, "answer": str(entry["answer"])}))
        return out

    def score(self, answer, truth):
        config_json = json.dumps(truth["config"], sort_keys=True)
        dataset = _rg_dataset(truth["name"], config_json, truth["seed"], truth["size"])
        entry = _rg_entry(truth["name"], config_json, truth["seed"], truth["size"], truth["index"])
        try:
            return float(dataset.score_answer(answer, entry))
        except (ValueError, TypeError, ArithmeticError, IndexError):
            # Some generators parse the answer unguarded (prime_factorization's int() of each factor
            # raised on a reply's "1/2"): an answer its own task cannot read is a wrong one.
            return 0.0

    def is_correct(self, answer, truth, score):
        return score >= 1.0 or _same_decimal(answer, str(truth["answer"]))


_DECIMAL = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _same_decimal(answer: str, gold: str) -> bool:
    """Both are plain decimal numbers of one value: a correct number whatever its sign, leading
    zeros or trailing decimals (`+07.0` for `7`)."""
    answer, gold = answer.strip().replace("\u2212", "-"), gold.strip()
    return bool(_DECIMAL.fullmatch(answer) and _DECIMAL.fullmatch(gold)) and Decimal(answer) == Decimal(gold)


@functools.lru_cache(maxsize=64)
def _rg_dataset(task: str, config_json: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config_json))


@functools.lru_cache(maxsize=16384)
def _rg_entry(task: str, config_json: str, seed: int, size: int, index: int):
    """Entry `index` (a group's G responses share it: generated once)."""
    return _rg_dataset(task, config_json, seed, size)[index]


class BuiltinSource(TaskSource):
    """This project's generated tasks that a rule scores from the answer alone: `arith` (five
    levels; config `levels`), `arith_easy` (levels 1-2) and `choice` (a sum with three options,
    answered by letter). Their rows are the model's raw prompt (`12+34=`), so no system turn by
    default. Arithmetic validation prompts never occur in training (`make_arith_splits`)."""

    name = "builtin"
    default_system_prompt = None
    CONFIG_KEYS = {"arith": ("levels",), "arith_easy": (), "choice": ()}

    def task_names(self) -> List[str]:
        return sorted(self.CONFIG_KEYS)

    def config_problem(self, task, config):
        unknown = sorted(set(config) - set(self.CONFIG_KEYS[task]))
        if unknown:
            return (f"{task} takes no config key {unknown}"
                    + (f" (it reads {list(self.CONFIG_KEYS[task])})" if self.CONFIG_KEYS[task] else ""))
        if "levels" in config:
            from roll_gspo.builtin.arith import ARITH_LEVELS

            bad = [lv for lv in config["levels"] if lv not in ARITH_LEVELS]
            if bad or not config["levels"]:
                return f"levels {config['levels']!r}: each one of {list(ARITH_LEVELS)}, at least one"
        return None

    def generate(self, task, config, *, split, seeds, sizes):
        if task == "choice":
            from roll_gspo.builtin.tasks import make_choice_rows

            rows = make_choice_rows(sizes[split], seed=seeds[split])
        else:
            from roll_gspo.builtin.arith import make_arith_splits

            levels = config.get("levels", (1, 2) if task == "arith_easy" else (1, 2, 3, 4, 5))
            # Both splits from one call, which keeps val prompts out of train (the train seed
            # drives both).
            rows = make_arith_splits(seed=seeds["train"], n_train=sizes["train"], n_val=sizes["val"], n_sft=0,
                                     levels=levels)[split]
        return [(r["prompt"], {"name": task, "answer": str(r["ground_truth"])}) for r in rows]

    def score(self, answer, truth):
        gold = str(truth["answer"]).strip()
        if truth["name"] == "choice":
            from roll_gspo.rewards.multiple_choice import extract_choice

            letter, _ = extract_choice(answer)
            return 1.0 if letter == gold else 0.0
        return 1.0 if _same_number(answer, gold) else 0.0


def _same_number(answer: str, gold: str) -> bool:
    try:
        return float(answer) == float(gold)
    except (TypeError, ValueError):
        return str(answer).strip() == gold


SOURCES: Dict[str, TaskSource] = {}
# Prefixes a task name may carry to name its source (`rg:chain_sum`, `builtin:arith`).
PREFIXES: Dict[str, str] = {"rg": "reasoning_gym", "reasoning_gym": "reasoning_gym", "builtin": "builtin"}


def register_source(source: TaskSource, *prefixes: str) -> None:
    """Make `source` available to `tasks.<key>.source` and the name prefixes `prefixes`."""
    SOURCES[source.name] = source
    PREFIXES[source.name] = source.name
    for prefix in prefixes:
        PREFIXES[prefix] = source.name


register_source(ReasoningGymSource(), "rg")
register_source(BuiltinSource())


def source_names(source: str) -> List[str]:
    """The task names of a source; [] when its package is missing."""
    try:
        return SOURCES[source].task_names()
    except ImportError:
        return []


def resolve_task(name: str, source: Optional[str] = None) -> Tuple[str, str]:
    """`(source, task)` of a task name such as `chain_sum`, `rg:chain_sum` or `builtin:arith`.

    A name without a prefix (and no `source`) is looked up in every source; ValueError for an
    unknown name (with the nearest names), an unknown source, or a name two sources hold.
    """
    name = str(name).strip()
    prefix, sep, rest = name.partition(":")
    if sep:
        if prefix not in PREFIXES:
            raise ValueError(f"unknown task source {prefix!r} in {name!r}; sources: {sorted(PREFIXES)}")
        if source is not None and PREFIXES[prefix] != source:
            raise ValueError(f"task {name!r} names source {PREFIXES[prefix]!r}, but source is {source!r}")
        source, name = PREFIXES[prefix], rest
    if source is not None and source not in SOURCES:
        raise ValueError(f"unknown task source {source!r}; sources: {sorted(SOURCES)}")
    searched = [source] if source is not None else list(SOURCES)
    holders = [s for s in searched if name in source_names(s)]
    if len(holders) == 1:
        return holders[0], name
    if len(holders) > 1:
        raise ValueError(f"task {name!r} exists in sources {holders}; write it as "
                         f"{' or '.join(f'{s}:{name}' for s in holders)}")
    missing = [s for s in searched if not _importable(s)]
    every = [n for s in searched for n in source_names(s)]
    close = difflib.get_close_matches(name, every, n=3, cutoff=0.5)
    raise ValueError(f"unknown task {name!r}" + (f" in source {source!r}" if source else "")
                     + (f"; nearest: {', '.join(close)}" if close else "")
                     + (f" (source {missing} not installed: pip install reasoning-gym==0.1.25)" if missing else ""))


def _importable(source: str) -> bool:
    try:
        SOURCES[source].task_names()
        return True
    except ImportError:
        return False


def all_task_names(sources: Optional[Sequence[str]] = None) -> List[str]:
    """Every `source:task` name (for listings)."""
    return [f"{s}:{n}" for s in (sources or SOURCES) for n in source_names(s)]
