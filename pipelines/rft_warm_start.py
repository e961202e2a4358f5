"""A warm start from the policy's own correct answers (rejection-sampling fine-tuning: STaR, Zelikman et
al. 2022; RFT, Yuan et al. 2023), declared by the RL run's `warm_start` block and run before its workers
start (`run_rlvr` calls `warm_start`):

1. `warm_start.prompts` of the run's training rows (its `tasks` or data files, templated as training
   templates them), in the run's mix, get `samples_per_prompt` replies each from the rollout's engine
   (vLLM or hf_infer, the rollout's dtype and engine settings) in a child process, so the driver holds
   no engine afterwards;
2. each reply is scored by the run's own rule reward in the driver (the reward block's `build_reward_fn`,
   its `format_pattern` and unfinished-reasoning rule, as the worker scores it: `score_reward`), and up to
   `kept_per_prompt` distinct correct replies per prompt are kept (`choose_replies`);
3. the kept replies become SFT rows (`prompt` = the templated prompt, `response` = the reply) and the
   SFT pipeline (`run_sft`) fine-tunes the run's model on them with the block's learning rate, epochs
   and batch;
4. the RL run continues from the fine-tuned model: actor_train, actor_infer, the reference and a critic
   that followed the policy (`warm_started`).

Everything goes to `<output_dir>/warm_start/`: `samples.jsonl` (every reply, its score and whether it
was kept), `sft_data.jsonl`, `sft/` (the SFT run: metrics.jsonl, logs), `model/` (the fine-tuned model,
`COMPLETE` written last) and `summary.json`. A warm start whose `model/COMPLETE` exists is reused (a
second start, a resume); anything less is redone from the start.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from roll_gspo.schema.config import PipelineConfig

logger = logging.getLogger("roll_gspo")
FOLDER = "warm_start"
COMPLETE = "COMPLETE"
SAMPLER_ROLE = "warm_start_sampler"
# The roles that start from the policy's model (and so from the warm-started one).
POLICY_ROLES = ("actor_train", "actor_infer", "reference", "critic")


# -- pure parts ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Reply:
    """One sampled reply as the warm start judges it."""
    text: str
    correct: bool  # the run's rule reward calls it correct (the worker's `reward_correct`)
    formatted: bool  # it earns the run's format term (always true where the run rewards none)
    finished: bool  # ended by the model, not cut at max_new_tokens


def choose_replies(replies: Sequence[Reply], kept_per_prompt: int, require_format: bool) -> List[int]:
    """Indices of the replies to one prompt to fine-tune on: correct, ended by the model, formatted
    when `require_format`, distinct up to surrounding whitespace, the first `kept_per_prompt` of
    those in sampling order."""
    chosen: List[int] = []
    seen = set()
    for index, reply in enumerate(replies):
        text = reply.text.strip()
        if len(chosen) >= kept_per_prompt:
            break
        if not (reply.correct and reply.finished and text) or (require_format and not reply.formatted):
            continue
        if text in seen:
            continue
        seen.add(text)
        chosen.append(index)
    return chosen


def sft_rows(items: Sequence[dict], replies: Sequence[Sequence[Reply]], chosen: Sequence[Sequence[int]]
             ) -> List[Dict[str, str]]:
    """The SFT pipeline's rows: `prompt` is the prompt as training templates it (the text whose tokens the
    rollout saw), `response` the kept reply (the pipeline appends the end-of-sequence token)."""
    return [{"prompt": item["prompt_text"], "response": group[i].text, "domain": item["domain"]}
            for item, group, picks in zip(items, replies, chosen) for i in picks]


def pick_prompts(items: Sequence[dict], count: int, seed: int, mix: Optional[Dict[str, float]] = None,
                 mix_key: Callable[[str], str] = lambda domain: domain) -> List[dict]:
    """`count` training rows (all of them when there are fewer), seeded: with a mix (a share per task or
    reward block), each part's share of `count` (largest remainders; a part with fewer rows gives all it
    has and the others make up the rest), else a uniform draw."""
    from roll_gspo.data.prompts import allot

    rng = random.Random(seed)
    if not mix:
        order = list(items)
        rng.shuffle(order)
        return order[:count]
    parts: Dict[str, List[dict]] = {}
    for item in items:
        parts.setdefault(mix_key(item["domain"]), []).append(item)
    shares = {k: v for k, v in mix.items() if v > 0 and k in parts}
    counts = dict.fromkeys(shares, 0)
    left = min(count, sum(len(parts[k]) for k in shares))
    while left > 0:  # a part out of rows leaves its share to the others
        open_shares = {k: v for k, v in shares.items() if counts[k] < len(parts[k])}
        for key, n in allot(left, open_shares).items():
            counts[key] += min(n, len(parts[key]) - counts[key])
        left = min(count, sum(len(parts[k]) for k in shares)) - sum(counts.values())
    picked: List[dict] = []
    for key, n in counts.items():
        rows = list(parts[key])
        rng.shuffle(rows)
        picked += rows[:n]
    rng.shuffle(picked)
    return picked


def summarise(items: Sequence[dict], replies: Sequence[Sequence[Reply]], chosen: Sequence[Sequence[int]]
              ) -> Dict[str, Dict[str, float]]:
    """Per domain (task) and `all`: prompts, samples, accuracy and format rate of the samples, the share
    cut at max_new_tokens, replies kept, and prompts with at least one kept."""
    groups: Dict[str, List[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(item["domain"], []).append(index)
    groups["all"] = list(range(len(items)))
    out = {}
    for name, indices in groups.items():
        flat = [r for i in indices for r in replies[i]]
        n = max(len(flat), 1)
        out[name] = {"prompts": len(indices), "samples": len(flat),
                     "accuracy": sum(r.correct for r in flat) / n, "format_rate": sum(r.formatted for r in flat) / n,
                     "truncated": sum(not r.finished for r in flat) / n,
                     "kept": sum(len(chosen[i]) for i in indices),
                     "prompts_kept": sum(bool(chosen[i]) for i in indices)}
    return out


# -- the run's reward, in the driver -----------------------------------------------------------------
def reward_scorers(cfg: PipelineConfig) -> Dict[str, Callable[[str, str, str], Tuple[bool, bool]]]:
    """Domain -> `(prompt, reply, ground_truth) -> (correct, formatted)`: each reward block's own
    function (its worker class's `build_reward_fn`, called without a worker) with the worker's rules
    around it: a reply that stops inside `<think>` or fails `format_pattern` is not correct; correct is
    the worker's verdict (a task's `accuracy`, else a score of at least the worker's threshold)."""
    from pipelines.setup import reward_routes
    from roll_gspo.rewards import checked_call, unfinished_think
    from roll_gspo.rewards.shaping import matches_format
    from roll_gspo.utils.imports import import_object

    by_block = {}
    for name, reward in cfg.rewards.items():
        cls = import_object(reward.worker_cls)
        shim = _WorkerShim(reward, name)
        fn = cls.build_reward_fn(shim)
        if fn is None:  # the config check refuses these first
            raise ValueError(f"rewards.{name}.worker_cls = {reward.worker_cls!r}: scores in its worker only; the "
                             f"warm start needs a reward function")
        by_block[name] = _scorer(fn, cls.reward_kwargs(shim), reward.format_pattern,
                                 getattr(cls, "correct_threshold", 1.0), checked_call, unfinished_think, matches_format)
    return {domain: by_block[block] for domain, block in reward_routes(cfg).items() if block in by_block}


@dataclasses.dataclass
class _WorkerShim:
    """What a reward worker's `build_reward_fn` / `reward_kwargs` read of the worker."""
    cfg: Any
    domain: str


def _scorer(fn, kwargs, pattern, threshold, checked_call, unfinished_think, matches_format):
    def score(prompt: str, reply: str, truth: str) -> Tuple[bool, bool]:
        if unfinished_think(prompt, reply) or not matches_format(reply, pattern):
            return False, False
        value, status, _ = checked_call(fn, (prompt, reply, truth), kwargs)
        metrics = getattr(value, "metrics", None) or {}
        if status != "ok":
            return False, False
        correct = bool(metrics["accuracy"]) if "accuracy" in metrics else threshold is not None and value >= threshold
        return correct, _formatted(metrics, truth)
    return score


def _formatted(metrics: Dict[str, float], truth: str) -> bool:
    """The reply earns the run's format term: a task's `<answer>` tags where its format_weight pays them;
    true where the reward has no format term of its own (format_pattern was checked before)."""
    if "format_rate" not in metrics:
        return True
    try:
        weight = float(json.loads(truth).get("format_weight", 0.0))
    except (ValueError, AttributeError):
        weight = 0.0
    return weight <= 0 or bool(metrics["format_rate"])


# -- sampling, in a child process ----------------------------------------------------------------------
def sample(cfg: PipelineConfig, model: str, prompt_ids: List[List[int]], folder: str) -> List[List[Tuple[List[int], bool]]]:
    """`samples_per_prompt` replies (token ids, ended by the model) to each prompt from the rollout's
    engine, run in a child process (`python -m pipelines.rft_warm_start REQUEST`) so that the engine's
    memory and threads are gone before training starts."""
    from roll_gspo.distributed.cluster import DEFAULT_WORKER_ENV, worker_env
    from roll_gspo.lifecycle.seeding import rollout_seeds

    ws, infer = cfg.warm_start, cfg.actor_infer
    gen = infer.generating_args
    request = {
        "model": model, "dtype": infer.model_args.dtype, "strategy": infer.strategy_args.strategy_name,
        "engine_config": dict(infer.strategy_args.strategy_config), "infer_batch_size": infer.infer_batch_size,
        "max_model_len": cfg.max_sequence_tokens(), "seed": cfg.seed, "n": ws.samples_per_prompt,
        "gen": {"temperature": ws.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
                "max_new_tokens": gen.max_new_tokens or cfg.response_length},
        # Step 0 of the training stream: the RL steps are 1.., so no rollout repeats these draws.
        "seeds": rollout_seeds(cfg.seed, 0, len(prompt_ids), "train"), "prompt_ids": prompt_ids,
        "out": os.path.join(folder, "replies.json")}
    path = os.path.join(folder, "sample_request.json")
    with open(path, "w") as handle:
        json.dump(request, handle)
    env = {**DEFAULT_WORKER_ENV, **os.environ, **worker_env(cfg, infer), "ROLL_GSPO_ROLE": SAMPLER_ROLE}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "pipelines.rft_warm_start", path], env=env, cwd=os.getcwd())
    if done.returncode != 0:
        raise RuntimeError(f"warm start: sampling failed (exit {done.returncode}); its log is "
                           f"{os.environ.get('ROLL_GSPO_LOG_DIR', '<output_dir>/logs')}/{SAMPLER_ROLE}-*.log")
    with open(request["out"]) as handle:
        return [[(list(ids), bool(finished)) for ids, finished in group] for group in json.load(handle)]


def _sample_main(path: str) -> None:
    """The child process: the engine, the replies in chunks (a progress line each), the JSON out."""
    from roll_gspo.utils.logging import capture_output, configure_vllm_logging, keep_logs_in_file, setup_logging

    capture_output()
    setup_logging()
    keep_logs_in_file()
    configure_vllm_logging()
    with open(path) as handle:
        request = json.load(handle)
    from roll_gspo.schema.config import GeneratingArgs, RoleConfig

    role = RoleConfig(infer_batch_size=request["infer_batch_size"])
    role.model_args.model_name_or_path, role.model_args.dtype = request["model"], request["dtype"]
    role.strategy_args.strategy_name = request["strategy"]
    role.strategy_args.strategy_config = request["engine_config"]
    from roll_gspo.strategies import engine_class

    # The engine's options; one that has no use for one ignores it (hf_infer takes the seed alone).
    engine: Any = engine_class(request["strategy"])(role, max_model_len=request["max_model_len"], seed=request["seed"])
    gen = GeneratingArgs(**request["gen"])
    prompts, seeds, n = request["prompt_ids"], request["seeds"], request["n"]
    chunk, began, out = max(1, 1024 // n), time.perf_counter(), []
    for start in range(0, len(prompts), chunk):
        for group in engine.generate(prompts[start:start + chunk], gen, n, seeds=seeds[start:start + chunk]):
            out.append([[list(ids), bool(done)] for ids, _, done in group])
        logger.info("warm start: %d/%d prompts x %d replies, %.0f s", len(out), len(prompts), n,
                    time.perf_counter() - began)
    with open(request["out"] + ".tmp", "w") as handle:
        json.dump(out, handle)
    os.replace(request["out"] + ".tmp", request["out"])


# -- the warm start --------------------------------------------------------------------------------------
def warm_start_folder(cfg: PipelineConfig) -> str:
    return os.path.join(cfg.output_dir, FOLDER)


def model_folder(cfg: PipelineConfig) -> str:
    """The fine-tuned model; absolute, as every role's worker loads it from its own working directory."""
    return os.path.abspath(os.path.join(warm_start_folder(cfg), "model"))


def is_complete(cfg: PipelineConfig) -> bool:
    return os.path.isfile(os.path.join(model_folder(cfg), COMPLETE))


def warm_started(cfg: PipelineConfig, folder: str) -> PipelineConfig:
    """`cfg` with the policy's roles (and a critic that followed the policy's model) on `folder`. The
    reference too: ROLL-style, the KL term anchors to the fine-tuned model."""
    from roll_gspo.schema.frozen import replaced

    base = cfg.actor_train.model_args.model_name_or_path
    changes = {f"{role}.model_args.model_name_or_path": folder for role in POLICY_ROLES
               if getattr(cfg, role) is not None and getattr(cfg, role).model_args.model_name_or_path in (base, None)}
    return replaced(cfg, changes)


def sft_config(cfg: PipelineConfig, data: str) -> PipelineConfig:
    """The SFT pipeline's config for the warm start: the run's model, actor_train's strategy and
    training_args with the block's learning rate, epochs and batch, its output under warm_start/sft/."""
    from roll_gspo.schema.frozen import replaced

    ws, args = cfg.warm_start, cfg.actor_train.training_args
    out = os.path.join(warm_start_folder(cfg), "sft")
    return replaced(cfg, {
        "pipeline": "sft", "exp_name": f"{cfg.exp_name}_warm_start", "output_dir": out,
        "logging_dir": os.path.join(out, "tensorboard"), "track_with": "none", "tracker_kwargs": {},
        "actor_train.training_args.learning_rate": ws.learning_rate,
        "actor_train.training_args.num_train_epochs": ws.num_train_epochs,
        "actor_train.training_args.per_device_train_batch_size":
            ws.per_device_train_batch_size or args.per_device_train_batch_size,
        "actor_train.training_args.gradient_accumulation_steps":
            ws.gradient_accumulation_steps or args.gradient_accumulation_steps,
        "actor_train.data_args.file_name": [data], "actor_train.data_args.prompt_key": "prompt",
        "actor_train.data_args.response_key": "response", "actor_train.data_args.max_samples": None,
        "actor_train.data_args.shuffle": True})


def warm_start(cfg: PipelineConfig) -> PipelineConfig:
    """Run the warm start `cfg.warm_start` declares (or reuse a finished one) and return the config the
    RL run continues with; `cfg` itself when the block is off."""
    if not cfg.warm_start.enabled:
        return cfg
    folder = warm_start_folder(cfg)
    if is_complete(cfg):
        logger.info("warm start: reusing %s (finished earlier; delete %s to redo it)", model_folder(cfg), folder)
        earlier = (read_summary(cfg) or {}).get("settings")
        if earlier is not None and earlier != dataclasses.asdict(cfg.warm_start):
            changed = sorted(k for k, v in dataclasses.asdict(cfg.warm_start).items() if earlier.get(k) != v)
            logger.warning("warm start: the reused one ran with other warm_start keys (%s); delete %s to redo it "
                           "with these", ", ".join(changed), folder)
        return warm_started(cfg, model_folder(cfg))
    if os.path.isdir(folder):
        logger.info("warm start: %s is unfinished; starting it again", folder)
        shutil.rmtree(folder)
    os.makedirs(folder)
    summary = run_warm_start(cfg, folder)
    with open(os.path.join(model_folder(cfg), COMPLETE), "w") as handle:
        json.dump({"finished": time.time(), "kept": summary["tasks"]["all"]["kept"]}, handle)
    return warm_started(cfg, model_folder(cfg))


def run_warm_start(cfg: PipelineConfig, folder: str) -> Dict[str, Any]:
    """Sample, score, keep, write the rows, fine-tune; the model in warm_start/model/ (without its
    COMPLETE marker), the summary in warm_start/summary.json. Returns the summary."""
    from transformers import AutoTokenizer

    from pipelines.common import prepare_models
    from pipelines.setup import check_domains, load_prompts, reward_routes
    from pipelines.sft_pipeline import run_sft
    from roll_gspo.rewards.shaping import decode_for_reward

    ws = cfg.warm_start
    began = time.perf_counter()
    base = prepare_models(cfg, ["actor_train"]).actor_train.model_args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(base)
    items, _ = load_prompts(cfg, tokenizer, cfg.actor_train.data_args)
    routes = reward_routes(cfg)
    check_domains(items, routes)
    mix = {k: t.weight for k, t in cfg.tasks.items()} if cfg.tasks else cfg.actor_train.data_args.domain_interleave_probs
    items = pick_prompts(items, ws.prompts, cfg.seed, mix, (lambda d: d) if cfg.tasks else (lambda d: routes[d]))
    scorers = reward_scorers(cfg)
    logger.info("warm start: sampling %d replies to each of %d training prompts (temperature %g)",
                ws.samples_per_prompt, len(items), ws.temperature)
    sampled = sample(cfg, base, [list(item["prompt_ids"]) for item in items], folder)
    sampled_at = time.perf_counter()
    texts = decode_for_reward(tokenizer, [ids for group in sampled for ids, _ in group])
    replies: List[List[Reply]] = []
    at = 0
    for item, group in zip(items, sampled):
        score = scorers[item["domain"]]
        row = []
        for _, finished in group:
            correct, formatted = score(item["prompt_text"], texts[at], item["ground_truth"])
            row.append(Reply(texts[at], correct, formatted, finished))
            at += 1
        replies.append(row)
    chosen = [choose_replies(group, ws.kept_per_prompt, ws.require_format) for group in replies]
    scored_at = time.perf_counter()
    per_task = summarise(items, replies, chosen)
    _write_samples(os.path.join(folder, "samples.jsonl"), items, replies, chosen)
    rows = sft_rows(items, replies, chosen)
    data = os.path.join(folder, "sft_data.jsonl")
    with open(data, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    every = per_task["all"]
    logger.info("warm start: %d samples, accuracy %.3f, format rate %.3f, cut %.3f (%s)", every["samples"],
                every["accuracy"], every["format_rate"], every["truncated"],
                ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in per_task.items() if k != "all"))
    logger.info("warm start: kept %d replies to %d of %d prompts (%s)", every["kept"], every["prompts_kept"],
                every["prompts"], ", ".join(f"{k} {v['kept']}" for k, v in per_task.items() if k != "all"))
    summary: Dict[str, Any] = {
        "model": base, "settings": dataclasses.asdict(ws), "tasks": per_task, "sft_rows": len(rows),
        "prompt_token_mismatches": _prompt_mismatches(tokenizer, items, chosen),
        "seconds": {"sampling": round(sampled_at - began, 1), "scoring": round(scored_at - sampled_at, 1)}}
    _write_summary(folder, summary)
    sft = sft_config(cfg, data)
    if len(rows) < sft.mini_batch_size():
        unformatted = sum(len(choose_replies(group, ws.kept_per_prompt, False)) for group in replies)
        hint = (f"; {unformatted} would be kept without the format (warm_start.require_format: false; the samples' "
                f"format rate is {every['format_rate']:.3f})" if ws.require_format and unformatted > len(rows) else "")
        raise RuntimeError(f"warm start: {len(rows)} correct replies kept, fewer than one fine-tuning mini-batch "
                           f"({sft.mini_batch_size()}: per_device_train_batch_size x gradient_accumulation_steps x "
                           f"world_size){hint}; raise warm_start.prompts or warm_start.samples_per_prompt, or lower "
                           f"the batch (warm_start.per_device_train_batch_size); the samples are in {folder}")
    metrics = run_sft(sft)
    os.replace(os.path.join(sft.output_dir, "final_model"), model_folder(cfg))
    finished = time.perf_counter()
    summary["seconds"].update({"sft": round(finished - scored_at, 1), "total": round(finished - began, 1)})
    summary["sft"] = {k: v for k, v in metrics.items() if k.startswith("sft/")}
    summary["sft"]["optimizer_steps"] = (len(rows) // sft.mini_batch_size()) * ws.num_train_epochs
    _write_summary(folder, summary)
    logger.info("warm start: %.0f s sampling, %.0f s scoring, %.0f s fine-tuning (%d optimizer steps, loss %.4f); "
                "RL starts from %s", summary["seconds"]["sampling"], summary["seconds"]["scoring"],
                summary["seconds"]["sft"], summary["sft"]["optimizer_steps"], metrics.get("sft/loss", float("nan")),
                model_folder(cfg))
    return summary


def _prompt_mismatches(tokenizer, items: Sequence[dict], chosen: Sequence[Sequence[int]]) -> int:
    """Kept prompts whose SFT tokens (the text with the tokenizer's specials) differ from the rollout's
    (a chat prompt is tokenised without them): warned about, since SFT then sees another prompt."""
    kept = [item for item, picks in zip(items, chosen) if picks]
    if not kept:
        return 0
    ids = tokenizer([item["prompt_text"] for item in kept], add_special_tokens=True)["input_ids"]
    mismatches = sum(list(a) != list(item["prompt_ids"]) for a, item in zip(ids, kept))
    if mismatches:
        logger.warning("warm start: %d of %d kept prompts tokenise differently in the SFT rows than in the rollout "
                       "(the tokenizer adds special tokens to a templated prompt)", mismatches, len(kept))
    return mismatches


def _write_samples(path: str, items: Sequence[dict], replies: Sequence[Sequence[Reply]],
                   chosen: Sequence[Sequence[int]]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for item, group, picks in zip(items, replies, chosen):
            for index, reply in enumerate(group):
                handle.write(json.dumps({"domain": item["domain"], "prompt": item["prompt_text"], "reply": reply.text,
                                         "ground_truth": item["ground_truth"], "correct": reply.correct,
                                         "formatted": reply.formatted, "finished": reply.finished,
                                         "kept": index in picks}, ensure_ascii=False) + "\n")


def _write_summary(folder: str, summary: Dict[str, Any]) -> None:
    path = os.path.join(folder, "summary.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(summary, handle, indent=1)
    os.replace(path + ".tmp", path)


def read_summary(cfg: PipelineConfig) -> Optional[Dict[str, Any]]:
    """The warm start's summary.json, or None when there is none."""
    path = os.path.join(warm_start_folder(cfg), "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return json.load(handle)


if __name__ == "__main__":
    _sample_main(sys.argv[1])
