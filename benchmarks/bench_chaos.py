"""What does a run survive, and what does each recovery cost? (issue 39 item 4)

    .venv/bin/python benchmarks/bench_chaos.py                        # 20 steps, 5 vLLM kills, one reward hang, one trainer kill
    .venv/bin/python benchmarks/bench_chaos.py --steps 8 --kills 2 --json chaos.json
    .venv/bin/python benchmarks/bench_chaos.py --no-baseline --override actor_infer.world_size=2
    .venv/bin/python benchmarks/bench_chaos.py --no-reshape          # the chaos part only

One RLVR run as a user starts it (`run_pipeline.py --config examples/example_gspo.yaml`, a private
Ray), with `max_steps = --steps`, a checkpoint every `--save-steps`, validation at step 0 and at
the end, `fault_tolerance.auto_resume_on_failure: 1`, `max_restarts` room for every kill and
`reward_timeout_s = --reward-timeout`. While it runs, at steps drawn with `--seed`, this script:

* kills the vLLM rank with kill -9 (`--kills` times, each at another step), while it generates
  when it can catch it doing so within 30 s (Ray names the process after the call it runs);
* freezes a reward worker once with SIGSTOP at the start of a step (a hang: its call never
  returns; the driver kills it at `reward_timeout_s`, Ray restarts it and runs the call again);
* kills a training rank once with kill -9 while it trains, at a step after the first checkpoint
  (the run stops; the driver resumes from the last checkpoint in the same process).

Then the same run without chaos (`--no-baseline` skips it). The report: whether the run ended at
max_steps with exit 0, its steps (each once, none missing: `metrics.jsonl`), the restarts counted
(`fault/restarts/*`), how many rows equal the uninterrupted run's (time, throughput, `fault/*` and
`reward/worker_restarts` aside), the final validation of both and the final weights' largest
difference, and per event the time its recovery took:

* vLLM kill: the replacement's own time (the console line: stop, start in its bundle, engine set
  up, weights), and the step's wall time above the run's median step (replacement plus the
  prompts generated again);
* reward hang: from SIGSTOP to the console line of the restarted worker (the deadline included);
* trainer kill: from the kill to `resumed from ... at step N` (the run stopped, its ranks gone,
  every role started again, the checkpoint loaded), and the steps computed again after the
  checkpoint.

Then the reshape part (`--no-reshape` skips it): an uninterrupted run of `--reshape-save-step` + 5
steps with a checkpoint at `--reshape-save-step`, and two runs resumed from a copy of that checkpoint
on another training shape (roll_gspo/lifecycle/reshape.py; docs/crash_safety.md): the config's
`actor_train` on 1 rank with `gradient_accumulation_steps` times its `world_size` (as many
mini-batches per step, of the same size), and the same ranks under FSDP2 instead of DeepSpeed. Per resumed step:
`actor/pg_loss`, `actor/grad_norm` and `reward/mean` resumed minus uninterrupted, the largest
absolute gap over the 5 steps, and each run's final validation. Not bit-identical by design: the
gradient of the same rows is summed in another order; the point is the drift it grows into.

Times are wall-clock seconds on whatever else the machine runs: compare them only within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import REPO_ROOT, fmt, print_report  # noqa: E402

WAIT_S = 1800.0  # for any one event's step to come
IGNORED = ("time/", "throughput/", "fault/")  # what differs between any two runs, or counts the chaos
IGNORED_KEYS = ("sync/seconds", "reward/worker_restarts")
RESHAPE_STEPS = 5  # trained after the resumed checkpoint
DRIFT_KEYS = ("actor/pg_loss", "actor/grad_norm", "reward/mean")


def draw_events(steps: int, kills: int, reward_hang: bool, trainer_kill: bool, seed: int,
                save_steps: int) -> List[Dict[str, Any]]:
    """The chaos, one event per step (steps 2..max_steps-1: each lands mid-run; the training rank's
    after the first checkpoint, which the resume needs), sorted by step."""
    rng = random.Random(seed)
    candidates = list(range(2, steps))
    events = []
    if trainer_kill:
        later = [step for step in candidates if step > save_steps]
        if not later:
            raise SystemExit(f"--steps {steps} leaves no step after the first checkpoint (--save-steps {save_steps})")
        events.append({"kind": "trainer", "step": rng.choice(later)})
        candidates.remove(events[0]["step"])
    kinds = ["rollout"] * kills + (["reward_hang"] if reward_hang else [])
    if len(kinds) > len(candidates):
        raise SystemExit(f"--steps {steps} leaves {len(candidates)} steps for {len(kinds) + len(events)} events: "
                         f"raise --steps")
    events += [{"kind": kind, "step": step} for kind, step in zip(kinds, rng.sample(candidates, len(kinds)))]
    return sorted(events, key=lambda event: event["step"])


def overrides(args, output_dir: str, chaos: bool, extra: Sequence[str] = ()) -> List[str]:
    # A run without chaos keeps every checkpoint: the reshape part resumes from its first.
    keep = 2 if chaos else args.steps // args.save_steps + 1
    out = [f"output_dir={output_dir}", f"max_steps={args.steps}", f"save_steps={args.save_steps}",
           f"eval_steps={args.steps}", "logging_steps=1", f"save_total_limit={keep}", *extra]
    if args.model:
        out.append(f"pretrain={args.model}")
    if chaos:
        out += ["fault_tolerance.auto_resume_on_failure=1", f"fault_tolerance.max_restarts={args.kills + 2}",
                f"fault_tolerance.reward_timeout_s={args.reward_timeout}"]
    return out + list(args.override)


def start(args, output_dir: str, chaos: bool, log_path: str, extra: Sequence[str] = ()) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": "local",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "run_pipeline.py", "--config", args.config,
                                 *overrides(args, output_dir, chaos, extra)],
                                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def rows(output_dir: str, name: str = "metrics.jsonl") -> List[Dict[str, Any]]:
    path = os.path.join(output_dir, name)
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.endswith("\n")]


def ranks(driver: subprocess.Popen, prefix: str) -> List[Any]:
    import psutil

    try:
        return [p for p in psutil.Process(driver.pid).children(recursive=True) if p.name().startswith(prefix)]
    except psutil.Error:
        return []


def wait_for(condition, driver: subprocess.Popen, what: str, timeout_s: float = WAIT_S, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if driver.poll() is not None:
            raise SystemExit(f"the driver exited ({driver.returncode}) while waiting for {what}")
        time.sleep(poll_s)
    raise SystemExit(f"not within {timeout_s:.0f} s: {what}")


def act(event: Dict[str, Any], driver: subprocess.Popen) -> None:
    """Do the event's damage; records its pid and wall time in `event`."""
    kind = event["kind"]
    if kind == "rollout":
        (rank,) = wait_for(lambda: ranks(driver, "ray::ActorInferWorker")[:1], driver, "the vLLM rank")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not rank.name().endswith(".generate"):
            time.sleep(0.005)
        event["while"] = rank.name().removeprefix("ray::ActorInferWorker").lstrip(".") or "idle"
        event["pid"], event["at"] = rank.pid, time.time()
        rank.kill()
    elif kind == "reward_hang":
        (rank,) = wait_for(lambda: [p for p in ranks(driver, "ray::") if "RewardWorker" in p.name()][:1], driver,
                           "a reward worker")
        event["pid"], event["at"] = rank.pid, time.time()
        os.kill(rank.pid, signal.SIGSTOP)
    else:  # while it trains (the previous step's checkpoint, if one was due, is complete by then)
        rank = wait_for(lambda: next((p for p in ranks(driver, "ray::ActorTrainWorker")
                                      if p.name().endswith(".train_step")), None), driver, "a training rank training",
                        poll_s=0.005)
        event["pid"], event["at"] = rank.pid, time.time()
        rank.kill()


class LogWatch:
    """The driver's log, read as it grows (a thread, every 0.1 s): each line with the wall time it
    was first seen."""

    def __init__(self, path: str):
        import threading

        self.path, self.offset, self.lines = path, 0, []
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while not self.stopped.wait(0.1):
            self.poll()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.poll()

    def poll(self) -> None:
        with self.lock:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
            complete = data[:data.rfind(b"\n") + 1]
            self.offset += len(complete)
            now = time.time()
            self.lines += [(now, line) for line in complete.decode(errors="replace").splitlines()]

    def first(self, pattern: str, after: float) -> Optional[tuple]:
        with self.lock:
            lines = list(self.lines)
        for seen, line in lines:
            if seen >= after - 1.0:  # a line written as the event happened
                match = re.search(pattern, line)
                if match:
                    return seen, match
        return None


def recovery(event: Dict[str, Any], watch: LogWatch) -> Optional[Dict[str, Any]]:
    """The event's recovery as the driver's log shows it (None while not seen yet)."""
    if event["kind"] == "rollout":
        found = watch.first(rf"role actor_infer rank \d+ \(node \S+, pid {event['pid']}\) died: .*\(restart (\d+) of "
                            rf"\d+ for this rank, ([\d.]+) s\); (.*?)(?:\. Its output|$)", event["at"])
        return None if found is None else {"replacement_s": float(found[1].group(2)),
                                           "seen_after_s": found[0] - event["at"], "note": found[1].group(3)}
    if event["kind"] == "reward_hang":
        found = watch.first(r"reward worker (\S+) rank \d+ restarted \((its call ran past [^;]+)", event["at"])
        return None if found is None else {"recovered_after_s": found[0] - event["at"], "note": found[1].group(2)}
    found = watch.first(r"resumed from \S+ at step (\d+)", event["at"])
    return None if found is None else {"recovered_after_s": found[0] - event["at"],
                                       "resumed_at_step": int(found[1].group(1))}


def chaos_run(args, folder: str) -> Dict[str, Any]:
    events = draw_events(args.steps, args.kills, not args.no_reward_hang, not args.no_trainer_kill, args.seed,
                         args.save_steps)
    output_dir, log_path = os.path.join(folder, "chaos"), os.path.join(folder, "chaos.log")
    print(f"[bench] chaos run: {len(events)} events at steps {[(e['step'], e['kind']) for e in events]}; "
          f"log {log_path}", flush=True)
    started = time.time()
    driver = start(args, output_dir, True, log_path)
    watch = LogWatch(log_path)
    for event in events:
        # The event lands in its step: once the step before it is logged (a resumed run logs it again).
        wait_for(lambda: any(r["step"] == event["step"] - 1 for r in rows(output_dir)), driver,
                 f"step {event['step'] - 1} logged")
        act(event, driver)
        print(f"[bench] step {event['step']}: {event['kind']} (pid {event['pid']})", flush=True)
        if event["kind"] == "trainer":  # the next events wait for the resumed run's own rows
            wait_for(lambda: recovery(event, watch), driver, "the automatic resume", poll_s=0.2)
    code = driver.wait(timeout=WAIT_S)
    watch.stop()
    for event in events:
        event["recovery"] = recovery(event, watch)
    return summarise(output_dir, events, code, time.time() - started)


def summarise(output_dir: str, events: List[Dict[str, Any]], code: int, wall_s: float) -> Dict[str, Any]:
    """The chaos run's figures from its output folder and its events."""
    records = rows(output_dir)
    # The stopped run's rows after the resumed checkpoint, moved aside by the resume: they hold what
    # that run did (restarts included) before the training rank died.
    aside = sorted(n for n in os.listdir(output_dir) if ".after_step_" in n)
    earlier = [row for name in aside for row in rows(output_dir, name)]
    every = earlier + records
    step_s: Dict[int, Any] = {}
    for row in every:  # a step's first row: the one the event landed in
        step_s.setdefault(row["step"], row.get("time/step_s"))
    typical = statistics.median([s for step, s in step_s.items() if s and step not in {e["step"] for e in events}]
                                or [0.0])
    for event in events:
        if event["kind"] == "rollout" and event["step"] in step_s:
            event["step_s_above_median"] = (step_s[event["step"]] or 0.0) - typical
    counted = sorted({k for r in every for k in r if k.startswith("fault/")})
    return {"exit_code": code, "wall_s": wall_s, "events": events, "steps": [r["step"] for r in records],
            "restarts": {key: sum(r.get(key, 0) for r in every) for key in counted},
            "restarts_in_metrics_jsonl": {key: sum(r.get(key, 0) for r in records) for key in counted},
            "reward_worker_restarts": sum(r.get("reward/worker_restarts", 0) for r in every),
            "median_step_s": typical, "records": records, "output_dir": output_dir, "aside": aside}


def plain_run(args, folder: str, name: str = "baseline", extra: Sequence[str] = ()) -> Dict[str, Any]:
    """One run without chaos, to its end: `<folder>/<name>/` and `<folder>/<name>.log`."""
    output_dir, log_path = os.path.join(folder, name), os.path.join(folder, f"{name}.log")
    print(f"[bench] {name} run (no chaos); log {log_path}", flush=True)
    started = time.time()
    driver = start(args, output_dir, False, log_path, extra)
    code = driver.wait()
    return {"exit_code": code, "wall_s": time.time() - started, "records": rows(output_dir), "output_dir": output_dir,
            "log": log_path}


def comparable(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith(IGNORED) and k not in IGNORED_KEYS}


def weights_gap(chaos_dir: str, baseline_dir: str) -> Optional[float]:
    from safetensors.torch import load_file

    paths = [os.path.join(d, "final_model", "model.safetensors") for d in (chaos_dir, baseline_dir)]
    if not all(os.path.exists(p) for p in paths):
        return None
    got, want = (load_file(p) for p in paths)
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def validation(records: List[Dict[str, Any]]) -> Dict[str, float]:
    last = [r for r in records if "val/accuracy" in r]
    return {k: v for k, v in last[-1].items() if k.startswith("val/") and isinstance(v, float)} if last else {}


def report(args, chaos: Dict[str, Any], baseline: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    expected = [0] + list(range(1, args.steps + 1))  # step 0: the validation before training
    out: Dict[str, Any] = {
        "steps": args.steps, "exit_code": chaos["exit_code"], "wall_s": chaos["wall_s"],
        "steps_once_each": chaos["steps"] == expected, "missing": sorted(set(expected) - set(chaos["steps"])),
        "twice": sorted({s for s in chaos["steps"] if chaos["steps"].count(s) > 1}),
        "restarts": chaos["restarts"], "restarts_in_metrics_jsonl": chaos["restarts_in_metrics_jsonl"],
        "reward_worker_restarts": chaos["reward_worker_restarts"],
        "median_step_s": chaos["median_step_s"], "events": chaos["events"], "rows_moved_aside": chaos["aside"],
        "validation": validation(chaos["records"])}
    if baseline is not None:
        same = [comparable(a) == comparable(b) for a, b in zip(chaos["records"], baseline["records"])]
        out["baseline"] = {"exit_code": baseline["exit_code"], "wall_s": baseline["wall_s"],
                           "validation": validation(baseline["records"])}
        out["rows_equal_to_baseline"] = f"{sum(same)} of {len(baseline['records'])}"
        out["first_differing_step"] = next((r["step"] for r, ok in zip(chaos["records"], same) if not ok), None)
        out["final_weights_max_abs_gap"] = weights_gap(chaos["output_dir"], baseline["output_dir"])
    return out


def table(result: Dict[str, Any]) -> str:
    lines = [f"chaos run: exit {result['exit_code']}, {result['steps']} steps in {result['wall_s']:.0f} s; each step "
             f"once: {result['steps_once_each']} (missing {result['missing']}, twice {result['twice']}); restarts "
             f"counted {result['restarts']} ({result['restarts_in_metrics_jsonl']} in metrics.jsonl, the rest in the "
             f"rows a resume moved aside), reward/worker_restarts {result['reward_worker_restarts']}; median step "
             f"{fmt(result['median_step_s'], '.2f')} s",
             "", "| step | event | recovery |", "| --- | --- | --- |"]
    for event in result["events"]:
        got = event.get("recovery") or {}
        if event["kind"] == "rollout":
            what = (f"replacement {fmt(got.get('replacement_s'), '.1f')} s, step {fmt(event.get('step_s_above_median'), '.1f')}"
                    f" s above the median; {got.get('note', 'not seen in the log')}")
            kind = f"kill -9 vLLM rank ({event.get('while')})"
        elif event["kind"] == "reward_hang":
            what = f"{fmt(got.get('recovered_after_s'), '.1f')} s to the restarted worker ({got.get('note', 'not seen')})"
            kind = "SIGSTOP reward worker"
        else:
            what = (f"{fmt(got.get('recovered_after_s'), '.1f')} s to the resumed run (from step "
                    f"{got.get('resumed_at_step', '-')}: steps {got.get('resumed_at_step', 0) + 1}..{event['step']} "
                    f"computed again)")
            kind = "kill -9 training rank"
        lines.append(f"| {event['step']} | {kind} | {what} |")
    if "baseline" in result:
        lines += ["", f"uninterrupted run: exit {result['baseline']['exit_code']}, {result['baseline']['wall_s']:.0f} s; "
                      f"rows equal (time/fault aside): {result['rows_equal_to_baseline']}, first differing step "
                      f"{result['first_differing_step']}; final weights max |gap| "
                      f"{fmt(result['final_weights_max_abs_gap'], '.3g')}",
                  f"final validation, chaos: {fmt(result['validation'].get('val/accuracy'), '.4f')}, uninterrupted: "
                  f"{fmt(result['baseline']['validation'].get('val/accuracy'), '.4f')} (val/accuracy)"]
    return "\n".join(lines)


def reshape_cases(world_size: int, accumulation: int) -> Dict[str, List[str]]:
    """The resumes of a DeepSpeed checkpoint written by `world_size` ranks: label -> overrides.
    One rank accumulates `world_size` times as many micro-batches: the same number and size of
    mini-batches per step (their rows differ when there are several: each rank shuffles its own shard)."""
    return {f"1 rank (was {world_size}), accumulation x{world_size}": [
                "actor_train.world_size=1", f"actor_train.training_args.gradient_accumulation_steps="
                                            f"{accumulation * world_size}"],
            f"FSDP2, {world_size} ranks": ["actor_train.strategy_args.strategy_name=fsdp2_train",
                                           "actor_train.strategy_args.strategy_config=null"]}


def drift(uninterrupted: List[Dict[str, Any]], resumed: List[Dict[str, Any]], after_step: int,
          keys: Sequence[str] = DRIFT_KEYS) -> Dict[str, Any]:
    """Per step after `after_step` that both runs trained: `keys` resumed minus uninterrupted (None
    where either lacks the key), and per key the largest absolute gap over those steps.

    uninterrupted, resumed: metrics.jsonl rows (a step's rows merged, later keys winning)."""
    def by_step(records):
        merged: Dict[int, Dict[str, Any]] = {}
        for row in records:
            merged.setdefault(row["step"], {}).update(row)
        return merged

    want, got = by_step(uninterrupted), by_step(resumed)
    steps = sorted(step for step in set(want) & set(got) if step > after_step)
    per_step: Dict[int, Dict[str, Optional[float]]] = {
        step: {key: (got[step][key] - want[step][key]
                     if isinstance(got[step].get(key), (int, float))
                     and isinstance(want[step].get(key), (int, float)) else None) for key in keys}
        for step in steps}
    largest = {key: max((abs(gap) for gaps in per_step.values() if (gap := gaps[key]) is not None), default=None)
               for key in keys}
    return {"steps": steps, "per_step": per_step, "max_abs": largest}


def reshape_part(args, folder: str) -> Dict[str, Any]:
    """The uninterrupted run with its checkpoint, and each resume of a copy of it on another shape."""
    from roll_gspo.config import load_config
    from roll_gspo.lifecycle.reshape import role_shape

    save = args.reshape_save_step
    short = argparse.Namespace(**{**vars(args), "steps": save + RESHAPE_STEPS, "save_steps": save})
    trainer = load_config(args.config, list(args.override)).actor_train
    # A ZeRO-0 checkpoint (the example's stage) reshards only onto other ZeRO-0 rank counts: the
    # part's runs then train at ZeRO-2, whose checkpoint converts to every shape the cases resume on.
    stage = ["actor_train.strategy_args.strategy_config.zero_optimization.stage=2"] \
        if role_shape(trainer).zero_stage == 0 else []
    if stage:
        trainer = load_config(args.config, stage + list(args.override)).actor_train
    shape, accumulation, ranks = role_shape(trainer), trainer.training_args.gradient_accumulation_steps, trainer.world_size
    if shape.engine != "deepspeed" or ranks < 2:
        raise SystemExit(f"the reshape part resumes DeepSpeed on 2+ ranks; {args.config} trains with "
                         f"{shape.describe()} (pass --no-reshape)")
    base = plain_run(short, folder, "reshape_uninterrupted", stage)
    checkpoint = os.path.join(base["output_dir"], "checkpoints", f"step_{save}")
    out: Dict[str, Any] = {
        "save_step": save, "steps": short.steps,
        "shape": f"{shape.describe()}, gradient_accumulation_steps {accumulation}",
        "uninterrupted": {"exit_code": base["exit_code"], "wall_s": base["wall_s"],
                          "validation": validation(base["records"])},
        "resumes": {}}
    for index, (label, extra) in enumerate(reshape_cases(ranks, accumulation).items()):
        name = f"reshape_resume_{index}"
        copied = os.path.join(folder, name, "checkpoints", f"step_{save}")
        if os.path.isdir(checkpoint) and not os.path.isdir(copied):
            shutil.copytree(checkpoint, copied)  # its own copy: the conversion writes into the checkpoint
        run = plain_run(short, folder, name, [f"resume_from_checkpoint={copied}", *stage, *extra])
        with open(run["log"], errors="replace") as handle:
            decided = re.findall(r"resume: (actor_train: .*)", handle.read())
        out["resumes"][label] = {"exit_code": run["exit_code"], "wall_s": run["wall_s"], "overrides": extra,
                                 "decision": decided[0] if decided else None,
                                 "validation": validation(run["records"]),
                                 "gap": drift(base["records"], run["records"], save)}
    return out


def reshape_table(result: Dict[str, Any]) -> str:
    base = result["uninterrupted"]
    lines = [f"reshape: uninterrupted {result['steps']} steps ({result['shape']}), checkpoint at step "
             f"{result['save_step']}: exit {base['exit_code']}, {base['wall_s']:.0f} s, final val/accuracy "
             f"{fmt(base['validation'].get('val/accuracy'), '.4f')}; each resume below: resumed - uninterrupted",
             "", "| resume | step | " + " | ".join(DRIFT_KEYS) + " |", "| --- | --- |" + " --- |" * len(DRIFT_KEYS)]
    for label, run in result["resumes"].items():
        gap = run["gap"]
        for step in gap["steps"]:
            lines.append(f"| {label} | {step} | " + " | ".join(fmt(gap["per_step"][step][k], '+.3g')
                                                             for k in DRIFT_KEYS) + " |")
        lines.append(f"| {label} | max abs | " + " | ".join(fmt(gap["max_abs"][k], '.3g') for k in DRIFT_KEYS) + " |")
    lines.append("")
    for label, run in result["resumes"].items():
        lines.append(f"{label}: exit {run['exit_code']}, {run['wall_s']:.0f} s, final val/accuracy "
                     f"{fmt(run['validation'].get('val/accuracy'), '.4f')}; {run['decision'] or 'no resume line'}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="example_gspo.yaml")
    parser.add_argument("--model", default=None, help="pretrain override (a model folder or builtin:NAME)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kills", type=int, default=5, help="kill -9 of the vLLM rank, each at another step")
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--reward-timeout", type=float, default=20.0, help="fault_tolerance.reward_timeout_s")
    parser.add_argument("--no-reward-hang", action="store_true")
    parser.add_argument("--no-trainer-kill", action="store_true")
    parser.add_argument("--no-baseline", action="store_true", help="skip the uninterrupted run")
    parser.add_argument("--reshape", action=argparse.BooleanOptionalAction, default=True,
                        help="then resume a checkpoint on 1 rank and under FSDP2 against an uninterrupted run "
                             "(3 more runs; --no-reshape skips them)")
    parser.add_argument("--reshape-save-step", type=int, default=2,
                        help="the reshape part's checkpoint; its runs end 5 steps later")
    parser.add_argument("--seed", type=int, default=0, help="draws the events' steps")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override for every run")
    parser.add_argument("--folder", default=None, help="where the runs go (default: a temporary folder, kept)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    folder = args.folder or tempfile.mkdtemp(prefix="bench_chaos_")
    os.makedirs(folder, exist_ok=True)
    chaos = chaos_run(args, folder)
    baseline = None if args.no_baseline else plain_run(args, folder)
    result = report(args, chaos, baseline)
    text = table(result)
    if args.reshape:
        result["reshape"] = reshape_part(args, folder)
        text += "\n\n" + reshape_table(result["reshape"])
    print_report(text, result, args.json)
    reshaped = [result["reshape"]["uninterrupted"], *result["reshape"]["resumes"].values()] if "reshape" in result else []
    ok = result["exit_code"] == 0 and result["steps_once_each"] and all(run["exit_code"] == 0 for run in reshaped)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
