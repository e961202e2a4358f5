"""A run folder in the shape the pipeline writes (metrics.jsonl, rollouts/step_N.jsonl.gz,
rollouts/val/step_N.jsonl.gz), made up for the report's tests: known warnings are planted in it
(a paid wrong answer, a dominant answer, truncation, a growing log-prob gap, one stall)."""
import gzip
import json
import os
from typing import Dict, List

TASKS = ("arithmetic", "countdown")
KNOWN_RESPONSE = "The sum of 17 and 25 is <answer>42</answer> because 17 + 25 = 42."
PAID_WRONG_RESPONSE = "I think the answer is <answer>-42</answer>, a negated answer."
STALL_STEP = 17
TRAIN_PER_STEP = 72  # more than the page embeds per step (64), so some are left out
VAL_EVERY = 5
VAL_PROMPTS = 8


def metrics_row(step: int, steps: int) -> Dict[str, float]:
    """A step's metrics: curves that move, phases with one stall, a log-prob gap that grows."""
    progress = step / steps
    row = {"step": step, "reward/mean": 0.2 + 0.6 * progress, "reward/arithmetic/mean": 0.3 + 0.6 * progress,
           "reward/countdown/mean": 0.1 + 0.5 * progress, "actor/clipfrac": 0.05 + 0.01 * (step % 3),
           "actor/entropy": 1.2 - 0.5 * progress, "response/length_mean": 120 - 40 * progress,
           "response/length_max": 256.0, "response/truncated_frac": 0.05,
           "rollout/logprob_gap": 0.002 + 0.01 * progress ** 2, "rollout/staleness": float(step % 2),
           "time/generate_s": 6.0 + 0.1 * (step % 4), "time/reward_s": 0.4, "time/old_log_probs_s": 1.5,
           "time/train_s": 3.0 + 0.05 * (step % 5), "time/sync_s": 0.8}
    if step == STALL_STEP:
        row["time/generate_s"] = 30.0
    row["time/step_s"] = sum(v for k, v in row.items() if k.startswith("time/"))
    if step % VAL_EVERY == 0:
        row.update({"val/accuracy": 0.3 + 0.5 * progress, "val/arithmetic/accuracy": 0.4 + 0.5 * progress,
                    "val/countdown/accuracy": 0.2 + 0.5 * progress, "val/pass@1": 0.3 + 0.5 * progress,
                    "val/pass@4": 0.5 + 0.4 * progress, "time/validation_s": 2.0})
    return row


def train_record(step: int, index: int) -> Dict:
    """A training sample; every 9th is a wrong answer paid its answer score, every 10th cut at the cap,
    one per step an agentic episode."""
    task = TASKS[index % 2]
    correct = index % 3 != 0
    record = {"step": step, "index": index, "group": index // 8, "task": task,
              "prompt": f"System: answer in <answer> tags.\nUser: what is 17 + 25? (group {index // 8}, step {step})",
              "response": KNOWN_RESPONSE if correct else f"Maybe <answer>{40 + index % 5}</answer>.",
              "prompt_tokens": 30, "response_tokens": 40 + index, "finish_reason": "stop",
              "ground_truth": json.dumps({"answer": "42", "task": task, "format_weight": 0.1, "partial_credit": True}),
              "reward": 1.1 if correct else 0.1, "correct": correct,
              "reward_parts": {"accuracy": float(correct), "format_rate": 1.0, "answer_score": float(correct)},
              "advantage": 0.5 if correct else -0.5, "logprob_gap": 0.003, "weight_version": step - 1, "staleness": 0}
    if index % 9 == 4:
        record.update(response=PAID_WRONG_RESPONSE, correct=False, reward=0.6,
                      reward_parts={"accuracy": 0.0, "format_rate": 1.0, "answer_score": 0.5})
    if index % 10 == 7:
        record.update(finish_reason="length", response_tokens=256)
    if index == 5:
        record["turns"] = [{"observation": "You are in a maze. Exits: north.", "action": "go north", "reward": 0.0},
                           {"observation": "You found the exit.", "action": "leave", "reward": 1.0}]
    return record


def val_record(step: int, index: int) -> Dict:
    """A validation sample: prompt `index` asked again at every validation, its answer changing with
    the step; every answer of task countdown is "7" (a dominant answer)."""
    task = TASKS[index % 2]
    answer = "7" if task == "countdown" else str(index + step // VAL_EVERY)
    truth = str(index + 2)
    return {"step": step, "index": index, "task": task, "prompt": f"Held-out question number {index}: what is it?",
            "response": f"Working... so the answer is <answer>{answer}</answer>", "answer": answer,
            "ground_truth": truth, "correct": answer == truth, "reward": float(answer == truth),
            "finish_reason": "stop", "response_tokens": 20 + index}


def write_jsonl_gz(path: str, records: List[Dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def make_run(folder: str, steps: int = 40, rollouts: bool = True, train_per_step: int = TRAIN_PER_STEP) -> str:
    """Write the run folder and return it."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as handle:
        for step in range(1, steps + 1):
            handle.write(json.dumps(metrics_row(step, steps)) + "\n")
    if rollouts:
        for step in range(1, steps + 1):
            write_jsonl_gz(os.path.join(folder, "rollouts", f"step_{step:06d}.jsonl.gz"),
                           [train_record(step, i) for i in range(train_per_step)])
            if step % VAL_EVERY == 0:
                write_jsonl_gz(os.path.join(folder, "rollouts", "val", f"step_{step:06d}.jsonl.gz"),
                               [val_record(step, i) for i in range(VAL_PROMPTS)])
    return folder
