"""What moving a ROLL YAML here means, key by key: `python -m roll_gspo.config.load.roll_check FILE.yaml
[overrides...]`, run from the folder ROLL would run the file from.

Every key the file writes is put in one of four groups:

* refused: the loader, the validation or the preflight refuses it (a `Finding` with its key; the
  reason printed);
* ignored as in ROLL: ROLL's recipes set it although ROLL ignores it in this pipeline; the load
  accepts it with a notice about that key, which the report quotes;
* acts differently: it acts, with a difference from ROLL worth knowing (`roll_keys.ROLL_KEY_NOTES`),
  or it is a GPU-only setting of a role that runs on CPUs, replaced by what runs there (its
  `notice: on CPU, ...`, roll_gspo.config.plan.cpu_run);
* acts: it acts as in ROLL.

The checks stop at the first stage that fails (unknown keys and types, then ROLL's semantics,
then validation, then files and models), so a key listed as acting may still be refused by a
later stage once the earlier refusals are fixed: the report says when that is possible.
"""
from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from roll_gspo.config.errors import ConfigError
from roll_gspo.config.findings import Finding
from roll_gspo.config.roll.roll_keys import ROLL_KEY_NOTES

ROLE_NAMES = ("actor_train", "actor_infer", "reference", "critic", "validation")
# ROLL_KEY_NOTES entries that document a key for the reference table without a difference from
# ROLL: such keys act as in ROLL. (A refused value of them is refused by the checks anyway.)
SAME_AS_ROLL = ("<role>.data_args.domain_interleave_probs", "<role>.strategy_args.strategy_name",
                "rewards.<domain>.reward_type", "rewards.<domain>.response_length_penalty_coef",
                "rewards.<domain>.use_local", "rewards.<domain>.judge_prompt", "rewards.<domain>.judge_model_type",
                "rewards.<domain>.query_filter_config")


@dataclass
class RollReport:
    """The four groups, each key path -> its detail (reason, note or value)."""
    path: str
    refused: Dict[str, str] = field(default_factory=dict)
    ignored: Dict[str, str] = field(default_factory=dict)
    differs: Dict[str, str] = field(default_factory=dict)
    acts: List[str] = field(default_factory=list)
    other_problems: List[str] = field(default_factory=list)  # errors naming no key of the file
    complete: bool = True  # False: a stage failed, later stages did not run

    def text(self) -> str:
        total = len(self.refused) + len(self.ignored) + len(self.differs) + len(self.acts)
        lines = [f"ROLL compatibility of {self.path}: {total} keys: {len(self.acts)} act, {len(self.differs)} act "
                 f"differently, {len(self.ignored)} ignored as in ROLL, {len(self.refused)} refused"
                 + ("" if not self.other_problems else f", {len(self.other_problems)} other problems")]
        for title, group in (("refused (why)", self.refused), ("ignored as in ROLL (what acts instead)", self.ignored),
                             ("acts differently (how)", self.differs)):
            if group:
                lines += ["", f"{title}:"] + [f"  {key}: {detail}" for key, detail in group.items()]
        if self.other_problems:
            lines += ["", "other problems:"] + [f"  {problem}" for problem in self.other_problems]
        if self.acts:
            lines += ["", "acts as in ROLL:"] + textwrap.wrap(", ".join(self.acts), 100, initial_indent="  ",
                                                             subsequent_indent="  ", break_on_hyphens=False)
        if not self.complete:
            lines += ["", "The checks stopped at the first failing stage: fix the refused keys and run again, "
                          "a later stage may refuse more."]
        else:
            lines += ["", "The file passes every check (`--dry-run` also plans placement and memory)."]
        return "\n".join(lines)


def generic_key(path: str) -> str:
    """`actor_infer.model_args.dtype` -> `<role>.model_args.dtype`; `rewards.math.x` -> `rewards.<domain>.x`."""
    parts = path.split(".")
    if parts[0] in ROLE_NAMES:
        parts[0] = "<role>"
    elif parts[0] == "rewards" and len(parts) > 1:
        parts[1] = "<domain>"
    return ".".join(parts)


def _expanded_notes() -> Dict[str, Optional[str]]:
    """ROLL_KEY_NOTES with its `a.b.c / d / e` entries split into one key each (siblings of `a.b.c`)."""
    notes: Dict[str, Optional[str]] = {}
    for entry, note in ROLL_KEY_NOTES.items():
        names = [name.strip() for name in entry.split(" / ")]
        parent = names[0].rpartition(".")[0]
        for index, name in enumerate(names):
            notes[name if index == 0 or "." in name or not parent else f"{parent}.{name}"] = note
    return notes


def note_for(path: str, notes: Dict[str, Optional[str]]) -> Optional[str]:
    """The note of the closest ROLL_KEY_NOTES entry at or above `path` (None: acts as in ROLL)."""
    parts = generic_key(path).split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in notes:
            return None if key in SAME_AS_ROLL else notes[key]
    return None


def _worker_mapping(path: str, raw_cfg) -> Optional[str]:
    """For `rewards.<domain>.worker_cls` naming a ROLL class: the worker that runs it here."""
    from roll_gspo.config.roll.roll_compat import ROLL_REWARD_WORKERS

    if generic_key(path) != "rewards.<domain>.worker_cls":
        return None
    value = raw_cfg.rewards[path.split(".")[1]].worker_cls
    mapped = ROLL_REWARD_WORKERS.get(value)
    return f"ROLL's {value.rpartition('.')[2]} runs as {mapped}" if mapped else None


def _leaf_paths(raw_cfg) -> List[str]:
    """Dotted paths of the leaves the YAML writes (a list or an empty block counts as one leaf)."""
    from omegaconf import OmegaConf

    leaves: List[str] = []

    def visit(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                visit(value, f"{prefix}.{key}" if prefix else str(key))
        elif prefix:
            leaves.append(prefix)

    visit(OmegaConf.to_container(raw_cfg, resolve=False), "")
    return leaves


def written_key(key: str, keys: Sequence[str]) -> Optional[str]:
    """The written key a finding about `key` belongs to: `key` itself or the first written key under
    it, else the same for the closest block above it (list items count as their list); None when
    the file writes nothing there."""
    path = re.sub(r"\[\d+\]", "", key)
    while path:
        under = [k for k in keys if k == path or k.startswith(path + ".")]
        if under:
            return under[0]
        path = path.rpartition(".")[0]
    return None


def roll_report(config: str, overrides: Sequence[str] = (), cpu_host: Optional[bool] = False) -> RollReport:
    """Load `config` as `run_pipeline.py` would (validation and preflight included) and sort every
    key it writes into the report's groups. `cpu_host`: as `load_config`'s (None: a config with GPU
    placement, checked on a machine without a GPU, is checked as the CPU run it would be here)."""
    from roll_gspo.config.plan.cpu_run import SOURCE as CPU_RUN
    from roll_gspo.config.load.loader import apply_overrides, compose_yaml, load_config_findings, resolve_config_path
    from roll_gspo.config.checks.preflight import preflight

    path = resolve_config_path(config)
    raw_cfg = compose_yaml(path)
    apply_overrides(raw_cfg, overrides)
    keys = _leaf_paths(raw_cfg)
    report = RollReport(str(path))
    findings: List[Finding] = []
    try:
        cfg, findings = load_config_findings(config, overrides, cpu_host=cpu_host)
        preflight(cfg)
    except ConfigError as exc:
        findings += exc.notices + exc.findings
        report.complete = False
    for finding in findings:
        if finding.level != "error":
            continue
        owner = written_key(finding.key, keys) if finding.key else None
        if owner is None:
            report.other_problems.append(finding.text)
        else:
            previous = report.refused.get(owner)
            report.refused[owner] = finding.text if previous is None else f"{previous}; {finding.text}"
    ignored = {f.key: f.body for f in findings if f.level == "notice" and f.source != CPU_RUN and f.key in keys}
    notes = _expanded_notes()
    # key -> what runs there instead (GPU-only settings of roles that run on CPUs)
    on_cpu = {f.key: f.message for f in findings if f.source == CPU_RUN}
    for key in keys:
        if key in report.refused:
            continue
        if any(key.startswith(k + ".") or k.startswith(key + ".") for k in report.refused):
            report.refused.setdefault(key, "see the refusal of its block above")
            continue
        if key in on_cpu:
            report.differs[key] = on_cpu[key]
            continue
        if key in ignored:  # the load accepted it and said what acts instead
            report.ignored[key] = ignored[key]
            continue
        note = _worker_mapping(key, raw_cfg) or note_for(key, notes)
        if note:
            report.differs[key] = note
        else:
            report.acts.append(key)
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roll_gspo.config.load.roll_check",
                                     description="Every key of a ROLL YAML: acts, acts differently (how), "
                                                 "ignored as in ROLL, or refused (why).")
    parser.add_argument("config", help="the ROLL YAML (run from the folder ROLL would run it from)")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, as run_pipeline.py takes them")
    args = parser.parse_args(argv)
    report = roll_report(args.config, args.overrides, cpu_host=None)
    print(report.text())
    return 0 if report.complete else 1


if __name__ == "__main__":
    sys.exit(main())
