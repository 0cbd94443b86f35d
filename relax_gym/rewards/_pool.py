"""A thread-safe pool of persistent math-verify worker processes.

Why processes: math-verify's own timeout uses ``signal.alarm``, which only works in the
main thread, and a runaway sympy computation cannot be interrupted inside a thread. A
worker is a plain subprocess (fork+exec, safe with threads, no re-import of ``__main__``)
that pays the import once; one that overruns its deadline is killed and replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

_SCRIPT = str(Path(__file__).with_name("_verifier.py"))
# Start-up (importing sympy) is not charged to a request's timeout, but must end somewhere.
_STARTUP_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """The worker died or broke the protocol; the request's outcome is unknown."""


class _Worker:
    def __init__(self) -> None:
        # -P: do not put this package's folder first on the worker's sys.path.
        self._proc = subprocess.Popen(
            [sys.executable, "-P", _SCRIPT, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin = self._proc.stdin
        self._stdout = self._proc.stdout.fileno()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._stdout, selectors.EVENT_READ)
        self._ready = False

    def request(self, message: dict, timeout_s: float) -> dict:
        """Send one request; TimeoutError past ``timeout_s`` (start-up not counted)."""
        if not self._ready:
            try:
                greeting = self._read(time.monotonic() + _STARTUP_TIMEOUT_S)
            except TimeoutError:
                raise WorkerError(f"math-verify worker did not start in {_STARTUP_TIMEOUT_S:g}s") from None
            if greeting != {"ready": True}:
                raise WorkerError(f"math-verify worker sent an unexpected greeting {greeting!r}")
            self._ready = True
        try:
            self._stdin.write(json.dumps(message).encode("ascii") + b"\n")
            self._stdin.flush()
        except OSError as exc:
            raise WorkerError(f"math-verify worker is gone (exit code {self._proc.poll()})") from exc
        return self._read(time.monotonic() + timeout_s)

    def _read(self, deadline: float) -> dict:
        line = bytearray()
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not self._selector.select(min(remaining, 60.0)):  # select() rejects huge timeouts
                continue
            chunk = os.read(self._stdout, 1 << 16)
            if not chunk:
                raise WorkerError(f"math-verify worker exited (exit code {self._proc.wait()})")
            line += chunk
        return json.loads(line)

    def signal_kill(self) -> None:
        """Kill the process only: safe while another thread is reading from it."""
        self._proc.kill()

    def kill(self) -> None:
        """Kill and release everything; only for the thread that owns the worker."""
        self._proc.kill()
        self._proc.wait()
        self._selector.close()
        with contextlib.suppress(OSError):  # flushing into a dead pipe
            self._stdin.close()
        self._proc.stdout.close()  # type: ignore[union-attr]


class WorkerPool:
    """At most ``size`` workers, started on demand and reused across calls and threads."""

    def __init__(self, size: int) -> None:
        self.pid = os.getpid()  # a forked child must not share its parent's workers
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    def request(self, message: dict, timeout_s: float) -> dict:
        """Run one request on an idle worker; a worker that fails in any way is replaced."""
        with self._slots:
            with self._lock:
                if self._closed:
                    raise WorkerError("the math-verify worker pool is shut down")
                worker = self._idle.pop() if self._idle else _Worker()
                self._busy.add(worker)
            try:
                reply = worker.request(message, timeout_s)
            except BaseException:
                worker.kill()
                with self._lock:
                    self._busy.discard(worker)
                    if not self._closed:
                        self._idle.append(_Worker())  # starts now, warm by the next call
                raise
            with self._lock:
                self._busy.discard(worker)
                if not self._closed:
                    self._idle.append(worker)
                    return reply
            worker.kill()
            return reply

    def close(self) -> None:
        """Kill every worker; busy ones die under their caller, which gets a WorkerError."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            for worker in self._busy:
                worker.signal_kill()
        for worker in idle:
            worker.kill()
