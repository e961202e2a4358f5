"""Run a program against a row's tests in a sandbox on this machine (the code reward and the
agents' python tool both run here; taking the code out of a response is the reward's part).

Ground truth of a code row (JSON text or a dict), in ROLL's field names::

    {"case_type": "assert", "test_cases": [{"assert_code": "assert add(1, 2) == 3"}, ...]}
    {"case_type": "input",  "test_cases": [{"stdin": "1 2\\n", "expected_stdout": "3\\n"}, ...]}

(`assert_code` may define `test_*` functions, which are then called; a bare list of assert
strings is read as `assert`; `pytest` is read as `assert`; `stdin`/`io` as `input`. An optional
`"prefix"` is put before the response's code: completion tasks whose prompt holds the `def`
line, HumanEval-style.)

Each test runs in a fresh sandbox: this interpreter with a CPU-time limit, an address-space
limit, a file-size limit, a process-count limit (under a uid of its own when the worker is root,
so other sandboxes' processes do not count), an empty environment, no network, new PID, IPC and
UTS namespaces (killing the sandbox kills everything in it), a read-only view of the system, and
a private, size-bounded /tmp (its working folder) and /dev/shm: `max_write_mb` each, in memory,
gone with the sandbox, so the host's /tmp and /dev/shm never hold anything of it and a program
that writes more fails (ENOSPC: `blocked`). Two ways to build it:

* ``bwrap`` (bubblewrap >= 0.8, Debian package `bubblewrap`): mounts its tmpfs folders and
  namespaces itself. Chosen over nsjail because it is a small, widely packaged tool (Flatpak's)
  that works unprivileged.
* ``rlimits``: `unshare` (util-linux) for the namespaces, a user namespace as well when the worker
  is not root; the harness then remounts every mount read-only in its mount namespace and mounts
  the two tmpfs folders itself, and drops to the sandbox's uid (root) or drops every capability
  (user namespace).

The verdict is never the program's to give (`sandbox_harness` has the details): an input test
passes when the program's stdout equals the expected one, which never enters the sandbox; an
assert test runs in a judge process that forks the program's process before it reads the test,
calls the program's functions there and gets plain data back, and compares in its own
interpreter, with its own builtins. So these score as failures: printing a pass token found by
walking stack frames or `gc` (there is none), an object whose `__eq__` always answers True,
`os._exit(0)` or `sys.exit(0)` before or during the test, patching builtins, `math` or
`AssertionError`, skipping asserts with `sys.settrace`, reading the test's expected values, and
printing a fake verdict.

What stays open (docs/data_and_rewards.md#code-sandbox has the list and the reasons): a
comparison between two of the program's own objects uses the program's `__eq__` (a test that
compares a result with an instance of a class the program defines, e.g. a `ListNode` from the
prompt, trusts that class); a test that passes its own functions or class instances to the
program fails (only plain data, standard-library values and the program's own objects cross); a
result of a class other than the plain and a few standard-library ones is a reference
(`isinstance(result, tuple)` is false for a namedtuple, though it compares as its tuple); the
program may use its CPU, memory and write budgets in full.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from roll_gspo.sandbox.sandbox_harness import (EXIT_BLOCKED, EXIT_CRASHED, EXIT_EXITED, EXIT_FAILED,
                                               VERDICTS, folders_between)

SANDBOX_KINDS = ("auto", "bwrap", "rlimits")
# The in-sandbox half, passed as `python -c` text: the sandbox may not see this checkout (a clone
# under /tmp is hidden by the private /tmp).
HARNESS_SOURCE = Path(__file__).with_name("sandbox_harness.py").read_text(encoding="utf-8")
# Other users' files, hidden behind a small read-only tmpfs (the interpreter is bound back in).
_HIDDEN_FOLDERS = ("/root", "/home", "/run", "/var/tmp")
_HIDDEN_FOLDERS_BYTES = 1 << 20


def _spec(ground_truth: Any) -> dict:
    spec = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if isinstance(spec, list):
        spec = {"case_type": "assert", "test_cases": spec}
    return spec


def parse_tests(ground_truth: Any) -> Tuple[str, List[Dict[str, str]]]:
    """``(kind, cases)`` with kind ``assert`` (cases ``{"assert_code"}``) or ``input`` (cases
    ``{"stdin", "expected_stdout"}``); ValueError naming what is wrong."""
    spec = _spec(ground_truth)
    if not isinstance(spec, dict) or "test_cases" not in spec:
        raise ValueError("code ground truth must be {'case_type': ..., 'test_cases': [...]} or a list of asserts")
    kind = str(spec.get("case_type") or "assert").lower()
    kind = {"pytest": "assert", "stdin": "input", "io": "input", "stdin_stdout": "input"}.get(kind, kind)
    if kind not in ("assert", "input"):
        raise ValueError(f"code ground truth: case_type {spec.get('case_type')!r} is not assert/pytest or input/stdin")
    cases = spec["test_cases"]
    if isinstance(cases, str):
        cases = json.loads(cases)
    out = []
    for case in cases:
        if kind == "assert":
            code = case if isinstance(case, str) else case.get("assert_code")
            if not isinstance(code, str):
                raise ValueError(f"code ground truth: assert case without 'assert_code': {case!r:.80}")
            out.append({"assert_code": code})
        else:
            stdin = case.get("stdin", case.get("input"))
            expected = case.get("expected_stdout", case.get("output"))
            if stdin is None or expected is None:
                raise ValueError(f"code ground truth: input case needs 'stdin' and 'expected_stdout': {case!r:.80}")
            out.append({"stdin": str(stdin), "expected_stdout": str(expected)})
    if not out:
        raise ValueError("code ground truth has no test cases")
    return kind, out


def _same_output(got: str, expected: str) -> bool:
    def norm(text: str) -> List[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


@dataclass
class ProgramResult:
    verdict: str  # passed | failed | crashed | blocked | timeout | killed
    detail: str = ""
    stdout: str = ""  # what an input-kind program printed (the agentic Python tool shows it)


class Sandbox:
    """Runs programs with limits; one per reward worker (programs may run at once)."""

    def __init__(self, kind: str = "auto", *, timeout_s: float = 10.0, memory_mb: int = 512,
                 max_processes: int = 16, max_file_mb: int = 16, max_write_mb: int = 64,
                 python: Optional[str] = None, site_packages: bool = False):
        if kind not in SANDBOX_KINDS:
            raise ValueError(f"sandbox {kind!r}: valid are {SANDBOX_KINDS}")
        self.bwrap = shutil.which("bwrap")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.max_processes, self.max_file_mb = int(max_processes), int(max_file_mb)
        self.max_write_mb = int(max_write_mb)
        # Without site-packages the base interpreter serves, wherever the venv lives: a venv under
        # /tmp (a CI clone) is hidden by the private /tmp.
        self.python = python or (sys.executable if site_packages else
                                 os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
        # Without site-packages (`-S`) an interpreter starts ~3x faster here; tests needing
        # third-party modules turn them on.
        self.python_flags = ["-I"] if site_packages else ["-I", "-S"]
        self.is_root = os.geteuid() == 0
        # A uid of this worker's own (root only): the process-count limit then counts only its
        # programs, and the program owns nothing outside its sandbox.
        self.uid = 100000 + os.getpid() if self.is_root else os.getuid()
        self.kind = "bwrap" if kind == "auto" else kind
        if self.kind == "bwrap" and not (self.bwrap and self._works()):
            if kind == "bwrap":
                raise RuntimeError("sandbox: bwrap (bubblewrap >= 0.8) is not installed or cannot run here "
                                   "(Debian/Ubuntu: apt-get install bubblewrap); or set sandbox: rlimits")
            self.kind = "rlimits"
        if self.kind == "rlimits" and not (shutil.which("unshare") and self._works()):
            raise RuntimeError("sandbox rlimits: `unshare` cannot create mount and network namespaces here "
                               "(needs root, or unprivileged user namespaces); install bubblewrap or run as root")

    def _works(self) -> bool:
        """Whether a program passes a test in this kind of sandbox here."""
        try:
            return self.run("def one():\n    return 1", test="assert one() == 1").verdict == "passed"
        except OSError:
            return False

    # -- command lines ---------------------------------------------------------------------------
    def _command(self, settings: Dict[str, Any]) -> List[str]:
        harness = [self.python, *self.python_flags, "-c", HARNESS_SOURCE, json.dumps(settings)]
        if self.kind == "bwrap":
            size = str(self.max_write_mb << 20)
            cmd = [self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                   "--remount-ro", "/dev",  # bwrap's /dev is a tmpfs: unprivileged, it would be writable
                   "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
                   "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
            for hidden in _HIDDEN_FOLDERS:
                if os.path.isdir(hidden):  # other users' files; the interpreter is bound back in
                    cmd += ["--size", str(_HIDDEN_FOLDERS_BYTES), "--tmpfs", hidden]
                    for path in _python_dirs(self.python, hidden):
                        # bwrap would make the folders leading to it 0700: the sandbox uid could
                        # not reach its own interpreter.
                        for parent in folders_between(hidden, path):
                            cmd += ["--perms", "0755", "--dir", parent]
                        cmd += ["--ro-bind", path, path]
                    cmd += ["--remount-ro", hidden]
            # No --new-session: the judge must stay in the process group this worker kills (a
            # parent-death signal does not reach a process that changed its uid); _limits' setsid
            # already leaves the sandbox without a controlling terminal to inject keystrokes into.
            cmd += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                    "--die-with-parent", "--as-pid-1", "--hostname", "sandbox", "--chdir", "/tmp"]
            # Root: bwrap keeps only the caps the harness needs to switch to the sandbox uid.
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if self.is_root else ["--unshare-user"]
            return cmd + ["--"] + harness
        # The harness builds the private filesystem in the mount namespace unshare gives it.
        return ["unshare", *([] if self.is_root else ["-r"]), "--mount", "--net", "--pid", "--ipc", "--uts",
                "--fork", "--kill-child", "--mount-proc", "--"] + harness

    def _settings(self, kind: str, program_fd: int, test_fd: int) -> Dict[str, Any]:
        size = self.max_write_mb << 20
        private = None
        if self.kind == "rlimits":  # what bwrap's arguments do, done by the harness
            hidden = [folder for folder in _HIDDEN_FOLDERS if os.path.isdir(folder)]
            private = {"tmpfs": [["/tmp", size], ["/dev/shm", size]], "hidden": hidden,
                       "keep": [path for folder in hidden for path in _python_dirs(self.python, folder)]}
        return {"kind": kind, "program_fd": program_fd, "tests_fd": test_fd, "workdir": "/tmp",
                "private_filesystem": private, "drop": {"uid": self.uid if self.is_root else None}}

    def _limits(self) -> None:
        """In the child before exec: its own session (killed as a group) and the rlimits."""
        os.setsid()
        cpu = max(1, int(self.timeout_s + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        size = self.max_file_mb * 1024 * 1024  # also bounds what reaches this worker on stdout/stderr
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # Counts the tasks of the program's uid: its own uid when root; otherwise ours, so add
        # what already runs under it.
        base = 0 if self.is_root else _tasks_of_uid(os.getuid())
        nproc = base + self.max_processes + 4  # + the judge and the wrapper processes
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    def _env(self) -> Dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
                "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1"}

    # -- running ---------------------------------------------------------------------------------
    def run(self, source: str, *, kind: str = "assert", test: str = "", stdin: str = "",
            expected_stdout: Optional[str] = None) -> ProgramResult:
        """Run one program: ``kind`` assert (pass = ``test`` completes against it) or input (pass =
        its stdout on ``stdin`` matches ``expected_stdout``). Everything reaches the sandbox through
        unlinked files: nothing is left on this machine's disk."""
        with _unlinked_file(source) as program_file, _unlinked_file(json.dumps({"test": test})) as test_file, \
                _unlinked_file(stdin) as stdin_file, _unlinked_file("") as stdout_file, \
                _unlinked_file("") as stderr_file:
            settings = self._settings(kind, program_file.fileno(), test_file.fileno())
            proc = subprocess.Popen(self._command(settings), cwd="/", env=self._env(), stdin=stdin_file,
                                    stdout=stdout_file, stderr=stderr_file, preexec_fn=self._limits,
                                    pass_fds=(program_file.fileno(), test_file.fileno()))
            try:
                proc.wait(timeout=self.timeout_s + 1.0)
            except subprocess.TimeoutExpired:
                return ProgramResult("timeout", f"exceeded {self.timeout_s:g}s")
            finally:
                _kill_group(proc)  # nothing it started outlives it (namespaces do the rest)
            stdout = _read_back(stdout_file, self.max_file_mb << 20)
            tail = _read_back(stderr_file, self.max_file_mb << 20)[-300:]
        result = _result(kind, proc.returncode, stdout, tail, expected_stdout)
        if kind == "input":  # an assert run's stdout is the judge's verdict line, not the program's
            result.stdout = stdout
        return result


def _result(kind: str, code: int, stdout: str, tail: str, expected_stdout: Optional[str]) -> ProgramResult:
    """The verdict from how the sandbox ended: the judge's verdict line (assert tests), the
    program's output (input tests), else its exit."""
    if kind == "assert" and code == 0:
        verdict = _verdict_line(stdout)
        if verdict is not None:
            return verdict
        return ProgramResult("crashed", f"no verdict from the judge: {tail}")
    if kind == "input" and code == 0:
        if expected_stdout is None or _same_output(stdout, expected_stdout):
            return ProgramResult("passed")
        return ProgramResult("failed", "wrong output")
    # The judge is PID 1 of its namespace, so it ignores SIGXCPU and dies of the hard limit's SIGKILL.
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGKILL):
        return ProgramResult("timeout", "CPU time limit")
    if code == EXIT_FAILED:
        return ProgramResult("failed", tail)
    if code == EXIT_EXITED:
        return ProgramResult("failed", "exited before the test completed")
    if code == EXIT_BLOCKED:
        return ProgramResult("blocked", tail)
    if code == EXIT_CRASHED:
        return ProgramResult("crashed", tail)
    return ProgramResult("killed", f"exit {code}: {tail}")


def _verdict_line(stdout: str) -> Optional[ProgramResult]:
    """The judge's one JSON line, or None when stdout is anything else."""
    lines = stdout.splitlines()
    try:
        message = json.loads(lines[0]) if len(lines) == 1 else None
    except ValueError:
        return None
    if not isinstance(message, dict) or message.get("verdict") not in VERDICTS:
        return None
    return ProgramResult(message["verdict"], str(message.get("detail", "")))


def _unlinked_file(text: str):
    """A temporary file with no name (nothing to clean up, whatever happens) holding ``text``, at
    its start."""
    file = tempfile.TemporaryFile()
    file.write(text.encode("utf-8", "surrogateescape"))
    file.flush()
    file.seek(0)
    return file


def _read_back(file, limit: int) -> str:
    file.seek(0)
    return file.read(limit).decode("utf-8", "replace")


def _python_dirs(python: str, under: str) -> List[str]:
    """The interpreter's installation folders (the venv and its base) that lie under ``under``."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                           os.path.dirname(os.path.dirname(os.path.realpath(python))),
                                           os.path.dirname(os.path.dirname(os.path.abspath(python))))}
    under = os.path.realpath(under)
    inside = sorted(p for p in paths if p.startswith(under + os.sep))
    return [p for p in inside if not any(p != q and p.startswith(q + os.sep) for q in inside)]


def _tasks_of_uid(uid: int) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return count


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def run_program_tests(sandbox: Sandbox, code: str, ground_truth: Any, *, stop_on_failure: bool = False
                      ) -> List[ProgramResult]:
    """`code` (after the ground truth's `prefix`) as one program per test case; the verdict of each
    (``skipped`` for those not run after a failure when ``stop_on_failure``: enough for a hard reward)."""
    kind, cases = parse_tests(ground_truth)
    code = str(_spec(ground_truth).get("prefix") or "") + code
    results: List[ProgramResult] = []
    for case in cases:
        if stop_on_failure and results and results[-1].verdict != "passed":
            results.append(ProgramResult("skipped"))
        elif kind == "assert":
            results.append(sandbox.run(code, kind="assert", test=case["assert_code"]))
        else:
            results.append(sandbox.run(code, kind="input", stdin=case["stdin"],
                                       expected_stdout=case["expected_stdout"]))
    return results
