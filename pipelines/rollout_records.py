"""The records of the rollout files (docs/rollouts.md; `roll_gspo.metrics.rollouts` writes them):
one JSON object per trained sample or validation prompt, built from a step's batch on the driver.

Train: step, index, group, task, prompt, response, answer, prompt_tokens, response_tokens,
finish_reason, ground_truth, reward, reward_parts, correct, reward_status, advantage, ratio, clipped,
logprob_gap, weight_version, staleness; agentic episodes also turns (observation, action, reward per turn),
stop_reason. Validation: step, index, task, prompt, response, answer, ground_truth, correct, reward,
reward_parts, finish_reason, response_tokens.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from roll_gspo.distributed.batch import Batch
from roll_gspo.rewards.answers import extract_answer


def rows_to_write(total: int, limit: int) -> range:
    """The first `limit` rows (-1: all, 0: none): consecutive rows, so whole groups come first."""
    return range(total if limit < 0 else min(limit, total))


def train_records(batch: Batch, step: int, limit: int, group_size: int = 1,
                  ratios: Optional[Dict[int, Tuple[float, float]]] = None,
                  trainer_gaps: Optional[Dict[int, torch.Tensor]] = None) -> List[Dict[str, Any]]:
    """The first `limit` trained samples of `step`'s batch (scored, with advantages); `ratios`: the
    training ranks' {row: (importance ratio, clipped share)} when each was first trained;
    `trainer_gaps`: their {row: per-token |trainer - engine| log-prob (T,)} from the training pass
    before any update (the drift alarm's), the gap where the trainer ran no old-log-prob pass."""
    ratios = ratios or {}
    mask = batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]
    advantages = _masked_means(batch["advantages"], mask) if "advantages" in batch else None
    gaps: Optional[List[Optional[float]]] = None
    if "old_log_probs" in batch and "rollout_log_probs" in batch \
            and batch["old_log_probs"] is not batch["rollout_log_probs"]:  # the trainer's own pass ran
        gaps = _masked_means(batch["old_log_probs"] - batch["rollout_log_probs"], batch["response_mask"])
    elif trainer_gaps and "response_mask" in batch:  # the engine's log-probs were the old ones: |gap| per row
        gaps = [None] * len(batch)
        for row, row_gaps in trainer_gaps.items():
            if 0 <= row < len(batch):  # a micro-batch may be padded shorter than the batch
                length = min(row_gaps.shape[-1], batch["response_mask"].shape[1])
                gaps[row] = _masked_means(row_gaps[None, :length].to(torch.float32),
                                          batch["response_mask"][row:row + 1, :length])[0]
    records = []
    for i in rows_to_write(len(batch), limit):
        record = _sample_text(batch, i)
        version = int(batch["weight_version"][i]) if "weight_version" in batch else None
        record.update(
            step=step, index=i,
            group=int(batch["set_id"][i]) if "set_id" in batch else i // max(group_size, 1),
            reward=_number(batch["scores"][i]) if "scores" in batch else None,
            reward_parts=_parts(batch, i), correct=_verdict(batch, i),
            reward_status=_meta(batch, "reward_status", i) or None,
            advantage=None if advantages is None else advantages[i],
            ratio=ratios[i][0] if i in ratios else None, clipped=ratios[i][1] if i in ratios else None,
            logprob_gap=None if gaps is None else gaps[i],
            weight_version=version, staleness=None if version is None else step - 1 - version)
        records.append(record)
    return records


def validation_records(batch: Batch, step: int) -> List[Dict[str, Any]]:
    """Every validation prompt's reply at `step`, scored."""
    records = []
    for i in range(len(batch)):
        record = _sample_text(batch, i)
        record.update(step=step, index=i, reward=_number(batch["scores"][i]) if "scores" in batch else None,
                      reward_parts=_parts(batch, i), correct=_verdict(batch, i))
        records.append(record)
    return records


def _sample_text(batch: Batch, i: int) -> Dict[str, Any]:
    """Prompt, response and their facts; an episode's turns where the batch carries them."""
    if "episode" in batch:  # agentic: the episode's messages (agentic_pipeline's `samples`)
        return _episode_text(batch["episode"][i], int(batch["response_mask"][i].sum()))
    response = _meta(batch, "response_text", i) or ""
    finished = _meta(batch, "finished", i)
    return {"task": _meta(batch, "domain", i), "prompt": _meta(batch, "prompt_text", i),
            "response": response, "answer": extract_answer(response),
            "prompt_tokens": len(batch["prompt_ids"][i]) if "prompt_ids" in batch else None,
            "response_tokens": len(batch["response_ids"][i]) if "response_ids" in batch else None,
            "finish_reason": None if finished is None else ("stop" if finished else "length"),
            "ground_truth": _text(_meta(batch, "ground_truth", i))}


def _episode_text(episode: Dict[str, Any], tokens: int) -> Dict[str, Any]:
    """An episode as prompt (its opening), response (its actions) and turns."""
    messages = episode.get("messages") or []
    opening = next((m["content"] for m in messages if m["role"] == "user"), None)
    turns, rewards = [], list(episode.get("step_rewards") or [])
    for n, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        following = messages[n + 1]["content"] if n + 1 < len(messages) else None
        turns.append({"action": message["content"], "observation": following,
                      "reward": rewards[len(turns)] if len(turns) < len(rewards) else None})
    return {"task": episode.get("tag"), "prompt": opening, "response": "\n".join(t["action"] for t in turns),
            "answer": None, "prompt_tokens": None, "response_tokens": tokens,
            "finish_reason": episode.get("stop_reason"), "ground_truth": None, "turns": turns,
            "success": episode.get("success")}


def _masked_means(values: torch.Tensor, mask: torch.Tensor) -> List[Optional[float]]:
    mask = mask.to(values.dtype)
    counts = mask.sum(-1)
    sums = (torch.nan_to_num(values) * mask).sum(-1)
    return [float(s / c) if c > 0 else None for s, c in zip(sums.tolist(), counts.tolist())]


def _meta(batch: Batch, key: str, i: int) -> Any:
    return batch.meta[key][i] if key in batch.meta else None


def _verdict(batch: Batch, i: int) -> Optional[bool]:
    """The reward worker's judgement as a bool (workers send 1.0 / 0.0 / None)."""
    value = _meta(batch, "reward_correct", i)
    return None if value is None else bool(value)


def _parts(batch: Batch, i: int) -> Optional[Dict[str, float]]:
    """The reward's named parts as the reward worker sent them (numbers only)."""
    named = _meta(batch, "reward_metrics", i)
    if not isinstance(named, dict):
        return None
    return {str(k): _number(v) for k, v in named.items() if isinstance(v, (int, float, bool)) or hasattr(v, "item")}


def _number(value: Any) -> Optional[float]:
    value = float(value.item() if hasattr(value, "item") else value)
    return value if value == value and abs(value) != float("inf") else None


def _text(value: Any) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def episode_meta(trajectories: Sequence[Any]) -> List[Dict[str, Any]]:
    """What the records read of each trajectory (agentic_pipeline puts it in the batch's meta)."""
    return [{"tag": t.spec.tag, "messages": t.messages, "step_rewards": list(t.step_rewards),
             "stop_reason": t.stop_reason, "success": t.success} for t in trajectories]


def episode_validation_records(trajectories: Sequence[Any], step: int) -> List[Dict[str, Any]]:
    """Every validation episode at `step`, turn by turn."""
    records = []
    for i, meta in enumerate(episode_meta(trajectories)):
        record = _episode_text(meta, sum(trajectories[i].agent_mask))
        record.update(step=step, index=i, reward=_number(trajectories[i].reward), reward_parts=None,
                      correct=bool(trajectories[i].success))
        records.append(record)
    return records
