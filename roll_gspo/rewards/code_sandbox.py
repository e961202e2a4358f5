"""Run a response's code against a row's tests in a sandbox on this machine.

Ground truth of a code row (JSON text or a dict), in ROLL's field names::

    {"case_type": "assert", "test_cases": [{"assert_code": "assert add(1, 2) == 3"}, ...]}
    {"case_type": "input",  "test_cases": [{"stdin": "1 2\\n", "expected_stdout": "3\\n"}, ...]}

(`assert_code` may define `test_*` functions, which are then called; a bare list of assert
strings is read as `assert`; `pytest` is read as `assert`; `stdin`/`io` as `input`. An optional
`"prefix"` is put before the response's code: completion tasks whose prompt holds the `def`
line, HumanEval-style.)

Each test is its own program: the response's code (its last fenced code block, else the text
after any reasoning) followed by the test, run by this interpreter in a fresh process with a
CPU-time limit, an address-space limit, a file-size limit, a process-count limit (under a uid of
its own, so other sandboxes' processes do not count), an empty environment, a private folder as
its working directory, and no network. Two isolation tools:

* ``bwrap`` (bubblewrap, Debian package `bubblewrap`): read-only view of the system, a private
  /tmp, new PID/network/IPC/UTS namespaces (killing the sandbox kills everything in it), the
  private folder the only writable place besides /tmp. Chosen over nsjail because it is a
  small, widely packaged tool (Flatpak's) that works unprivileged.
* ``rlimits``: the same limits, with `unshare` for a network and PID namespace and `setpriv` for
  the uid (root), or `unshare -r` (a user namespace) otherwise. Without a mount namespace of its
  own the program can still write world-writable folders (/tmp, /dev/shm); bwrap cannot be
  written around that way.

A program passes when it runs to completion (a test's asserts hold, or its stdout equals the
expected one up to trailing whitespace) and the harness then prints a per-program random token
the program never sees in its files or environment; exiting early (`sys.exit`, `os._exit`)
before the test ran is a failure. (Code that walks the harness's stack frames could find the
token: this guards against accidents and cheap reward hacks, not a determined adversary.)
"""
from __future__ import annotations

import errno
import json
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from roll_gspo.rewards.math_rule import strip_think

SANDBOX_KINDS = ("auto", "bwrap", "rlimits")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
# Exit codes of the harness (below); anything else is the program's own exit.
EXIT_FAILED, EXIT_EXITED, EXIT_CRASHED, EXIT_BLOCKED = 81, 82, 83, 84
_BLOCKED_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENETUNREACH, errno.ECONNREFUSED,
                   errno.EAFNOSUPPORT, errno.EFBIG, errno.EAGAIN, errno.ENOSPC, errno.EDQUOT, errno.EHOSTUNREACH,
                   errno.ENOMEM}

# Runs inside the sandbox. The token file is read and deleted before any of the response's code
# runs; a pass is signalled by printing the token after the test completes.
HARNESS = r'''
import errno, os, sys, traceback
def _run():
    with open("token") as fh:
        token = fh.read()
    os.remove("token")
    with open("program.py") as fh:
        source = fh.read()
    kind = sys.argv[1]
    try:
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except AssertionError:
        traceback.print_exc()
        os._exit(%(failed)d)
    except SystemExit as exc:
        if kind == "assert" or exc.code not in (None, 0):
            os._exit(%(exited)d)
    except (MemoryError, RecursionError, BlockingIOError):
        traceback.print_exc()
        os._exit(%(blocked)d)
    except OSError as exc:
        traceback.print_exc()
        os._exit(%(blocked)d if exc.errno in %(blocked_errnos)r else %(crashed)d)
    except BaseException:
        traceback.print_exc()
        os._exit(%(crashed)d)
    sys.stdout.flush()
    os.write(1, ("\n" + token + "\n").encode())
    os._exit(0)
_run()
''' % {"failed": EXIT_FAILED, "exited": EXIT_EXITED, "crashed": EXIT_CRASHED, "blocked": EXIT_BLOCKED,
       "blocked_errnos": tuple(sorted(_BLOCKED_ERRNOS))}


def extract_code(response: str) -> str:
    """The last fenced code block of the answer (after any reasoning), else the answer itself."""
    text = strip_think(str(response or ""))
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks else text


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


def _assert_program(code: str, assert_code: str) -> str:
    tests = re.findall(r"^def (test_\w+)\s*\(", assert_code, re.MULTILINE)
    runner = "".join(f"\n{name}()" for name in tests)
    return f"{code}\n\n{assert_code}\n{runner}\n"


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


class Sandbox:
    """Runs programs with limits; one per reward worker (programs run one at a time)."""

    def __init__(self, kind: str = "auto", *, timeout_s: float = 10.0, memory_mb: int = 512,
                 max_processes: int = 16, max_file_mb: int = 16, python: Optional[str] = None,
                 site_packages: bool = False):
        if kind not in SANDBOX_KINDS:
            raise ValueError(f"sandbox {kind!r}: valid are {SANDBOX_KINDS}")
        self.bwrap = shutil.which("bwrap")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.max_processes, self.max_file_mb = int(max_processes), int(max_file_mb)
        # Without site-packages the base interpreter serves, wherever the venv lives: a venv under
        # /tmp (a CI clone) is hidden by bubblewrap's private /tmp.
        self.python = python or (sys.executable if site_packages else
                                 os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
        # Without site-packages (`-S`) an interpreter starts ~3x faster here; tests needing
        # third-party modules turn them on.
        self.python_flags = ["-I"] if site_packages else ["-I", "-S"]
        self.is_root = os.geteuid() == 0
        # A uid of this worker's own (root only): the process-count limit then counts only its
        # programs, and the program owns nothing outside its folder.
        self.uid = 100000 + os.getpid() if self.is_root else os.getuid()
        self.kind = "bwrap" if kind == "auto" else kind
        if self.kind == "bwrap" and not (self.bwrap and _works(self._wrap([self.python, "-c", ""], folder="/"))):
            if kind == "bwrap":
                raise RuntimeError("sandbox: bwrap is not installed or cannot run here (Debian/Ubuntu: apt-get "
                                   "install bubblewrap); or set sandbox: rlimits")
            self.kind = "rlimits"
        if self.kind == "rlimits" and not (shutil.which("unshare") and _works(self._wrap([self.python, "-c", ""], folder="/"))):
            raise RuntimeError("sandbox rlimits: `unshare` cannot create a network namespace here (needs root, or "
                               "unprivileged user namespaces); install bubblewrap or run as root")

    # -- command lines ---------------------------------------------------------------------------
    def _wrap(self, argv: List[str], folder: str) -> List[str]:
        drop_uid = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--"]
        if self.kind == "bwrap":
            cmd = [self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                   "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                   "--die-with-parent", "--new-session", "--hostname", "sandbox"]
            for hidden in ("/root", "/home", "/run", "/var/tmp", "/dev/shm"):
                if os.path.isdir(hidden):  # other users' files; the interpreter is bound back in
                    cmd += ["--tmpfs", hidden]
                    cmd += [arg for path in _python_dirs(self.python, hidden) for arg in ("--ro-bind", path, path)]
            cmd += ["--bind", folder, folder, "--chdir", folder]
            if self.is_root:  # root: bwrap keeps only the caps to switch to the sandbox uid
                return cmd + ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--"] + drop_uid + argv
            return cmd + ["--unshare-user", "--"] + argv
        if self.is_root:
            return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--"] + drop_uid + argv
        return ["unshare", "-r", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--"] + argv

    def _limits(self) -> None:
        """In the child before exec: its own session (killed as a group) and the rlimits."""
        os.setsid()
        cpu = max(1, int(self.timeout_s + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        size = self.max_file_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # Counts the tasks of the program's uid: its own uid when root; otherwise ours, so add
        # what already runs under it.
        base = 0 if self.is_root else _tasks_of_uid(os.getuid())
        nproc = base + self.max_processes + 4  # + the wrapper processes
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    def _env(self, home: str) -> Dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
                "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1"}

    # -- running ---------------------------------------------------------------------------------
    def run(self, source: str, *, kind: str = "assert", stdin: str = "", expected_stdout: Optional[str] = None
            ) -> ProgramResult:
        """Run one program; ``kind`` assert (pass = completes) or input (pass = stdout matches)."""
        folder = tempfile.mkdtemp(prefix="rg_sandbox_")
        try:
            token = secrets.token_hex(16)
            for name, text in (("program.py", source), ("harness.py", HARNESS), ("token", token)):
                with open(os.path.join(folder, name), "w") as fh:
                    fh.write(text)
            if self.is_root:
                os.chown(folder, self.uid, self.uid)
                for name in ("program.py", "harness.py", "token"):
                    os.chown(os.path.join(folder, name), self.uid, self.uid)
            argv = self._wrap([self.python, *self.python_flags, "harness.py", kind], folder)
            return self._run(argv, folder, stdin, token, expected_stdout)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _run(self, argv, folder, stdin, token, expected_stdout) -> ProgramResult:
        proc = subprocess.Popen(argv, cwd=folder, env=self._env(folder), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=self._limits)
        try:
            out, err = proc.communicate(stdin.encode(), timeout=self.timeout_s + 1.0)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return ProgramResult("timeout", f"exceeded {self.timeout_s:g}s")
        finally:
            _kill_group(proc)  # nothing it started outlives it (namespaces do the rest)
        stdout = out.decode("utf-8", "replace")
        tail = err.decode("utf-8", "replace")[-300:]
        code = proc.returncode
        marker = "\n" + token + "\n"
        if code == 0 and stdout.endswith(marker):
            if expected_stdout is None or _same_output(stdout[: -len(marker)], expected_stdout):
                return ProgramResult("passed")
            return ProgramResult("failed", "wrong output")
        if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or (code in (-signal.SIGKILL, 137) and "CPU" in tail):
            return ProgramResult("timeout", "CPU time limit")
        if code == EXIT_FAILED:
            return ProgramResult("failed", tail)
        if code == EXIT_EXITED:
            return ProgramResult("failed", "exited before the test completed")
        if code == EXIT_BLOCKED:
            return ProgramResult("blocked", tail)
        if code == EXIT_CRASHED:
            return ProgramResult("crashed", tail)
        if code == 0:  # exited 0 without the token: os._exit before the test
            return ProgramResult("failed", "exited before the test completed")
        return ProgramResult("killed", f"exit {code}: {tail}")


def _works(argv: List[str]) -> bool:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


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


def run_tests(sandbox: Sandbox, response: str, ground_truth: Any, *, stop_on_failure: bool = False
              ) -> List[ProgramResult]:
    """One program per test case; the verdict of each (``skipped`` for those not run after a
    failure when ``stop_on_failure``: enough for a hard reward)."""
    kind, cases = parse_tests(ground_truth)
    code = str(_spec(ground_truth).get("prefix") or "") + extract_code(response)
    results: List[ProgramResult] = []
    for case in cases:
        if stop_on_failure and results and results[-1].verdict != "passed":
            results.append(ProgramResult("skipped"))
        elif kind == "assert":
            results.append(sandbox.run(_assert_program(code, case["assert_code"]), kind="assert"))
        else:
            results.append(sandbox.run(code, kind="input", stdin=case["stdin"],
                                       expected_stdout=case["expected_stdout"]))
    return results


def code_outcome(results: Sequence[ProgramResult], reward_type: str = "hard") -> Tuple[float, str, str]:
    """``(score, status, message)``: score the pass fraction (soft) or all-passed (hard); status
    ``timeout`` when a program overran, ``error`` when one was stopped by a limit or a blocked
    action (memory, processes, network, writing outside its folder) or killed, else ``ok``."""
    passed = sum(r.verdict == "passed" for r in results)
    fraction = passed / len(results) if results else 0.0
    score = fraction if reward_type == "soft" else float(passed == len(results) and bool(results))
    verdicts = [r.verdict for r in results]
    status = "timeout" if "timeout" in verdicts else "error" if {"blocked", "killed"} & set(verdicts) else "ok"
    counts = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
    worst = next((r.detail for r in results if r.verdict != "passed" and r.detail), "")
    return score, status, f"{passed}/{len(results)} tests passed {counts}" + (f"; {worst[-200:]}" if worst else "")
