"""Fallback when no container engine answers: a resource-limited `python3 -I` subprocess.

This is NOT a security boundary. The code runs as the host user, can read
whatever that user can read, reach the network, and (as root) raise its own
limits back. It exists so that examples and tests work on a machine without an
engine; code from a model under training belongs in the container backend.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relax_gym.sandbox.config import SandboxConfig
from relax_gym.sandbox.output import CappedOutput
from relax_gym.sandbox.result import ExecResult

_NOFILE = 256
_READ_CHUNK = 64 * 1024
# How often the read loop looks at the main process when a leftover child
# still holds its pipes open after it exited.
_POLL_S = 0.05
_GRACE_S = 5.0


class SubprocessBackend:
    """Runs code with the host interpreter in a fresh temp dir, environment cleared, rlimits set.

    Limits: RLIMIT_AS (memory; allocations past it raise MemoryError),
    RLIMIT_CPU, RLIMIT_FSIZE (largest file written), RLIMIT_NOFILE, and
    RLIMIT_NPROC when not root (root ignores it, and for other users it counts
    every process the user runs, so it is set to that count plus `pids`). The
    run gets its own session; on timeout or output cap the whole process group
    is killed. NOT a security boundary: see the module docstring.
    """

    name = "subprocess"
    url: str | None = None  # no engine

    def __init__(self, config: SandboxConfig) -> None:
        self._config = config

    def run(self, code: str, *, timeout_s: float, stdin: str | None) -> ExecResult:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="relax-gym-sandbox-") as workdir:
            script = Path(workdir, "main.py")
            script.write_text(code, encoding="utf-8")
            stdin_file = Path(workdir, ".stdin")
            stdin_file.write_text(stdin or "", encoding="utf-8")
            output = CappedOutput(self._config.output_limit_bytes)
            with (
                stdin_file.open("rb") as stdin_fh,
                subprocess.Popen(
                    _limited_command(_limits(self._config, timeout_s), script),
                    stdin=stdin_fh,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=workdir,
                    env=_clean_env(workdir),
                    start_new_session=True,
                ) as proc,
            ):
                timed_out = _read_until_done(proc, output, started + timeout_s)
                # Always: this also ends children left in the group, which would outlive the run.
                _kill_group(proc)
                returncode = proc.wait(_GRACE_S)
        exit_code = 128 - returncode if returncode < 0 else returncode
        return ExecResult(
            stdout=output.stdout,
            stderr=output.stderr,
            exit_code=exit_code,
            timed_out=timed_out,
            oom_killed=False,
            output_truncated=output.truncated,
            backend=self.name,
            duration_s=time.monotonic() - started,
            timeout_s=timeout_s,
        )

    def close(self) -> None:
        """Nothing to release: each run cleans up after itself."""


def _clean_env(workdir: str) -> dict[str, str]:
    """The host's environment (tokens, keys) is not passed on; only what Python needs."""
    return {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def _limits(config: SandboxConfig, timeout_s: float) -> list[tuple[int, int]]:
    """The rlimits of one run, as (resource, value) pairs; soft and hard are set alike."""
    mib = 1024 * 1024
    limits = [
        (resource.RLIMIT_AS, config.memory_mb * mib),
        (resource.RLIMIT_CPU, math.ceil(timeout_s) + 1),
        (resource.RLIMIT_FSIZE, config.scratch_mb * mib),
        (resource.RLIMIT_NOFILE, _NOFILE),
    ]
    if os.geteuid() != 0 and hasattr(resource, "RLIMIT_NPROC"):
        limits.append((resource.RLIMIT_NPROC, _user_process_count() + config.pids))
    return limits


# Sets the limits on itself, then becomes the run (rlimits survive exec). The limits are set by a
# launcher, not by a preexec_fn: Python code between fork and exec in a process with threads (Ray's
# gRPC, torch's pools, the caller's own ThreadPoolExecutor) can deadlock the child, and the parent
# then waits for its exec forever; without a preexec_fn, subprocess uses vfork and runs no fork
# handlers, which is also faster from a parent of several GB.
_LAUNCHER = (
    "import os, resource, sys\n"
    "for spec in sys.argv[1].split(','):\n"
    "    which, value = map(int, spec.split(':'))\n"
    "    resource.setrlimit(which, (value, value))\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-u', sys.argv[2]])\n"
)


def _limited_command(limits: list[tuple[int, int]], script: Path) -> list[str]:
    specs = ",".join(f"{which}:{value}" for which, value in limits)
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, specs, str(script)]


def _user_process_count() -> int:
    """Processes (and threads count too, for RLIMIT_NPROC) of this uid, from /proc; 0 where absent."""
    uid = str(os.getuid())
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if fields.get("Uid", "").split()[:1] == [uid]:
            count += int(fields.get("Threads", "1"))
    return count


def _read_until_done(proc: subprocess.Popen, output: CappedOutput, deadline: float) -> bool:
    """Read both pipes into `output` until they close, the cap is hit, or the deadline; True on timeout."""
    assert proc.stdout is not None and proc.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, False)
        selector.register(proc.stderr, selectors.EVENT_READ, True)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            for key, _ in selector.select(min(remaining, _POLL_S)):
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif not output.add(chunk, stderr=key.data):
                    return False
            if proc.poll() is not None:
                # The main process is done: whatever still holds the pipes is a
                # leftover child, killed with the group by the caller.
                _drain_ready(selector, output)
                return False
    return False


def _drain_ready(selector: selectors.BaseSelector, output: CappedOutput) -> None:
    """Take what the exited process left in its pipes without waiting for anything more."""
    while selector.get_map():
        ready = selector.select(0)
        if not ready:
            return
        for key, _ in ready:
            chunk = os.read(key.fd, _READ_CHUNK)
            if not chunk:
                selector.unregister(key.fileobj)
            elif not output.add(chunk, stderr=key.data):
                return


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
