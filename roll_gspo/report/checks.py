"""What a user should see before reading any curve: stalls of a step's phases and the warnings of
a run's rollouts and metrics. Pure functions of rows and records, so the running pipeline can call
them on what it holds and the tests can feed them exact cases.

Thresholds are constants here and stated in docs/report.md."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from roll_gspo.metrics.stalls import FACTOR as STALL_RATIO
from roll_gspo.metrics.stalls import MIN_EXCESS_S as STALL_MIN_EXCESS_S
from roll_gspo.metrics.stalls import find_stalls as metric_stalls

DOMINANT_SHARE = 0.5  # one answer over half of a task's responses in a step
DOMINANT_MIN_RESPONSES = 4  # fewer responses say nothing about a task's spread
TRUNCATED_SHARE = 0.2  # over a fifth of a step's responses cut at the length cap
GAP_GROWTH = 2.0  # the log-prob gap's last third over 2x its first third ...
GAP_FLOOR = 1e-3  # ... and above 1e-3 (below it, fp32 noise doubling is nothing)
GAP_MIN_POINTS = 6  # three thirds of at least two points each
PAID_EPSILON = 1e-9

# A step's phases are `time/<phase>_s`; the step's total is not one of them.
NOT_PHASES = ("time/step_s",)


def phase_keys(rows: Iterable[Mapping[str, Any]]) -> List[str]:
    """The `time/<phase>_s` keys of the rows, in first-seen order (the order the loop runs them)."""
    seen: Dict[str, None] = {}
    for row in rows:
        for key in row:
            if key.startswith("time/") and key.endswith("_s") and key not in NOT_PHASES:
                seen.setdefault(key, None)
    return list(seen)


def phase_name(key: str) -> str:
    """`time/old_log_probs_s` -> `old_log_probs`."""
    return key[len("time/"):-len("_s")]


def find_stalls(rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The stalls of a run's metrics rows by the running pipeline's own rule
    (`roll_gspo.metrics.stalls`: a phase over 3x its median over the steps before it and 1 s
    above it, throughput under a third of its median, the trainer idle against its usual share), so
    the report marks exactly the steps the console flagged. Returns `{step, kind, phase, role,
    seconds, median, ratio}` by step (for throughput `seconds` is tokens/s; for idle, a share)."""
    rows = [dict(row) for row in rows]
    return sorted(({"step": s.step, "kind": s.kind, "phase": s.phase, "role": s.role, "seconds": s.seconds,
                    "median": s.median, "ratio": s.seconds / s.median if s.median > 0 else None, "line": s.line()}
                   for s in metric_stalls(rows)), key=lambda s: (s["step"], s["phase"]))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
        and abs(value) != float("inf")


# -- warnings --------------------------------------------------------------------------------------
def warning(kind: str, message: str, steps: Sequence[int] = (), **facts: Any) -> Dict[str, Any]:
    """A warning as the page shows it: its kind, one sentence, the steps it concerns."""
    return {"kind": kind, "message": message, "steps": sorted(set(steps)), **facts}


def is_format_part(name: str) -> bool:
    return "format" in name.lower()


def is_answer_part(name: str) -> bool:
    """A reward part that pays for the answer itself (correctness, the task's own answer score,
    partial credit), as opposed to a format term or a penalty."""
    lowered = name.lower()
    return not is_format_part(lowered) and any(w in lowered for w in ("answer", "correct", "accuracy", "score",
                                                                      "partial"))


def paid_without_correctness(record: Mapping[str, Any]) -> bool:
    """A training response judged wrong that still earned reward not explained by its format.
    A task row's ground truth states its `format_weight`: then any reward above that weight times
    the format part is paid for the answer. Otherwise, either an answer part (e.g. reasoning-gym's
    `answer_score`, partial credit) is in the reward (the reward is at least that part), or the
    reward is positive with no format part at all. A wrong answer paid only its format weight is
    the design, not a leak."""
    reward = record.get("reward")
    if record.get("correct") is not False or not _finite(reward) or reward <= PAID_EPSILON:
        return False
    parts = record.get("reward_parts") or {}
    parts = {k: float(v) for k, v in parts.items() if _finite(v)} if isinstance(parts, dict) else {}
    format_parts = [v for k, v in parts.items() if is_format_part(k)]
    weight = format_weight(record.get("ground_truth"))
    if weight is not None and format_parts:
        return reward - weight * max(format_parts) > PAID_EPSILON
    answer_paid = max((v for k, v in parts.items() if is_answer_part(k)), default=0.0)
    if answer_paid > PAID_EPSILON and reward >= answer_paid - PAID_EPSILON:
        return True
    return not any(v > PAID_EPSILON for v in format_parts)


def format_weight(ground_truth: Any) -> Optional[float]:
    """The `format_weight` a task row's JSON ground truth carries (roll_gspo.tasks), else None."""
    if not isinstance(ground_truth, str) or not ground_truth.startswith("{"):
        return None
    try:
        weight = json.loads(ground_truth).get("format_weight")
    except (ValueError, AttributeError):
        return None
    return float(weight) if _finite(weight) else None


def reward_without_correctness_warnings(train: Mapping[int, Sequence[Mapping[str, Any]]]) -> List[Dict[str, Any]]:
    """One warning per task whose wrong training answers earned reward (`paid_without_correctness`):
    how many of its wrong answers, their mean reward, the steps, a first example to open."""
    paid: Dict[str, List[tuple]] = defaultdict(list)
    wrong: Counter = Counter()
    for step in sorted(train):
        for record in train[step]:
            task = str(record.get("task") or "?")
            if record.get("correct") is False:
                wrong[task] += 1
            if paid_without_correctness(record):
                paid[task].append((step, record.get("index"), float(record["reward"])))
    out = []
    for task in sorted(paid):
        hits = paid[task]
        mean = sum(r for _, _, r in hits) / len(hits)
        first_step, first_index, _ = hits[0]
        out.append(warning(
            "reward_without_correctness",
            f"reward paid without correctness: {len(hits)} of {wrong[task]} wrong answers of task '{task}' "
            f"earned reward (mean {mean:.3g}); first at step {first_step}, sample {first_index}",
            [s for s, _, _ in hits], task=task, example={"step": first_step, "index": first_index}))
    return out


def reference_answer(ground_truth: Any) -> Optional[str]:
    """The reference answer of a record's `ground_truth`: a task row's JSON carries it as
    `answer`; a plain string is the answer itself."""
    if ground_truth is None:
        return None
    if isinstance(ground_truth, str):
        try:
            parsed = json.loads(ground_truth)
        except ValueError:
            return ground_truth.strip()
        if isinstance(parsed, dict):
            return None if parsed.get("answer") is None else str(parsed["answer"]).strip()
        return str(parsed).strip()
    return str(ground_truth).strip()


def dominant_answer(records: Sequence[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The answer given by over `DOMINANT_SHARE` of the records (those with an extracted `answer`),
    unless the references are as dominated by it (a yes/no task whose truth is mostly "yes").
    None when no answer dominates or there are fewer than `DOMINANT_MIN_RESPONSES` answers."""
    answered = [r for r in records if isinstance(r.get("answer"), str) and r["answer"].strip()]
    if len(answered) < DOMINANT_MIN_RESPONSES:
        return None
    answer, count = Counter(r["answer"].strip() for r in answered).most_common(1)[0]
    share = count / len(answered)
    if share <= DOMINANT_SHARE:
        return None
    references = [reference_answer(r.get("ground_truth")) for r in answered]
    known = [ref for ref in references if ref is not None]
    if known and sum(ref == answer for ref in known) / len(known) > DOMINANT_SHARE:
        return None
    return {"answer": answer, "share": share, "responses": len(answered)}


def dominant_answer_warnings(steps: Mapping[int, Sequence[Mapping[str, Any]]], split: str) -> List[Dict[str, Any]]:
    """One warning per task where one answer dominated a step's responses (`dominant_answer`):
    a policy that found one reply scoring often enough stops answering the question."""
    found: Dict[str, List[tuple]] = defaultdict(list)
    for step in sorted(steps):
        for task, records in group_by_task(steps[step]).items():
            top = dominant_answer(records)
            if top is not None:
                found[task].append((step, top))
    out = []
    for task in sorted(found):
        hits = found[task]
        step, top = max(hits, key=lambda h: h[1]["share"])
        out.append(warning(
            "dominant_answer",
            f"one answer dominates task '{task}' ({split}): '{_short(top['answer'])}' is {top['share']:.0%} of "
            f"{top['responses']} answers at step {step}; {len(hits)} step(s) over {DOMINANT_SHARE:.0%}",
            [s for s, _ in hits], task=task, split=split))
    return out


def group_by_task(records: Iterable[Mapping[str, Any]]) -> Dict[str, List[Mapping[str, Any]]]:
    groups: Dict[str, List[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        groups[str(record.get("task") or "?")].append(record)
    return groups


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def truncated_shares(steps: Mapping[int, Sequence[Mapping[str, Any]]]) -> Dict[int, float]:
    """Per step, the share of responses whose `finish_reason` is "length" (records without one
    are not counted)."""
    out = {}
    for step, records in steps.items():
        reasons = [r.get("finish_reason") for r in records if r.get("finish_reason")]
        if reasons:
            out[step] = sum(reason == "length" for reason in reasons) / len(reasons)
    return out


def truncation_warning(shares: Mapping[int, float], source: str) -> List[Dict[str, Any]]:
    """A warning when over `TRUNCATED_SHARE` of some step's responses were cut at the length cap:
    a cut response earns nothing and its advantage teaches length, not the task."""
    over = {step: share for step, share in shares.items() if share > TRUNCATED_SHARE}
    if not over:
        return []
    worst = max(over, key=over.get)
    return [warning("truncated", f"responses cut at the length cap: over {TRUNCATED_SHARE:.0%} in {len(over)} step(s) "
                                 f"({source}); worst {over[worst]:.0%} at step {worst}", list(over))]


def logprob_gap_warning(rows: Sequence[Mapping[str, Any]], key: str = "rollout/logprob_gap") -> List[Dict[str, Any]]:
    """A warning when the trainer-vs-engine log-prob gap grows: the mean of its last third of steps
    over `GAP_GROWTH` times its first third's and above `GAP_FLOOR`. A growing gap means the rollout
    engine's weights or numerics drift from the trainer's, and the importance ratios with them."""
    points = [(row["step"], float(row[key])) for row in rows if _finite(row.get(key))]
    if len(points) < GAP_MIN_POINTS:
        return []
    third = len(points) // 3
    first = sum(v for _, v in points[:third]) / third
    last = sum(v for _, v in points[-third:]) / third
    if last > GAP_FLOOR and last > GAP_GROWTH * first:
        return [warning("logprob_gap_growing", f"the log-prob gap grows: {last:.3g} over the last third of steps, "
                                               f"{first:.3g} over the first third", [s for s, _ in points[-third:]])]
    return []


def drift_warning(rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The drift alarm's breaches (`drift/level` 1 warn, 2 stop; roll_gspo.metrics.drift) as one
    warning naming the first step, the worst gap and whether a step crossed the stop gap."""
    breached = [row for row in rows if _finite(row.get("drift/level")) and float(row["drift/level"]) >= 1]
    if not breached:
        return []
    worst = max(breached, key=lambda row: float(row["drift/gap"]) if _finite(row.get("drift/gap")) else 0.0)
    stopped = any(float(row["drift/level"]) >= 2 for row in breached)
    gap = f"{float(worst['drift/gap']):.3g}" if _finite(worst.get("drift/gap")) else "unknown"
    return [warning("drift", f"the drift alarm: {len(breached)} step(s) above the warn gap, the first at step "
                             f"{breached[0]['step']}; the largest gap over every task {gap} at step {worst['step']}"
                             f"{'; a step crossed the stop gap' if stopped else ''} (trainer vs rollout engine)",
                    [row["step"] for row in breached])]


def stall_warning(stalls: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The stalls as one warning naming the worst phase stall (or the first other one)."""
    if not stalls:
        return []
    phases = [s for s in stalls if s["kind"] == "phase"]
    worst = max(phases, key=lambda s: s["seconds"] - s["median"]) if phases else stalls[0]
    return [warning("stall", f"{len(stalls)} stall(s) (a phase over {STALL_RATIO:g}x its median and "
                             f"{STALL_MIN_EXCESS_S:g} s above it, throughput collapsing, the trainer idle); worst: "
                             f"{worst['line'].removeprefix('stall: ')}", [s["step"] for s in stalls])]


def run_warnings(rows: Sequence[Mapping[str, Any]], train: Mapping[int, Sequence[Mapping[str, Any]]],
                 val: Mapping[int, Sequence[Mapping[str, Any]]]) -> List[Dict[str, Any]]:
    """Every warning of a run, most telling first: reward leaks, collapsed answers, truncation,
    the log-prob gap, the drift alarm, stalls. Truncation falls back on `response/truncated_frac` without rollouts."""
    shares = truncated_shares(train)
    source = "training rollouts"
    if not shares:
        shares = {row["step"]: float(row["response/truncated_frac"]) for row in rows
                  if _finite(row.get("response/truncated_frac"))}
        source = "response/truncated_frac"
    return (reward_without_correctness_warnings(train) + dominant_answer_warnings(train, "train")
            + dominant_answer_warnings(val, "validation") + truncation_warning(shares, source)
            + logprob_gap_warning(rows) + drift_warning(rows) + stall_warning(find_stalls(rows)))
