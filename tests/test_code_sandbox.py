"""Code sandbox reward: correct / wrong / partial solutions, stdin cases, and hostile code
(infinite loop, fork bomb, 10 GB, writing outside its folder, a socket, the worker's secrets),
with bubblewrap and with the rlimits + unshare fallback."""
import json
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest

from roll_gspo.rewards.code_sandbox import Sandbox, code_outcome, extract_code, parse_tests, run_tests

ADD_TESTS = json.dumps({"case_type": "assert", "test_cases": [
    {"assert_code": "assert add(1, 2) == 3"}, {"assert_code": "assert add(-1, 1) == 0"},
    {"assert_code": "def test_big():\n    assert add(10**12, 1) == 10**12 + 1"},
    {"assert_code": "assert add(0, 0) == 0"}]})
SUM_STDIN = json.dumps({"case_type": "input", "test_cases": [
    {"stdin": "1 2\n", "expected_stdout": "3\n"}, {"stdin": "5 5\n", "expected_stdout": "10"}]})
ONE_TEST = json.dumps(["assert add(1, 2) == 3"])
KINDS = [pytest.param("bwrap", marks=pytest.mark.skipif(not shutil.which("bwrap"), reason="bubblewrap not installed "
                                                                                           "(apt-get install bubblewrap)")),
         "rlimits"]


@pytest.fixture(scope="module", params=KINDS)
def sandbox(request):
    return Sandbox(request.param, timeout_s=1.0, memory_mb=512, max_processes=16)


def test_extract_and_parse():
    assert extract_code("<think>```python\nx=1\n```</think>text\n```python\ndef f():\n    return 2\n```\nbye") == \
        "def f():\n    return 2\n"
    assert extract_code("def f(): return 1") == "def f(): return 1"
    assert parse_tests(["assert f() == 1"]) == ("assert", [{"assert_code": "assert f() == 1"}])
    assert parse_tests({"case_type": "stdin", "test_cases": [{"input": "1", "output": "2"}]}) == \
        ("input", [{"stdin": "1", "expected_stdout": "2"}])
    for bad in ('{"case_type": "sql", "test_cases": ["x"]}', '{"test_cases": []}', '{"x": 1}', "not json"):
        with pytest.raises(ValueError):
            parse_tests(bad)


@pytest.mark.parametrize("code,soft,hard", [
    ("```python\ndef add(a, b):\n    return a + b\n```", 1.0, 1.0),
    ("def add(a, b):\n    return a - b", 0.25, 0.0),          # only 0 + 0 passes
    ("def add(a, b):\n    return a + b if a < 100 else 0", 0.75, 0.0),
    ("I do not know.", 0.0, 0.0),
])
def test_assert_solutions(sandbox, code, soft, hard):
    results = run_tests(sandbox, code, ADD_TESTS)
    assert code_outcome(results, "soft")[:2] == (soft, "ok")
    assert code_outcome(results, "hard")[:2] == (hard, "ok")


def test_stdin_solutions(sandbox):
    right = "a, b = map(int, input().split())\nprint(a + b)\nimport sys; sys.exit(0)"
    assert code_outcome(run_tests(sandbox, right, SUM_STDIN), "soft")[:2] == (1.0, "ok")
    wrong = "a, b = map(int, input().split())\nprint(a * b)"
    assert code_outcome(run_tests(sandbox, wrong, SUM_STDIN), "soft")[:2] == (0.0, "ok")


HOSTILE = {
    "infinite_loop": ("while True:\n    pass", "timeout"),
    "sleeps_forever": ("import time\ntime.sleep(1000)", "timeout"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "error"),
    "allocates_10gb": ("x = bytearray(10 * 1024 ** 3)", "error"),
    "writes_outside": ("open(%r, 'w').write('owned')", "error"),
    "opens_socket": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", "error"),
    # Looks for the worker's secret everywhere it could: its environment and every /proc/*/environ.
    "reads_env": ("import glob, os\nfound = [os.environ.get('ROLL_SECRET_TOKEN', '')]\n"
                  "for p in glob.glob('/proc/*/environ'):\n    try:\n        found.append(open(p, 'rb').read().decode('latin1'))\n"
                  "    except OSError:\n        pass\nassert 'sk-hush' in ''.join(found)", "ok"),
    "exits_early": ("import os\nos._exit(0)", "ok"),
}


def _outside_target():
    """A file the test process may write and a contained program must not: never under /tmp, where
    bubblewrap's private /tmp would make the write miss instead of being refused (a clone in /tmp)."""
    for folder in (Path.home(), Path(__file__).resolve().parent):
        if not str(folder.resolve()).startswith("/tmp") and os.access(folder, os.W_OK):
            return folder / f".sandbox_probe_{os.getpid()}"
    pytest.skip("no writable folder outside /tmp to aim the hostile write at")


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_is_contained(sandbox, name, monkeypatch):
    monkeypatch.setenv("ROLL_SECRET_TOKEN", "sk-hush")
    outside = _outside_target()
    code, status = HOSTILE[name]
    if name == "writes_outside":
        code = code % str(outside)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    score, got_status, message = code_outcome(run_tests(sandbox, code, ONE_TEST), "soft")
    written = outside.exists()
    outside.unlink(missing_ok=True)
    assert (score, got_status) == (0.0, status), message
    assert not written
    assert [p for p in me.children(recursive=True) if p.pid not in before] == []  # nothing left running
    if os.geteuid() == 0:  # programs run under the sandbox's own uid: none may remain (zombies are dead)
        assert _live_processes_of(sandbox.uid) == []


def _live_processes_of(uid, wait_s=3.0):
    deadline = time.monotonic() + wait_s
    while True:
        live = [p for p in psutil.process_iter(["uids", "status"])
                if p.info["uids"] and p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.1)


def test_worker_scores_a_batch(tmp_path):
    from roll_gspo.workers.rewards import CodeSandboxRewardWorker
    from tests.test_reward_workers import batch_of, make_worker

    worker = make_worker(CodeSandboxRewardWorker, reward_type="soft", timeout_s=2.0)
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    two = json.dumps(["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
    out = worker.compute_scores(batch_of(["p"] * 3, [good, "def add(a, b): return 0", good], [two, two, "{broken"]))
    assert out["scores"].tolist() == [1.0, 0.5, 0.0]
    assert out["reward_status"] == ["ok", "ok", "error"] and out["reward_correct"] == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="local sandbox"):
        make_worker(CodeSandboxRewardWorker, use_local=False, code_url="http://x")


def test_builtin_code_task_is_solvable(tmp_path):
    from roll_gspo import builtin

    folder = builtin.write_builtin_task("code", str(tmp_path / "code"), n_train=6, n_val=2)
    rows = [json.loads(line) for line in open(os.path.join(folder, "train.jsonl"))]
    sandbox = Sandbox("auto", timeout_s=2.0)
    for row in rows[:3]:
        assert row["prompt"].endswith("def f(x): return ") and row["domain"] == "code_sandbox"
        assert code_outcome(run_tests(sandbox, row["solution"], row["ground_truth"]), "hard")[:2] == (1.0, "ok")
        assert code_outcome(run_tests(sandbox, "0", row["ground_truth"]), "hard")[0] in (0.0, 1.0)
    mixed = builtin.write_builtin_task("mixed", str(tmp_path / "mixed"), n_train=9, n_val=3)
    domains = {json.loads(line)["domain"] for line in open(os.path.join(mixed, "train.jsonl"))}
    assert domains == {"math_rule", "code_sandbox", "multiple_choice"}
