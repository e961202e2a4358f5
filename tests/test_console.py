"""The console: one line per record whatever the terminal width or when piped; third-party
FutureWarnings kept out of it and in the run's log folder."""
import os
import subprocess
import sys

from roll_gspo.metrics.recorder import MetricsTracker
from tests.conftest import REPO_ROOT

SCRIPT = """
import logging, warnings
from roll_gspo.utils.logging import setup_logging, use_log_dir
setup_logging()
use_log_dir({log_dir!r})
logging.getLogger("roll_gspo").info("step 1/2 | " + " | ".join(f"metric_{{i}} {{i}}.25" for i in range(40)))
warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
warnings.warn("a warning the user should see", UserWarning)
"""


def test_step_line_is_one_line_at_any_width_and_future_warnings_go_to_the_log_file(tmp_path):
    for columns in ("20", "300"):
        out = subprocess.run([sys.executable, "-c", SCRIPT.format(log_dir=str(tmp_path / columns))],
                             cwd=REPO_ROOT, env={**os.environ, "COLUMNS": columns, "PYTHONPATH": str(REPO_ROOT)},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = out.stderr.splitlines()
        step = [line for line in lines if "step 1/2" in line]
        assert len(step) == 1 and step[0].endswith("metric_39 39.25"), lines
        assert "FutureWarning" not in out.stderr and "a warning the user should see" in out.stderr
        logged = "".join(open(os.path.join(tmp_path / columns, name)).read() for name in os.listdir(tmp_path / columns))
        assert "FutureWarning" in logged and "metric_39 39.25" in logged


def test_console_line_names_reward():
    line = MetricsTracker.console_line(3, 10, {"reward/mean": 0.5, "val/accuracy": 0.25, "actor/clipfrac": 0.1})
    assert line == "step 3/10 | reward 0.5 | val_acc 0.25 | clipfrac 0.1"
