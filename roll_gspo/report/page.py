"""The report's page: the data of one or more runs gathered into one JSON object and embedded in a
self-contained HTML file (template.html: inline CSS and JS, SVG charts, no network), so the file
can be mailed, archived or opened from disk offline and still show everything."""
from __future__ import annotations

import datetime
import json
import os
import re
from importlib import resources
from typing import Any, Dict, List, Mapping, Optional, Sequence

from roll_gspo.report.checks import find_stalls, phase_keys, phase_name, run_warnings
from roll_gspo.report.files import MetricsRows, Rollouts, read_metrics_rows, read_rollouts, require_run_folder

REPORT_FILE = "report.html"
TEMPLATE = "template.html"
DATA_PLACEHOLDER = "__REPORT_DATA__"

# The page embeds a bounded part of the rollouts so it stays a few MB: the first training samples
# of each step and every validation sample (up to a cap); the page says what it left out.
MAX_TRAIN_SAMPLES_PER_STEP = 64
MAX_VAL_SAMPLES_PER_STEP = 512
MAX_STEPS_EMBEDDED = 50  # per split; a longer run embeds evenly spaced steps, its first and last included
TEXT_LIMIT = 6000  # characters of one prompt, response or turn kept in the page
GROUND_TRUTH_LIMIT = 400
MAX_TURNS = 64

# Chart groups: a title and the patterns of the metric keys it draws; a key a run lacks is not drawn,
# a group no run has a key of is not shown.
CHART_GROUPS = (
    ("Reward", (r"^reward/mean$", r"^reward/[^/]+/mean$", r"^traj/reward_mean$")),
    ("Validation accuracy", (r"^val/accuracy$", r"^val/[^/]+/accuracy$", r"^val/success_rate$")),
    ("Validation pass@k", (r"^val/(.+/)?pass@\d+$",)),
    ("Validation reward", (r"^val/mean$", r"^val/[^/]+/mean$")),
    ("Clip fraction", (r"^actor/clipfrac$", r"^actor/dual_clipfrac$")),
    ("Entropy", (r"^actor/entropy$",)),
    ("Response length (tokens)", (r"^response/length_mean$", r"^response/length_max$")),
    ("Responses cut at the length cap", (r"^response/truncated_frac$",)),
    ("Log-prob gap (trainer vs engine)", (r"^rollout/logprob_gap$", r"^rollout/logprob_gap/lag\d+$")),
    ("Throughput (tokens/s)", (r"^throughput/tokens_per_s$", r"^throughput/agent_tokens_per_s$")),
    ("Staleness (steps)", (r"^rollout/staleness$", r"^rollout/staleness_mean$", r"^rollout/staleness_max$")),
)

# The fields of a rollout record the page shows (anything else a writer adds is left out).
SAMPLE_FIELDS = ("step", "index", "group", "task", "response", "prompt_tokens", "response_tokens", "finish_reason",
                 "ground_truth", "reward", "reward_parts", "correct", "advantage", "logprob_gap", "weight_version",
                 "staleness", "answer", "reward_status", "success")


def chart_groups(keys: Sequence[str]) -> List[Dict[str, Any]]:
    """The chart groups that have at least one of `keys`, each with its keys in the order given."""
    out = []
    for title, patterns in CHART_GROUPS:
        matched = [k for k in keys if any(re.search(p, k) for p in patterns)]
        if matched:
            out.append({"title": title, "keys": sorted(matched, key=_key_order)})
    return out


def _key_order(key: str) -> tuple:
    """Overall keys before per-task ones, pass@k by k."""
    k = re.search(r"pass@(\d+)$", key)
    return (key.count("/"), int(k.group(1)) if k else 0, key)


def series_of(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> Dict[str, Any]:
    """Column form of the rows for `keys`: the steps once, each key's values aligned with them
    (null where a row lacks it). Smaller than the rows and what the charts read."""
    return {"steps": [row["step"] for row in rows],
            "values": {key: [row.get(key) for row in rows] for key in keys}}


def compact_text(value: Any, limit: int = TEXT_LIMIT) -> Optional[str]:
    """A text field bounded for the page, saying how much was cut."""
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n… [{len(text) - limit} more characters not embedded]"


def compact_sample(record: Mapping[str, Any], prompt_ids: Dict[str, int], prompts: List[str]) -> Dict[str, Any]:
    """A record as the page holds it: its shown fields, bounded texts, the prompt as an index into
    the page's prompt table (a group's samples share one prompt), turns bounded."""
    sample = {k: record[k] for k in SAMPLE_FIELDS if k in record}
    for key in ("response", "answer"):
        if key in sample:
            sample[key] = compact_text(sample[key])
    if "ground_truth" in sample:
        sample["ground_truth"] = compact_text(sample["ground_truth"], GROUND_TRUTH_LIMIT)
    if not isinstance(sample.get("reward_parts"), dict):
        sample.pop("reward_parts", None)
    prompt = compact_text(record.get("prompt")) or ""
    if prompt not in prompt_ids:
        prompt_ids[prompt] = len(prompts)
        prompts.append(prompt)
    sample["p"] = prompt_ids[prompt]
    turns = record.get("turns")
    if isinstance(turns, list):
        sample["turns"] = [{"observation": compact_text(t.get("observation")), "action": compact_text(t.get("action")),
                            "reward": t.get("reward")} for t in turns[:MAX_TURNS] if isinstance(t, dict)]
        sample["turns_left_out"] = max(0, len(turns) - MAX_TURNS)
    return sample


def spaced_steps(steps: Sequence[int], limit: int, wanted: Sequence[int] = ()) -> List[int]:
    """At most `limit` of `steps` (plus those `wanted`, e.g. a warning's example), evenly spaced with
    the first and last: a long run's page shows its whole course in a bounded size."""
    steps = sorted(steps)
    if len(steps) <= limit:
        return steps
    picked = {steps[round(i * (len(steps) - 1) / (limit - 1))] for i in range(limit)} if limit > 1 else {steps[-1]}
    return sorted(picked | (set(wanted) & set(steps)))


def embedded_samples(rollouts: Rollouts, wanted_steps: Sequence[int] = ()) -> Dict[str, Any]:
    """The part of the rollouts the page embeds, with a count of what each step left out and the
    steps whose samples were left out whole."""
    prompts: List[str] = []
    prompt_ids: Dict[str, int] = {}
    out: Dict[str, Any] = {"prompts": prompts, "train": {}, "val": {}, "left_out": {"train": {}, "val": {}},
                           "steps_left_out": {"train": 0, "val": 0},
                           "max_per_step": {"train": MAX_TRAIN_SAMPLES_PER_STEP, "val": MAX_VAL_SAMPLES_PER_STEP}}
    for split, steps, cap in (("train", rollouts.train, MAX_TRAIN_SAMPLES_PER_STEP),
                              ("val", rollouts.val, MAX_VAL_SAMPLES_PER_STEP)):
        chosen = spaced_steps(list(steps), MAX_STEPS_EMBEDDED, wanted_steps)
        out["steps_left_out"][split] = len(steps) - len(chosen)
        for step in chosen:
            records = steps[step]
            out[split][str(step)] = [compact_sample(r, prompt_ids, prompts) for r in records[:cap]]
            if len(records) > cap:
                out["left_out"][split][str(step)] = len(records) - cap
    return out


def run_notes(folder: str, metrics: MetricsRows, rollouts: Optional[Rollouts]) -> List[str]:
    """What the page should say about the files themselves: what is missing or was skipped."""
    name = os.path.basename(os.path.normpath(folder))
    notes = []
    if metrics.unreadable_lines:
        notes.append(f"{name}: {metrics.unreadable_lines} unreadable line(s) of metrics.jsonl skipped")
    if not metrics.rows:
        notes.append(f"{name}: metrics.jsonl holds no step yet")
    if rollouts is not None and not rollouts.present:
        notes.append(f"{name}: no rollouts/ folder (a run from before rollouts were recorded, or with recording "
                     f"off): curves and timeline only, no samples")
    if rollouts is not None and rollouts.skipped:
        notes.append(f"{name}: {len(rollouts.skipped)} unreadable rollout file(s) skipped: "
                     + "; ".join(f"{s.path} ({s.reason})" for s in rollouts.skipped))
    return notes


def run_names(folders: Sequence[str]) -> List[str]:
    """Each run's short name (its folder's), the full path where two would read the same."""
    names = [os.path.basename(os.path.normpath(f)) or f for f in folders]
    return [f if names.count(n) > 1 else n for n, f in zip(names, folders)]


def run_data(name: str, metrics: MetricsRows) -> Dict[str, Any]:
    """One run's curves and timeline: the series of its chart and phase keys, its stalls."""
    keys = sorted({k for row in metrics.rows for k in row if k != "step"})
    groups = chart_groups(keys)
    phases = phase_keys(metrics.rows)
    wanted = sorted({k for g in groups for k in g["keys"]} | set(phases))
    return {"name": name, "series": series_of(metrics.rows, wanted), "phases": phases,
            "phase_names": [phase_name(k) for k in phases], "stalls": find_stalls(metrics.rows)}


def report_data(output_dir: str, others: Sequence[str] = (), *, train_dir: Optional[str] = None,
                val_dir: Optional[str] = None) -> Dict[str, Any]:
    """Everything the page shows, as one JSON-able object: every run's curves and timeline, the
    first run's warnings and samples, the notes on missing or skipped files. `train_dir` /
    `val_dir`: the run's rollout folders when its config moved them (default `<output_dir>/rollouts`
    and its `val/`)."""
    folders = [output_dir, *others]
    for folder in folders:
        require_run_folder(folder)
    names = run_names(folders)
    metrics = [read_metrics_rows(f) for f in folders]
    rollouts = read_rollouts(output_dir, train_dir, val_dir)
    runs = [run_data(n, m) for n, m in zip(names, metrics)]
    keys = sorted({k for run in runs for k in run["series"]["values"]})
    notes = run_notes(output_dir, metrics[0], rollouts)
    for folder, rows in zip(others, metrics[1:]):
        notes += run_notes(folder, rows, None)
    if others:
        notes.append(f"warnings, timeline stalls and samples are {names[0]}'s; the curves overlay {len(folders)} runs")
    warnings = run_warnings(metrics[0].rows, rollouts.train, rollouts.val)
    samples = embedded_samples(rollouts, [w["example"]["step"] for w in warnings if "example" in w])
    for split, name in (("train", "training"), ("val", "validation")):
        if samples["steps_left_out"][split]:
            notes.append(f"{names[0]}: the page embeds the samples of {len(samples[split])} evenly spaced {name} steps "
                         f"of {len(samples[split]) + samples['steps_left_out'][split]} (the rollout files hold them all)")
    return {"title": " vs ".join(names), "generated": datetime.datetime.now().isoformat(timespec="seconds"),
            "runs": runs, "groups": chart_groups(keys), "notes": notes, "has_rollouts": rollouts.present,
            "warnings": warnings, "samples": samples}


def finite_only(value: Any) -> Any:
    """The value with NaN and infinities as null: a rollout file may hold them (Python's json
    writes them), JavaScript's JSON.parse refuses them."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: finite_only(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_only(v) for v in value]
    return value


def embed_json(data: Any) -> str:
    """JSON safe inside a <script> element: no `</script>` or `<!--` can close or comment it."""
    return json.dumps(finite_only(data), separators=(",", ":"), allow_nan=False).replace("<", "\\u003c").replace(
        ">", "\\u003e").replace("&", "\\u0026")


def render_page(data: Mapping[str, Any]) -> str:
    """The template with the data embedded as JSON."""
    template = resources.files("roll_gspo.report").joinpath(TEMPLATE).read_text(encoding="utf-8")
    return template.replace(DATA_PLACEHOLDER, embed_json(data), 1)


def write_report(output_dir: str, others: Sequence[str] = (), path: Optional[str] = None, *,
                 train_dir: Optional[str] = None, val_dir: Optional[str] = None) -> str:
    """Write the run report of `output_dir` (curves overlaid with `others`' runs) to `path`
    (default `<output_dir>/report.html`) and return its path. The file is replaced atomically, so a
    browser reloading it while a run rewrites it never reads half a page. `train_dir` / `val_dir`:
    as `report_data`'s."""
    target = path or os.path.join(output_dir, REPORT_FILE)
    page = render_page(report_data(output_dir, others, train_dir=train_dir, val_dir=val_dir))
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{target}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(page)
    os.replace(tmp, target)
    return target
