"""Code execution for environments and tools: a container per run, or a clearly-flagged fallback.

`Sandbox().run(code)` runs Python source in a fresh container through any
Docker-API engine (Docker, or podman's service: `bash scripts/start_podman.sh`
and `bash scripts/build_sandbox_image.sh`), with the network off and memory,
CPU, process, time and output limits. Without an engine it falls back to a
resource-limited subprocess, which is not a security boundary, and says so
with a warning; `SandboxConfig(require_container=True)` makes that an error.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import warnings

from relax_gym.sandbox.config import SandboxConfig
from relax_gym.sandbox.container import ContainerBackend
from relax_gym.sandbox.local import SubprocessBackend
from relax_gym.sandbox.result import ExecResult, SandboxError, SandboxUnavailableError

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxFallbackWarning",
    "SandboxUnavailableError",
    "container_unavailable",
    "shared_sandbox",
]

logger = logging.getLogger(__name__)


class SandboxFallbackWarning(RuntimeWarning):
    """Code will run in a plain subprocess because no container engine could be used."""


@functools.lru_cache(maxsize=16)
def container_unavailable(config: SandboxConfig) -> str | None:
    """Why no container can run code under `config` (no engine answers, no image), or None when one can; asked of
    the engine once per config in a process. An env that runs model-written code asks it when it is made, so the
    fallback is known before any code is sent, and `relax-gym env-server` refuses to serve one without it."""
    try:
        ContainerBackend(config).close()
    except SandboxUnavailableError as exc:
        return str(exc)
    return None


class Sandbox:
    """Runs untrusted Python source and reports what happened as an `ExecResult`.

    The backend is chosen once, at construction. Runs are independent (a fresh
    container or temp dir each), so one Sandbox may be used from several
    threads, or from asyncio through `arun`, at the same time.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._backend: ContainerBackend | SubprocessBackend
        try:
            self._backend = ContainerBackend(self.config)
        except SandboxUnavailableError as exc:
            if self.config.require_container:
                raise
            message = (
                f"relax_gym sandbox: no container engine can be used ({exc}). Code will run in a "
                "resource-limited subprocess, which is NOT a security boundary. To use a container: "
                "start an engine (Docker, or `bash scripts/start_podman.sh` for podman's Docker API), "
                "build the image with `bash scripts/build_sandbox_image.sh`, and set DOCKER_HOST if "
                "its socket is not a default one; SandboxConfig(require_container=True) turns this "
                "fallback into an error."
            )
            logger.warning(message)
            warnings.warn(message, SandboxFallbackWarning, stacklevel=2)
            self._backend = SubprocessBackend(self.config)

    @property
    def backend(self) -> str:
        """The backend in use: "container" or "subprocess"."""
        return self._backend.name

    @property
    def engine_url(self) -> str | None:
        """The Docker-API engine the container backend talks to; None for the subprocess fallback."""
        return self._backend.url

    def run(self, code: str, *, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """Run `code` as a Python script; `timeout_s` overrides the config's wall-clock limit.

        The code's failures (exceptions, timeouts, limits) are in the result;
        only a failure of the sandbox itself raises `SandboxError`.
        """
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        if limit <= 0:
            raise ValueError(f"timeout_s must be positive, got {limit}")
        return self._backend.run(code, timeout_s=limit, stdin=stdin)

    async def arun(self, code: str, *, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """`run` in a worker thread, so an event loop driving many episodes is never blocked."""
        return await asyncio.to_thread(self.run, code, timeout_s=timeout_s, stdin=stdin)

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_shared: dict[SandboxConfig, Sandbox] = {}
_shared_lock = threading.Lock()


def shared_sandbox(config: SandboxConfig) -> Sandbox:
    """The process's one `Sandbox` for `config`, made on first use and never closed by its users. The envs of many
    concurrent episodes share it: the engine is connected to and its seccomp profile probed (a container) once,
    not once per episode, and their runs share the backend's cap on containers at once (32 envs each making their
    own flooded podman until its pings timed out)."""
    with _shared_lock:
        sandbox = _shared.get(config)
        if sandbox is None:
            sandbox = _shared[config] = Sandbox(config)
        return sandbox
