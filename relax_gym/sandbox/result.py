"""What a sandbox run returns, shared by both backends."""

from __future__ import annotations

from dataclasses import dataclass


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code it ran): the engine refused or broke off a run."""


class SandboxUnavailableError(SandboxError):
    """No container engine (or no sandbox image) could be used; the message says why."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one run.

    `exit_code` follows the shell's convention in both backends: 128 + N when
    the process died of signal N (137 = SIGKILL), None when it could not be
    read. `timeout_s` is the wall-clock limit the run had. `oom_killed` means
    the memory limit killed the process; only the container backend sets it
    (the subprocess fallback's limit makes allocations fail with MemoryError
    instead, visible in stderr).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    oom_killed: bool
    output_truncated: bool
    backend: str
    duration_s: float
    timeout_s: float

    @property
    def ok(self) -> bool:
        """True when the code ran to completion and exited 0."""
        return self.exit_code == 0 and not (self.timed_out or self.oom_killed or self.output_truncated)

    def summary(self, max_chars: int = 2000) -> str:
        """Short text for a model's tool observation: exit code, trimmed output, what stopped the run."""
        lines = [f"exit code: {self.exit_code if self.exit_code is not None else 'unknown'}"]
        if self.stdout:
            lines += ["stdout:", _trim(self.stdout, max_chars)]
        if self.stderr:
            lines += ["stderr:", _trim(self.stderr, max_chars)]
        if not (self.stdout or self.stderr):
            lines.append("(no output)")
        if self.timed_out:
            lines.append(f"[timed out after {self.timeout_s:g}s]")
        if self.output_truncated:
            lines.append("[output truncated]")
        if self.oom_killed:
            lines.append("[killed: memory limit]")
        return "\n".join(lines)


def _trim(text: str, max_chars: int) -> str:
    """Keep the head and the tail (where tracebacks end) of an over-long text."""
    text = text.rstrip("\n")
    if len(text) <= max_chars:
        return text
    head = max_chars // 3
    tail = max_chars - head
    return f"{text[:head]}\n... [{len(text) - max_chars} chars omitted] ...\n{text[-tail:]}"
