"""The driver checks actor_infer's vLLM engine keys without importing vLLM (~6 s of every run's and
every --dry-run's start on 2 cores): EngineArgs' field names are cached per vLLM install."""
import dataclasses
import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

CHECK = """
import sys
from roll_gspo.config.checks.preflight import vllm_engine_fields
fields = vllm_engine_fields()
print(len(fields), "vllm" in sys.modules)
"""


def test_engine_fields_are_vllms_and_a_cached_read_does_not_import_vllm(tmp_path, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from roll_gspo.config.checks.preflight import VLLM_FIELDS_FILE, vllm_engine_fields

    monkeypatch.setenv("ROLL_GSPO_CACHE", str(tmp_path))
    want = {f.name for f in dataclasses.fields(EngineArgs)}
    assert vllm_engine_fields() == want  # read from vLLM, then kept
    cached = tmp_path / VLLM_FIELDS_FILE
    assert set(json.loads(cached.read_text())["fields"]) == want
    env = {**os.environ, "ROLL_GSPO_CACHE": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(len(want)), "False"]  # the cache answered; vLLM was not imported
    # A cache written for another vLLM (its arg_utils.py changed) is read again from vLLM.
    data = json.loads(cached.read_text())
    data["key"]["mtime_ns"] -= 1
    data["fields"] = ["stale"]
    cached.write_text(json.dumps(data))
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == [str(len(want)), "True"], out.stderr[-2000:]
    assert set(json.loads(cached.read_text())["fields"]) == want
