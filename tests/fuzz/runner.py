"""Running fuzz cases: in a long-lived worker process (fast) or through the real CLI (faithful), bounded.

A case runs exactly what `moestream run -m FILE -p hi -n 2 --threads 1` runs (cli.main.main), and ends as
  ok         exit 0
  clean      exit 2 with one `error: ...` line on stderr (besides known informational lines), no traceback
  defect     traceback (an exception escaped), signal (the process died), hang (past the deadline),
             memory (out of memory under the address-space bound), messy (exit 2 but not one clean line)
The worker imports torch once and forks a child per case, so a case that kills or hangs its process costs
that child only (and no case sees another's state). Each worker (and each CLI run) lives under an RLIMIT_AS
bound, so a runaway allocation is an outcome, not a machine in trouble.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass

from tests.fuzz.gguf_cases import Case, _clear, materialize

ARGS = ["-p", "hi", "-n", "2", "--threads", "1"]
INFO_PREFIXES = ("mlock:", "budget ", "prompt ", "preloaded ", "pinned profile", "elastic")
AS_LIMIT = 8 << 30  # torch's own mappings take ~2-3 GB of address space; a tiny model needs little more
CASE_TIMEOUT = 60.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFECTS = ("traceback", "signal", "hang", "memory", "messy")


@dataclass
class Outcome:
    outcome: str  # ok, clean, or one of DEFECTS
    detail: str = ""  # the error line, the exception, or the signal
    where: str = ""  # the innermost moestream source file of a traceback (which part to blame)


def classify(rc: int, stderr: str) -> Outcome:
    if rc == 0:
        return Outcome("ok")
    if rc < 0:
        return Outcome("signal", signal.Signals(-rc).name if -rc in signal.valid_signals() else str(rc))
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(INFO_PREFIXES)]
    if "Traceback" in stderr:
        return Outcome("traceback", lines[-1][:300] if lines else "")
    if rc == 2 and len(lines) == 1 and lines[0].startswith("error: "):
        if "out of memory" in lines[0]:
            return Outcome("memory", lines[0])
        return Outcome("clean", lines[0][:300])
    return Outcome("messy", f"rc {rc}: {' | '.join(lines)[:300]}")


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _blame(tb) -> str:
    files = [f.filename for f in traceback.extract_tb(tb) if "/moestream/" in f.filename]
    if not files:
        return ""
    return "moestream/" + files[-1].split("/moestream/", 1)[1]


def run_in_process(path: str) -> Outcome:
    """One case in this process, as the CLI would run it (stdout and stderr captured)."""
    from moestream.cli.main import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(["run", "-m", path, *ARGS])
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - what escapes main is the defect we are looking for
        return Outcome("traceback", f"{type(exc).__name__}: {exc}"[:300], _blame(exc.__traceback__))
    return classify(rc, err.getvalue())


def run_cli(path: str, timeout: float = CASE_TIMEOUT) -> Outcome:
    """One case through `python -m moestream run` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        p = subprocess.run(
            [sys.executable, "-m", "moestream", "run", "-m", path, *ARGS],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            preexec_fn=_limit_memory,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return Outcome("hang", f"no exit within {timeout:.0f} s")
    out = classify(p.returncode, p.stderr)
    if out.outcome == "traceback":
        tail = [ln for ln in p.stderr.splitlines() if 'File "' in ln and "/moestream/" in ln]
        out.where = "moestream/" + tail[-1].split("/moestream/", 1)[1].split('"')[0] if tail else ""
    return out


class Worker:
    """A process that imports moestream once and runs each case in a child forked from it."""

    def __init__(self, warm_path: str = "") -> None:
        self.warm_path = warm_path  # a valid model to run once before forking
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz.runner", "--worker", self.warm_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            preexec_fn=_limit_memory,
            env=dict(os.environ, PYTHONPATH=ROOT),
            cwd=ROOT,
        )
        assert self._line(120.0) == "ready", "the fuzz worker did not start"

    def _line(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        return self.proc.stdout.readline().decode().strip()

    def run(self, path: str, timeout: float = CASE_TIMEOUT) -> Outcome:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(f"{path} {timeout}\n".encode())
        self.proc.stdin.flush()
        line = self._line(timeout + 30.0)
        if line:
            d = json.loads(line)
            return Outcome(d["outcome"], d["detail"], d["where"])
        if line is None:
            self.stop()
            return Outcome("hang", f"no result within {timeout:.0f} s")
        rc = self.proc.wait()  # the worker died in the case
        self.proc = None
        return classify(rc, "") if rc < 0 else Outcome("signal", f"the worker exited with {rc}")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None


def run_case(case: Case, workdir: str, worker: Worker | None, timeout: float = CASE_TIMEOUT) -> Outcome:
    """Materialize one case in `workdir` and run it in the worker (or, without one, through the CLI)."""
    path = materialize(case, os.path.join(workdir, "case.gguf"))
    try:
        return worker.run(path, timeout) if worker is not None else run_cli(path, timeout)
    finally:
        _clear(path)


def _run_forked(path: str, timeout: float) -> Outcome:
    """One case in a child forked from the worker: a crash or a hang costs the child, not the torch import."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, leave without running the parent's atexit handlers
        os.close(rfd)
        try:
            out = run_in_process(path)
        except MemoryError:
            out = Outcome("memory", "MemoryError")
        os.write(wfd, json.dumps(out.__dict__).encode())
        os._exit(0)
    os.close(wfd)
    ready, _, _ = select.select([rfd], [], [], timeout)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    data = b""
    while ready:
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        data += chunk
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    if not ready:
        return Outcome("hang", f"no result within {timeout:.0f} s")
    if data:
        return Outcome(**json.loads(data))
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    return classify(-sig, "") if sig else Outcome("signal", f"the case exited with {os.WEXITSTATUS(status)}")


def _worker_main() -> None:
    proto = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the model's text (and anything native) must not mix into the results
    # One run of a valid file before forking pays the first-call costs once (each child inherits them warm);
    # at one thread neither torch's OpenMP pool nor the native pool starts a thread, so forking stays safe.
    warm = sys.argv[2] if len(sys.argv) > 2 else ""
    if warm:
        run_in_process(warm)
    proto.write("ready\n")
    proto.flush()
    for line in sys.stdin:
        path, timeout = line.rsplit(" ", 1)
        out = _run_forked(path, float(timeout))
        proto.write(json.dumps(out.__dict__) + "\n")
        proto.flush()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker_main()
