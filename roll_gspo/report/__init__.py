"""The run report: one self-contained HTML page of a run folder (curves, a phase timeline with
stalls marked, a sample browser over the recorded rollouts, warnings), built from the files alone.

`write_report(output_dir, others=(), path=None)` writes it; `python -m roll_gspo.report <output_dir>`
is the command; `find_stalls` and `run_warnings` are pure and shared with the running pipeline.
Torch-free and Ray-free: it reads metrics.jsonl and rollouts/ only (docs/report.md)."""
from roll_gspo.report.checks import find_stalls, run_warnings
from roll_gspo.report.files import NotARunFolder
from roll_gspo.report.page import REPORT_FILE, report_data, write_report

__all__ = ["NotARunFolder", "REPORT_FILE", "find_stalls", "report_data", "run_warnings", "write_report"]
