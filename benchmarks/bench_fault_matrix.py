"""Which role, stopped or killed in which phase, ends how, and after how long? (issue 57 items 1, 4)

    .venv/bin/python benchmarks/bench_fault_matrix.py                     # every cell of the config's roles
    .venv/bin/python benchmarks/bench_fault_matrix.py --quick             # the suite's subset
    .venv/bin/python benchmarks/bench_fault_matrix.py --cells actor_train:train:stop,actor_infer:generate:kill
    .venv/bin/python benchmarks/bench_fault_matrix.py --list              # the cells, without running any
    .venv/bin/python benchmarks/bench_fault_matrix.py --markdown a.json b.json   # saved matrices as one table

A cell is a role, a phase and a signal: SIGSTOP (`stop`: a hang) or kill -9 (`kill`: a death). Per
cell one short run as a user starts it (`run_pipeline.py --config examples/example_gspo.yaml`, a
private Ray, the built-in tiny model) with `max_steps` a step or two past the cell's step, a
checkpoint every `--save-steps`, and small deadlines (`--hang-timeout`, `--reward-timeout`,
`--phase-floor`) so that a cell takes about a minute and a half. The roles are those the config runs
(actor_train, actor_infer, reference when the config has one, the reward workers; critic with
`--override adv_estimator=gae ...`); the phases are generate, reward, log-probs, train, weight sync,
checkpoint write and validation.

How a phase is hit: Ray names a worker's process after the call it runs (`ray::ActorTrainWorker.train_step`);
once the step before the cell's step is logged, the script watches the role's processes and sends
the signal when one runs the phase's call (validation: the first `generate`, before step 0's row).
A role with no call in a phase (a training rank while vLLM generates) is idle then: the signal
goes at the nearest point (when the step before is logged, or when the call was not seen within
`--catch-s`), and the cell says so (`caught: no`).

Per cell: the outcome (`recovered`: the run ended at max_steps with exit 0, after a replacement or
an automatic resume; `clean exit`: exit non-zero after a line that reports the fault; `HANG`: no such
line within `--hang-after` seconds of the signal, the run then killed), the seconds from the signal
to the first console line that reports it, the cell's bound beside it (kill -9: `--kill-bound`;
SIGSTOP of a rollout rank: `hang_timeout_s` plus one probe interval and 10 s; of a reward worker:
`reward_timeout_s` plus 10 s; of a training/reference/critic rank: the phase deadline,
max(`phase_timeout_floor_s`, `phase_timeout_factor` x the run's median step), plus one probe
interval and 10 s), whether the error line names role, rank, phase and the resume command, and
whether the newest complete checkpoint loads (`pipeline_state.json` and every `engine/*.pt` read
with torch.load). Times are wall-clock seconds on a shared machine: upper bounds.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_chaos import LogWatch, ranks, rows  # noqa: E402
from benchmarks.harness import REPO_ROOT, fmt, print_report  # noqa: E402

PHASES = ("generate", "reward", "log-probs", "train", "weight sync", "checkpoint write", "validation")
SIGNALS = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}
# The process title prefix of each role's workers (Ray names them after the class).
TITLES = {"actor_train": "ray::ActorTrainWorker", "actor_infer": "ray::ActorInferWorker",
          "reference": "ray::ReferenceWorker", "critic": "ray::CriticWorker", "reward": "RewardWorker"}
# The call a role runs in a phase (its process title ends with it); a role absent here idles then. A
# (role, call) pair: the call another role runs meanwhile (the trainer sends the weights inside
# train_step; the rollout rank's `load_weight_bucket` is the sync's own title).
CALLS: Dict[str, Dict[str, Any]] = {
    "actor_train": {"log-probs": "compute_log_probs", "train": "train_step",
                    "weight sync": ("actor_infer", "load_weight_bucket"), "checkpoint write": "save_checkpoint"},
         "actor_infer": {"generate": "generate", "validation": "generate", "weight sync": "load_weight_bucket"},
         "reference": {"log-probs": "compute_log_probs"},
         "critic": {"log-probs": "compute_values", "train": "train_step", "checkpoint write": "save_checkpoint"},
         "reward": {"reward": "compute_scores"}}
# A console line that reports a fault (the first one after the signal is the detection).
DETECTED = (r"^error: |WARNING role \S+ rank \d+ .*(died|hung|unresponsive)|reward worker \S+ rank \d+ (restarted|is hung)"
            r"|auto resume \d+ of")
QUICK = ("actor_train:train:stop",)


def parse_cell(text: str) -> Tuple[str, str, str]:
    """`role:phase:signal` (phase with spaces or dashes: `weight-sync`, `checkpoint-write`)."""
    parts = text.strip().split(":")
    if len(parts) != 3:
        raise SystemExit(f"--cells: {text!r} is not role:phase:signal (e.g. actor_train:train:stop)")
    role, phase, sig = parts[0], parts[1].replace("-", " ").replace("log probs", "log-probs"), parts[2]
    if role not in TITLES or phase not in PHASES or sig not in SIGNALS:
        raise SystemExit(f"--cells: {text!r}: role one of {sorted(TITLES)}, phase one of {list(PHASES)} "
                         f"(dashes for spaces), signal one of {sorted(SIGNALS)}")
    return role, phase, sig


def cell_name(cell: Sequence[str]) -> str:
    return f"{cell[0]}:{cell[1].replace(' ', '-')}:{cell[2]}"


def config_roles(config: str, extra: Sequence[str]) -> List[str]:
    """The roles the config runs, as cells name them."""
    from roll_gspo.config import load_config

    cfg = load_config(config, list(extra))
    return (["actor_train", "actor_infer"] + (["reference"] if cfg.needs_reference() else [])
            + (["critic"] if cfg.uses_critic() else []) + (["reward"] if cfg.rewards else []))


def config_calls(config: str, extra: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """`CALLS` for this config: where the old log-probs come from the rollout engine
    (`old_logprob_source` resolved as the run resolves it), actor_train runs no `compute_log_probs`,
    and its log-probs cells signal at the nearest point."""
    from roll_gspo.config import load_config
    from roll_gspo.config.plan.rollout_logprobs import choose_old_logprob_source

    calls = {role: dict(phases) for role, phases in CALLS.items()}
    if choose_old_logprob_source(load_config(config, list(extra))).source == "rollout":
        calls["actor_train"]["log-probs"] = None
    for phases in calls.values():  # validation comes before step 0: a role idle in it is signalled while vLLM
        phases.setdefault("validation", ("actor_infer", "generate"))  # generates (its processes exist by then)
    return calls


def all_cells(roles: Sequence[str]) -> List[Tuple[str, str, str]]:
    return [(role, phase, sig) for role in roles for phase in PHASES for sig in SIGNALS]


def cell_step(phase: str, save_steps: int) -> int:
    """The step the signal lands in: after the first checkpoint (the resume needs one); a checkpoint
    write at the next save step; validation at step 0 (the run's first generate)."""
    if phase == "validation":
        return 0
    if phase == "checkpoint write":
        return 2 * save_steps
    return save_steps + 1


def cell_overrides(args, output_dir: str, step: int) -> List[str]:
    out = [f"output_dir={output_dir}", f"max_steps={max(step + 1, args.save_steps + 1)}",
           f"save_steps={args.save_steps}", "eval_steps=0", "logging_steps=1", "save_total_limit=2",
           f"fault_tolerance.hang_timeout_s={args.hang_timeout}",
           f"fault_tolerance.reward_timeout_s={args.reward_timeout}",
           f"fault_tolerance.auto_resume_on_failure={args.auto_resume}"]
    if args.phase_floor is not None:
        out += [f"fault_tolerance.phase_timeout_floor_s={args.phase_floor}",
                f"fault_tolerance.phase_timeout_factor={args.phase_factor}"]
    if args.model:
        out.append(f"pretrain={args.model}")
    return out + list(args.override)


def start(args, overrides: Sequence[str], log_path: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": "local",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "run_pipeline.py", "--config", args.config, *overrides],
                                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def rank_of(output_dir: str, role: str, pid: int) -> Optional[int]:
    """A rank's number from its log file, `<output_dir>/logs/<role>-<rank>-<pid>.log`."""
    for path in glob.glob(os.path.join(output_dir, "**", f"*-{pid}.log"), recursive=True):
        match = re.fullmatch(r"(.+)-(\d+)-\d+\.log", os.path.basename(path))
        if match and (match.group(1) == role or role == "reward" and match.group(1).startswith("reward")):
            return int(match.group(2))
    return None


def role_processes(driver: subprocess.Popen, role: str) -> List[Any]:
    """The role's rank processes: not their children, which carry the same title (a reward worker's
    scoring subprocess; stopping one of those is the per-response `timeout_s`'s case, not a hung worker)."""
    found = ([p for p in ranks(driver, "ray::") if TITLES["reward"] in p.name()] if role == "reward"
             else ranks(driver, TITLES[role]))
    pids = {p.pid for p in found}
    return [p for p in found if _parent(p) not in pids]


def _parent(process) -> Optional[int]:
    import psutil

    try:
        return process.ppid()
    except psutil.Error:  # gone meanwhile
        return None


def wait_step_logged(output_dir: str, step: int, driver: subprocess.Popen, timeout_s: float) -> bool:
    """Whether step `step`'s row came (always, for step < 0) before the driver exited or the deadline."""
    deadline = time.monotonic() + timeout_s
    while step >= 0 and not any(r["step"] == step for r in rows(output_dir)):
        if driver.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def aim(driver: subprocess.Popen, role: str, call: Optional[str], catch_s: float,
        last_rank: bool = True) -> Tuple[Optional[Any], bool]:
    """A process of `role` running `call` (the highest-pid one when several do: the last rank
    started), polled every 5 ms for `catch_s` s; without `call`, or when not seen, any process of the
    role. Returns (process, caught)."""
    deadline = time.monotonic() + catch_s
    while call and time.monotonic() < deadline and driver.poll() is None:
        running = [p for p in role_processes(driver, role) if p.name().endswith("." + call)]
        if running:
            return sorted(running, key=lambda p: p.pid)[-1 if last_rank else 0], True
        time.sleep(0.005)
    found = sorted(role_processes(driver, role), key=lambda p: p.pid)
    return (found[-1] if found else None), False


def bound_s(args, role: str, sig: str, median_step_s: float) -> float:
    """How long the cell's fault may take to be reported (the module's docstring)."""
    if sig == "kill":
        return args.kill_bound
    if role == "actor_infer":
        return args.hang_timeout + min(10.0, args.hang_timeout / 4) + 10
    if role == "reward":
        return args.reward_timeout + 10
    floor = args.phase_floor if args.phase_floor is not None else 60.0
    deadline = max(floor, args.phase_factor * median_step_s)
    return deadline + min(10.0, deadline / 4) + 10


def checkpoint_loads(output_dir: str) -> Optional[str]:
    """'step N' when the newest complete checkpoint's state and engine files load, an error text when
    they do not, None when there is none."""
    import torch

    from roll_gspo.lifecycle.checkpoint import complete_checkpoints, read_state

    found = complete_checkpoints(output_dir)
    if not found:
        return None
    try:
        read_state(found[-1])
        for path in sorted(glob.glob(os.path.join(found[-1], "**", "*.pt"), recursive=True)):
            torch.load(path, map_location="cpu", weights_only=False)
        for path in sorted(glob.glob(os.path.join(found[-1], "**", "*.safetensors"), recursive=True)):
            from safetensors.torch import load_file

            load_file(path)
    except Exception as exc:  # noqa: BLE001 - the cell reports it
        return f"fails: {type(exc).__name__}: {exc}"
    return os.path.basename(found[-1]).replace("_", " ")


def names_all(line: str, role: str, rank: Optional[int], phase: str, call: Optional[str]) -> Dict[str, bool]:
    """Which of role, rank, phase and the resume command the line names (the phase: the one the
    fault was found in, `... ran train (train_step)` or `..., in phase train (train_step)`; for a
    role idle in the cell's phase, the phase of its next call)."""
    role_ok = (role in line) if role != "reward" else ("reward" in line)
    return {"role": role_ok, "rank": rank is not None and f"rank {rank}" in line,
            "phase": bool(re.search(r"\b(in phase|ran) [a-z -]+ \(\w+\)", line)),
            "resume": "resume_from_checkpoint=auto" in line and "run_pipeline.py" in line}


def run_cell(args, cell: Tuple[str, str, str], folder: str) -> Dict[str, Any]:
    """One run with the cell's fault; its outcome (module docstring)."""
    role, phase, sig = cell
    spec = getattr(args, "calls", CALLS).get(role, {}).get(phase)
    watched, call = spec if isinstance(spec, tuple) else (role, spec)
    step = cell_step(phase, args.save_steps)
    name = cell_name(cell).replace(":", "_").replace("-", "_")
    output_dir, log_path = os.path.join(folder, name), os.path.join(folder, f"{name}.log")
    overrides = cell_overrides(args, output_dir, step)
    os.makedirs(folder, exist_ok=True)
    print(f"[bench] cell {cell_name(cell)}: signal in step {step}; log {log_path}", flush=True)
    started = time.time()
    driver = start(args, overrides, log_path)
    watch = LogWatch(log_path)
    out: Dict[str, Any] = {"cell": cell_name(cell), "role": role, "phase": phase, "signal": sig, "step": step,
                           "call": call if watched == role else f"{watched}.{call}", "log": log_path}
    try:
        if not wait_step_logged(output_dir, step - 1, driver, args.start_s):
            out.update(outcome="no run", note=f"the driver exited ({driver.poll()}) or step {step - 1} did not come "
                                              f"within {args.start_s:.0f} s", detect_s=None)
            return out
        # validation: step 0's, the run's first generate, after start-up
        process, caught = aim(driver, watched, call, args.start_s if step == 0 else args.catch_s)
        if watched != role:  # seen in another role's process: the role's own (the highest pid) gets the signal
            process = aim(driver, role, None, 0)[0]
        if process is None or driver.poll() is not None:
            out.update(outcome="no run", detect_s=None, note=f"no {role} process" if driver.poll() is None else
                       f"the run ended (exit {driver.poll()}) before {call or 'the signal'} was seen")
            return out
        out["title"] = process.name()
        out["caught"] = caught
        out["rank"] = rank_of(output_dir, "reward" if role == "reward" else role, process.pid)
        if not caught:
            out["note"] = (f"{role} runs no call in {phase}: sent at the nearest point" if call is None else
                           f"{call} not seen within {args.catch_s:g} s: sent at the nearest point")
            out["note"] += f" (the process was running {out['title']!r})"
        at = time.time()
        process.send_signal(SIGNALS[sig])
        out["signal_at_s"] = at - started
        detected, code = None, None
        deadline = at + args.hang_after
        while time.time() < deadline:
            detected = detected or watch.first(DETECTED, at)
            code = driver.poll()
            if code is not None:
                break
            time.sleep(0.2)
        if code is None and detected is None:  # nothing said within --hang-after: a hang
            out.update(outcome="HANG", detect_s=None)
        else:
            code = driver.wait(timeout=args.finish_s) if code is None else code
    except subprocess.TimeoutExpired:
        out.update(outcome="HANG", note=f"reported, but the run did not end within {args.finish_s:.0f} s")
        code = None
    finally:
        if driver.poll() is None:
            driver.kill()  # its private Ray goes with it (roll_gspo/distributed/reaper.py)
            driver.wait()
        watch.stop()
    found = watch.first(DETECTED, at)
    out["exit_code"] = code
    out["line_seen_s"] = None if found is None else round(found[0] - at, 2)
    out["line"] = None if found is None else _whole_line(watch, found)
    errors = [line for _, line in watch.lines if line.startswith("error: ")]
    out["error_line"] = errors[0] if errors else None
    records = rows(output_dir)
    step_s = [r["time/step_s"] for r in records if isinstance(r.get("time/step_s"), (int, float))]
    out["median_step_s"] = statistics.median(step_s) if step_s else 0.0
    out["bound_s"] = round(bound_s(args, role, sig, out["median_step_s"]), 1)
    max_steps = max(step + 1, args.save_steps + 1)
    if "outcome" not in out:
        if code == 0 and records and records[-1]["step"] == max_steps:
            out["outcome"] = "recovered"
        elif code not in (0, None) and found is not None:
            out["outcome"] = "clean exit"
        else:
            out["outcome"] = f"exit {code}"
    settle(out)
    out["checkpoint"] = checkpoint_loads(output_dir)
    out["wall_s"] = round(time.time() - started, 1)
    return out


def settle(cell: Dict[str, Any]) -> Dict[str, Any]:
    """A cell's verdicts from what its run printed: `detect_s` (the reporting line's time after the
    signal, less the replacement's own seconds where the line reports a replaced rank: it is printed
    once the new rank is up), `names`, `within_bound`. Also applied to saved JSON (`--markdown`)."""
    seen = cell.get("line_seen_s", cell.get("detect_s"))
    line = cell.get("line") or ""
    replaced = re.search(r"replaced in its placement bundle \(restart \d+ of \d+ for this rank, ([\d.]+) s\)", line)
    cell["detect_s"] = None if seen is None else round(seen - (float(replaced.group(1)) if replaced else 0.0), 2)
    spec = CALLS.get(cell["role"], {}).get(cell["phase"])
    call = spec[1] if isinstance(spec, tuple) else spec
    cell["names"] = names_all(cell.get("error_line") or line, cell["role"], cell.get("rank"), cell["phase"], call)
    cell["within_bound"] = cell["detect_s"] is not None and cell["detect_s"] <= (cell.get("bound_s") or 0)
    return cell


def _whole_line(watch: LogWatch, found) -> str:
    seen, match = found
    for when, line in watch.lines:
        if when == seen and match.group(0) in line:
            return line
    return match.group(0)


def table(result: Dict[str, Any]) -> str:
    """The matrix as a markdown table (also what `--markdown` prints from a saved JSON)."""
    lines = ["| role | phase | signal | outcome | detected after (s) | bound (s) | line names role/rank/phase/resume | "
             "checkpoint loads | note |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cell in result["cells"]:
        names = cell.get("names") or {}
        keys = ("role", "rank", "phase", "resume") if cell["outcome"] != "recovered" else ("role", "rank", "phase")
        named = "/".join("yes" if names.get(k) else "no" for k in keys) + ("/n.a." if len(keys) == 3 else "") \
            if names else "-"
        note = cell.get("note") or ("" if cell.get("caught", True) else "not caught")
        signal_name = "SIGSTOP" if cell["signal"] == "stop" else "kill -9"
        lines.append(f"| {cell['role']}{'' if cell.get('rank') is None else ' rank ' + str(cell['rank'])} | "
                     f"{cell['phase']} | {signal_name} | {cell['outcome']} | {fmt(cell.get('detect_s'), '.1f')} | "
                     f"{fmt(cell.get('bound_s'), '.0f')} | {named} | {cell.get('checkpoint') or 'none'} | "
                     f"{note.replace('|', '/')} |")
    return "\n".join(lines)


def failures(result: Dict[str, Any]) -> List[str]:
    """The cells that break the issue's rule: a HANG, a report past its bound, an exit line that
    does not name role, rank, phase and the resume command, a checkpoint that does not load."""
    bad = []
    for cell in result["cells"]:
        if cell["outcome"] == "no run":
            bad.append(f"{cell['cell']}: no run ({cell.get('note')})")
        elif cell["outcome"] == "HANG":
            bad.append(f"{cell['cell']}: HANG")
        elif not cell.get("within_bound"):
            bad.append(f"{cell['cell']}: detected after {cell.get('detect_s')} s, bound {cell.get('bound_s')} s")
        elif cell["outcome"] == "clean exit" and not all(cell["names"].values()):
            bad.append(f"{cell['cell']}: its exit line misses {[k for k, v in cell['names'].items() if not v]}")
        elif cell["outcome"] not in ("recovered", "clean exit"):
            bad.append(f"{cell['cell']}: {cell['outcome']}")
        if str(cell.get("checkpoint") or "").startswith("fails"):
            bad.append(f"{cell['cell']}: checkpoint {cell['checkpoint']}")
    return bad


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/example_gspo.yaml")
    parser.add_argument("--model", default=None, help="pretrain override (a model folder or builtin:NAME)")
    parser.add_argument("--cells", default=None, help="role:phase:signal,... (default: every cell of the config)")
    parser.add_argument("--quick", action="store_true", help=f"the suite's subset: {', '.join(QUICK)}")
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=20.0, help="fault_tolerance.hang_timeout_s")
    parser.add_argument("--reward-timeout", type=float, default=20.0, help="fault_tolerance.reward_timeout_s")
    parser.add_argument("--phase-floor", type=float, default=20.0,
                        help="fault_tolerance.phase_timeout_floor_s (a negative value: leave the key out)")
    parser.add_argument("--phase-factor", type=float, default=10.0, help="fault_tolerance.phase_timeout_factor")
    parser.add_argument("--auto-resume", type=int, default=0, help="fault_tolerance.auto_resume_on_failure")
    parser.add_argument("--kill-bound", type=float, default=30.0, help="the bound of a kill -9 cell, seconds")
    parser.add_argument("--catch-s", type=float, default=60.0, help="how long to watch for the phase's call")
    parser.add_argument("--hang-after", type=float, default=300.0,
                        help="a cell with no report this long after the signal is a HANG")
    parser.add_argument("--start-s", type=float, default=900.0, help="how long a run may take to reach the cell's step")
    parser.add_argument("--finish-s", type=float, default=300.0, help="how long a run may take to end once reported")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override for every run")
    parser.add_argument("--folder", default=None, help="where the runs go (default: a temporary folder, kept)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, nargs="+", metavar="JSON",
                        help="print saved matrices (--json files) as one table and exit")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.markdown:  # several saved matrices: one table, each one's command, date and machine above it
        cells = []
        for path in args.markdown:
            with open(path) as handle:
                saved = json.load(handle)
            print(f"`{saved['command']}` on {saved['date']}, {saved['machine']}\n")
            cells += [settle(cell) if cell.get("outcome") not in ("no run", "HANG") else cell
                      for cell in saved["cells"]]
        print(table({"cells": cells}))
        return 0
    if args.phase_floor is not None and args.phase_floor < 0:
        args.phase_floor = None
    if args.config and not os.path.isabs(args.config) and not os.path.exists(args.config):
        args.config = os.path.join(REPO_ROOT, args.config)
    if args.cells:
        cells = [parse_cell(text) for text in args.cells.split(",")]
    elif args.quick:
        cells = [parse_cell(text) for text in QUICK]
    else:
        cells = all_cells(config_roles(args.config, args.override))
    if args.list:
        print("\n".join(cell_name(cell) for cell in cells))
        return 0
    args.calls = config_calls(args.config, args.override)
    folder = args.folder or tempfile.mkdtemp(prefix="bench_fault_matrix_")
    os.makedirs(folder, exist_ok=True)
    import platform

    result: Dict[str, Any] = {
        "command": " ".join(["benchmarks/bench_fault_matrix.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, shared (timings are upper bounds)", "cells": []}
    for cell in cells:
        result["cells"].append(run_cell(args, cell, folder))
        print(f"[bench] {json.dumps({k: v for k, v in result['cells'][-1].items() if k != 'log'}, default=str)}",
              flush=True)
    result["failures"] = failures(result)
    print_report(table(result) + ("\n\nfailing cells: " + "; ".join(result["failures"]) if result["failures"] else
                                  "\n\nno HANG, every cell within its bound"), result, args.json)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
