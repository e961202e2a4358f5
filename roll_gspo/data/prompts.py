"""Prompt and SFT data loading (local JSONL / JSON / parquet via `datasets`) and prompt sampling."""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from roll_gspo import builtin
from roll_gspo.data.chat_templates import render_chat

# Data are local files only; never let `datasets` reach for a hub. Must be set before import.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

logger = logging.getLogger(__name__)

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _load_table(path: str) -> Tuple[List[str], Dict[str, list]]:
    """Column names and columns (as lists) of one local file."""
    import datasets

    ext = os.path.splitext(path)[1].lower()
    if ext not in _BUILDERS:
        raise ValueError(f"unsupported data file type {ext!r} for {path}; "
                         f"use one of {sorted(_BUILDERS)}")
    datasets.disable_progress_bars()  # "Generating train split" bars are noise in the run's console
    # Arrow cache under our cache root, so nothing lands in ~/.cache/huggingface unasked.
    cache = os.path.join(builtin.cache_root(), "hf_datasets")
    try:
        ds = datasets.load_dataset(_BUILDERS[ext], data_files=path, split="train", cache_dir=cache)
    except Exception as e:  # wrap so the message names the file
        raise ValueError(f"could not read data file {path}: {type(e).__name__}: {e}") from e
    return list(ds.column_names), ds.to_dict()


def _resolve_files(files: Sequence[str], dataset_dir: Optional[str] = None) -> List[str]:
    """Built-in names and paths; a relative path is looked up under `dataset_dir` first."""
    if isinstance(files, str):
        files = [files]
    if not files:
        raise ValueError("no data files given (set `data_args.file_name`)")
    return [builtin.resolve_data_file(_under_dataset_dir(f, dataset_dir)) for f in files]


def _under_dataset_dir(name: str, dataset_dir: Optional[str]) -> str:
    if not dataset_dir or name.startswith(builtin.BUILTIN_PREFIX) or os.path.isabs(name):
        return name
    candidate = os.path.join(dataset_dir, name)
    if os.path.exists(candidate):
        return candidate
    if not os.path.exists(name):
        raise ValueError(f"data file {name!r} found neither under dataset_dir ({candidate}) nor as written")
    return name


def _as_messages(value: Any) -> List[dict]:
    """Chat messages from a row: a list of {role, content}, or its JSON string (ROLL's data)."""
    if isinstance(value, str):
        value = json.loads(value)
    return list(value)


def _prompt_text(messages: Any, prompt: Any, tokenizer, template: Optional[str],
                 apply_chat_template: bool) -> Tuple[str, bool]:
    """(text, is_chat) of one row: messages (or, with a named template, the prompt as one user
    turn) rendered with the template; without one, messages use the tokenizer's template and a
    plain prompt is used as written."""
    if _present(messages):
        if template:
            return render_chat(template, tokenizer, _as_messages(messages)), True
        return _render_messages(_as_messages(messages), tokenizer, apply_chat_template), True
    if template:
        return render_chat(template, tokenizer, [{"role": "user", "content": str(prompt)}]), True
    return str(prompt), False


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, str) and not value.strip()) \
        and not (isinstance(value, (list, tuple)) and len(value) == 0)


def _render_messages(messages: Any, tokenizer, apply_chat_template: bool, *,
                     add_generation_prompt: bool = True) -> str:
    messages = list(messages)
    if apply_chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return "".join(str(m.get("content", "")) for m in messages)


def load_prompts(files: Sequence[str], *, prompt_key: str = "prompt",
                 messages_key: str = "messages", answer_key: str = "ground_truth",
                 domain_key: str = "domain", default_domain: str, tokenizer,
                 max_prompt_length: int, max_samples: Optional[int] = None,
                 apply_chat_template: bool = True, template: Optional[str] = None,
                 tag_key: str = "tag", dataset_dir: Optional[str] = None,
                 num_proc: Optional[int] = None,
                 require_columns: Sequence[str] = ()) -> Tuple[List[dict], Dict[str, Any]]:
    """Load prompts for RL: items ``{prompt_text, prompt_ids, ground_truth, domain}`` and stats.

    A row's chat ``messages`` (when present) are rendered with the tokenizer's chat template;
    otherwise ``prompt`` is used as is (tokenized with the tokenizer's special tokens, e.g. a bos).
    Prompts over ``max_prompt_length`` tokens are dropped and counted. ``max_samples`` keeps the
    first N kept prompts over all files. A named ``template`` (roll_gspo.data.chat_templates) renders
    messages and plain prompts alike. A row's reward route is its ``domain``, else its ``tag``
    column (``tag_key``), else ``default_domain``. ``num_proc`` > 1 tokenizes in that many
    processes. Columns in ``require_columns`` (e.g. ``difficulty``) must exist and are copied
    into the items.
    """
    paths = _resolve_files(files, dataset_dir)
    items: List[dict] = []
    stats: Dict[str, Any] = {"files": paths, "rows": 0, "filtered_prompts": 0, "prompts": 0,
                             "max_prompt_tokens": 0, "per_domain": {}}
    for path in paths:
        if max_samples is not None and len(items) >= max_samples:
            break
        columns, table = _load_table(path)
        n_rows = len(table[columns[0]]) if columns else 0
        if answer_key not in columns:
            raise ValueError(f"data file {path} has no answer column {answer_key!r} (columns: "
                             f"{columns}); set `data_args.answer_key`")
        prompts = table.get(prompt_key, [None] * n_rows)
        messages = table.get(messages_key, [None] * n_rows)
        answers = table[answer_key]
        domains = table.get(domain_key, [None] * n_rows)
        tags = table.get(tag_key, [None] * n_rows)
        missing = [c for c in require_columns if c not in columns]
        if missing:
            raise ValueError(f"data file {path} has no column {missing} (columns: {columns}), which "
                             f"the config needs (difficulty_loss_weight reads `difficulty`)")
        extra = {c: table[c] for c in require_columns}
        texts, from_msgs = [], []
        for i in range(n_rows):
            if _present(messages[i]) or _present(prompts[i]):
                text, is_chat = _prompt_text(messages[i], prompts[i], tokenizer, template, apply_chat_template)
                texts.append(text)
                from_msgs.append(is_chat)
            else:
                raise ValueError(f"data file {path}, row {i}: neither {prompt_key!r} nor "
                                 f"{messages_key!r} is set (expected one of those keys; see "
                                 f"`data_args.prompt_key` / `data_args.messages_key`)")
            if answers[i] is None:
                raise ValueError(f"data file {path}, row {i}: answer column {answer_key!r} is empty")
        stats["rows"] += n_rows
        # Chat templates already contain any bos; plain prompts get the tokenizer's specials.
        ids_chat = _tokenize([t for t, m in zip(texts, from_msgs) if m], tokenizer, False, num_proc)
        ids_plain = _tokenize([t for t, m in zip(texts, from_msgs) if not m], tokenizer, True, num_proc)
        it_chat, it_plain = iter(ids_chat), iter(ids_plain)
        filtered_here = 0
        for i in range(n_rows):
            ids = next(it_chat) if from_msgs[i] else next(it_plain)
            if len(ids) > max_prompt_length:
                filtered_here += 1
                continue
            if max_samples is not None and len(items) >= max_samples:
                break
            domain = (str(domains[i]) if _present(domains[i]) else
                      str(tags[i]) if _present(tags[i]) else default_domain)
            items.append({"prompt_text": texts[i], "prompt_ids": ids,
                          "ground_truth": _answer_str(answers[i]), "domain": domain,
                          **{c: extra[c][i] for c in require_columns}})
            stats["max_prompt_tokens"] = max(stats["max_prompt_tokens"], len(ids))
            stats["per_domain"][domain] = stats["per_domain"].get(domain, 0) + 1
        if filtered_here:
            logger.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                           path, filtered_here, n_rows, max_prompt_length)
        stats["filtered_prompts"] += filtered_here
    stats["prompts"] = len(items)
    if not items:
        raise ValueError(f"no usable prompts in {paths} (rows: {stats['rows']}, filtered as too "
                         f"long: {stats['filtered_prompts']}, max_prompt_length={max_prompt_length})")
    return items, stats


def _answer_str(value: Any) -> str:
    # Integers stored by a JSON/parquet writer as floats (47.0) should compare as "47".
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _tokenize(texts: List[str], tokenizer, add_special_tokens: bool,
              num_proc: Optional[int] = None) -> List[List[int]]:
    """Token ids of `texts`; with num_proc > 1 in that many processes (datasets.map)."""
    if not texts:
        return []
    if num_proc and num_proc > 1 and len(texts) >= num_proc:
        import datasets

        table = datasets.Dataset.from_dict({"text": texts}).map(
            lambda rows: {"ids": tokenizer(rows["text"], add_special_tokens=add_special_tokens)["input_ids"]},
            batched=True, num_proc=num_proc, remove_columns=["text"], desc="tokenizing prompts")
        return [list(x) for x in table["ids"]]
    return [list(x) for x in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


class _PromptStream:
    """Endless prompts of one pool, reshuffled every epoch from ``(seed..., epoch)``; its state is
    ``(epoch, position)``: the permutation is recomputed on resume, nothing else is stored."""

    def __init__(self, items: Sequence[dict], seed: Sequence[int], shuffle: bool):
        self.items = list(items)
        self.seed = list(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.items)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([*self.seed, epoch]).permutation(n)

    def take(self, count: int) -> List[dict]:
        """The next `count` prompts (may span an epoch boundary: each prompt once per epoch)."""
        batch: List[dict] = []
        while len(batch) < count:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(batch), len(self._order) - self.position)
            batch.extend(self.items[j] for j in self._order[self.position:self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_items": len(self.items)}

    def load_state_dict(self, state: Dict[str, int], name: str) -> None:
        n = state.get("num_items", len(self.items))
        if n != len(self.items):
            # Different data than at save time: positions would point at other prompts.
            logger.warning("PromptSampler state of %s saved with %d prompts, now %d; resuming anyway",
                           name, n, len(self.items))
        self.epoch = int(state["epoch"])
        self.position = min(int(state["position"]), len(self.items))
        self._order = self._permutation(self.epoch)


def allot(total: int, shares: Dict[str, float]) -> Dict[str, int]:
    """`total` split by `shares` (normalised): floors, then the largest remainders get one more
    (ties: the order of `shares`). Sums to `total` exactly."""
    norm = sum(shares.values())
    exact = {k: total * v / norm for k, v in shares.items()}
    counts = {k: int(np.floor(x)) for k, x in exact.items()}
    left = total - sum(counts.values())
    for key in sorted(exact, key=lambda k: -(exact[k] - counts[k]))[:left]:
        counts[key] += 1
    return counts


class PromptSampler:
    """Endless batches of prompts; reshuffled every epoch from ``(seed, epoch)``.

    A batch may span an epoch boundary, so every prompt is used once per epoch. With
    ``domain_probs`` (ROLL's ``domain_interleave_probs``: domain -> share) each batch takes
    ``allot(batch_size, domain_probs)`` prompts of each domain (``domain_of(item)``), each domain
    from its own stream; ``epoch`` is then the fewest passes any domain has completed.
    """

    def __init__(self, items: Sequence[dict], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, domain_probs: Optional[Dict[str, float]] = None,
                 domain_of=None):
        if not items:
            raise ValueError("PromptSampler needs at least one prompt")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.items = list(items)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.domain_of = domain_of or (lambda item: item["domain"])
        self.domain_probs = {d: float(p) for d, p in (domain_probs or {}).items() if p > 0}
        if self.domain_probs:
            pools: Dict[str, List[dict]] = {}
            for item in self.items:
                pools.setdefault(self.domain_of(item), []).append(item)
            empty = [d for d in self.domain_probs if d not in pools]
            if empty:
                raise ValueError(f"domain_interleave_probs gives a share to {empty}, but no training "
                                 f"prompt belongs to it (domains in the data: {sorted(pools)})")
            unused = sorted(set(pools) - set(self.domain_probs))
            if unused:
                logger.warning("domain_interleave_probs gives no share to %s: their %d prompts are never "
                               "drawn", unused, sum(len(pools[d]) for d in unused))
            self.streams = {d: _PromptStream(pools[d], [self.seed, i + 1], shuffle)
                            for i, d in enumerate(sorted(self.domain_probs))}
        else:
            self.streams = {"": _PromptStream(self.items, [self.seed], shuffle)}

    @property
    def epoch(self) -> int:
        return min(stream.epoch for stream in self.streams.values())

    def __len__(self) -> int:
        """Batches per epoch (rounded up)."""
        return -(-len(self.items) // self.batch_size)

    def __iter__(self) -> Iterator[List[dict]]:
        return self

    def __next__(self) -> List[dict]:
        return self.next_batch()

    def next_batch(self, size: Optional[int] = None, per_domain: Optional[Dict[str, int]] = None) -> List[dict]:
        """`size` prompts (default batch_size), split over domains by their shares; or, with
        `per_domain` (domain -> count, e.g. to replace dropped prompts in kind), those counts."""
        if not self.domain_probs:
            count = sum(per_domain.values()) if per_domain is not None else (size or self.batch_size)
            return self.streams[""].take(count)
        counts = per_domain if per_domain is not None else allot(size or self.batch_size, self.domain_probs)
        batch: List[dict] = []
        for domain, count in counts.items():
            if count:
                batch.extend(self.streams[domain].take(count))
        return batch

    def state_dict(self) -> Dict[str, Any]:
        if not self.domain_probs:
            return {**self.streams[""].state_dict(), "seed": self.seed}
        return {"seed": self.seed, "domains": {d: s.state_dict() for d, s in self.streams.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            self.seed = int(state["seed"])
            for i, (name, stream) in enumerate(self.streams.items()):
                stream.seed = [self.seed] + ([i + 1] if name else [])
        saved = state.get("domains")
        if (saved is None) != (not self.domain_probs) or (saved and set(saved) != set(self.streams)):
            raise ValueError(f"PromptSampler state was saved with domain streams "
                             f"{sorted(saved) if saved else 'none'}, this run has "
                             f"{sorted(d for d in self.streams if d) or 'none'} (domain_interleave_probs "
                             f"changed?); resume with the same domain_interleave_probs")
        for name, stream in self.streams.items():
            stream.load_state_dict(saved[name] if saved else state, name or "all prompts")


def load_sft_samples(files: Sequence[str], *, tokenizer, prompt_key: str = "prompt",
                     response_key: str = "response", max_length: int,
                     messages_key: str = "messages", max_samples: Optional[int] = None,
                     apply_chat_template: bool = True) -> List[dict]:
    """SFT rows as ``{input_ids, labels, loss_mask}``: loss only on the response and its eos.

    ``labels`` is ``input_ids`` with -100 on the prompt (the transformers convention);
    ``loss_mask`` is the same as 0/1. Rows may instead hold chat ``messages`` whose last turn is
    the assistant's response. Rows over ``max_length`` tokens are dropped (truncating would cut
    the eos the model must learn).
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos token; SFT needs one to end responses")
    paths = _resolve_files(files)
    out: List[dict] = []
    dropped = 0
    for path in paths:
        columns, table = _load_table(path)
        n_rows = len(table[columns[0]]) if columns else 0
        prompts = table.get(prompt_key, [None] * n_rows)
        responses = table.get(response_key, [None] * n_rows)
        messages = table.get(messages_key, [None] * n_rows)
        pairs: List[Tuple[str, str, bool]] = []
        for i in range(n_rows):
            if _present(prompts[i]) and responses[i] is not None:
                pairs.append((str(prompts[i]), str(responses[i]), False))
            elif _present(messages[i]) and list(messages[i])[-1].get("role") == "assistant":
                msgs = list(messages[i])
                prompt = _render_messages(msgs[:-1], tokenizer, apply_chat_template)
                pairs.append((prompt, str(msgs[-1].get("content", "")), True))
            else:
                raise ValueError(
                    f"data file {path}, row {i}: expected {prompt_key!r} and {response_key!r}, or "
                    f"{messages_key!r} ending with an assistant turn (columns: {columns})")
        p_chat = _tokenize([p for p, _, m in pairs if m], tokenizer, False)
        p_plain = _tokenize([p for p, _, m in pairs if not m], tokenizer, True)
        r_ids = _tokenize([r for _, r, _ in pairs], tokenizer, False)
        it_chat, it_plain = iter(p_chat), iter(p_plain)
        for (_, _, from_msgs), resp in zip(pairs, r_ids):
            prompt_ids = next(it_chat) if from_msgs else next(it_plain)
            resp = resp + [tokenizer.eos_token_id]
            if len(prompt_ids) + len(resp) > max_length:
                dropped += 1
                continue
            if max_samples is not None and len(out) >= max_samples:
                break
            ids = prompt_ids + resp
            mask = [0] * len(prompt_ids) + [1] * len(resp)
            out.append({"input_ids": ids, "loss_mask": mask,
                        "labels": [t if m else -100 for t, m in zip(ids, mask)]})
        if max_samples is not None and len(out) >= max_samples:
            break
    if dropped:
        logger.warning("SFT data: dropped %d samples longer than max_length=%d tokens",
                       dropped, max_length)
    if not out:
        raise ValueError(f"no usable SFT samples in {paths} (dropped as too long: {dropped})")
    return out
