"""Run code in a fresh container per run, through the Docker SDK (Docker, or podman's Docker API)."""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import threading
import time
from collections.abc import Iterable

import docker
import docker.errors
import requests
from docker.models.containers import Container
from docker.types import CancellableStream, LogConfig, Ulimit

from relax_gym.sandbox import seccomp
from relax_gym.sandbox.config import SandboxConfig
from relax_gym.sandbox.output import CappedOutput
from relax_gym.sandbox.result import ExecResult, SandboxError, SandboxUnavailableError

logger = logging.getLogger(__name__)

PODMAN_SOCKET = "unix:///run/podman/podman.sock"
DOCKER_SOCKET = "unix:///var/run/docker.sock"

_PING_TIMEOUT_S = 5.0
# Bound on each control call (create, put_archive, start, kill, remove): a hung
# engine must fail a run, not hang a rollout worker forever.
_API_TIMEOUT_S = 60.0
# How long to wait for a container to be reaped after its output ended or it was killed.
_GRACE_S = 15.0
# Connections kept per client: each concurrent run holds one stream and makes
# control calls, and urllib3 discards (and logs) connections past its pool size.
_POOL_SIZE = 64
# Containers one backend runs at once; more runs wait their turn (the wait is not part of a run's time limit): an
# engine starting dozens at once on a small machine took longer than the limit to start each (podman 4.3, 2 cores).
_MAX_RUNNING = 2 * (os.cpu_count() or 1)

# The code (and stdin) go in as files, put with put_archive into the created
# container's own layer before it starts, then run from there. Not `python3 -c
# CODE`: one argument is capped at 128 KiB by the kernel (MAX_ARG_STRLEN). Not
# into /scratch: that tmpfs is mounted at start and would hide them. /sandbox
# stays read-only during the run, so the code cannot rewrite itself; stdin as a
# file means no interactive stdin stream has to be held open and half-closed.
_CODE_DIR = "sandbox"
_COMMAND = ["/bin/sh", "-c", f"exec python3 -u /{_CODE_DIR}/main.py < /{_CODE_DIR}/stdin"]

_NOFILE = 256
# nproc is per uid across the whole host, and every sandbox shares the same
# uid: a limit near `pids` would let one fork bomb block its neighbours from
# starting. The per-container bound is pids_limit; this one must be passed
# anyway (podman fails start with "error setting rlimit type 6" without it)
# and may not exceed containers.conf's default of 1024 here.
_NPROC = 1024

# Run once per engine, image and profile in a process, under the candidate
# seccomp option: it proves the engine applies the profile, not merely that it
# took the option. A filter is on, no_new_privs is set, and unshare is refused
# even with no flags, which the kernel itself never refuses (only a filter
# does), as well as with CLONE_NEWUSER. EPERM is 1 on every Linux architecture.
_PROBE_CODE = r"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
def unshare(flags):
    return 0 if libc.unshare(flags) == 0 else ctypes.get_errno()
status = dict(line.rstrip("\n").split(":\t", 1) for line in open("/proc/self/status") if ":\t" in line)
print(json.dumps({"Seccomp": status.get("Seccomp"), "NoNewPrivs": status.get("NoNewPrivs"),
                  "unshare(0)": unshare(0), "unshare(CLONE_NEWUSER)": unshare(0x10000000)}))
"""
_PROBE_EXPECTED = {"Seccomp": "2", "NoNewPrivs": "1", "unshare(0)": 1, "unshare(CLONE_NEWUSER)": 1}
# (engine URL, image, profile digest) -> the security_opt entry seen enforced there, in this process.
_ENFORCED: dict[tuple[str, str, str], str] = {}
_ENFORCED_LOCK = threading.Lock()


def candidate_urls(config: SandboxConfig) -> list[str]:
    """Engines to try, in order: the configured one only, else DOCKER_HOST, podman's socket, Docker's."""
    if config.docker_url:
        return [config.docker_url]
    urls = [os.environ["DOCKER_HOST"]] if os.environ.get("DOCKER_HOST") else []
    return urls + [url for url in (PODMAN_SOCKET, DOCKER_SOCKET) if url not in urls]


def _connect(config: SandboxConfig) -> tuple[str, str]:
    """The first engine URL that answers a ping, and its API version."""
    reasons = []
    for url in candidate_urls(config):
        if url.startswith("unix://") and not os.path.exists(url.removeprefix("unix://")):
            reasons.append(f"{url}: no such socket")
            continue
        try:
            probe = docker.DockerClient(base_url=url, timeout=_PING_TIMEOUT_S)
        except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
            reasons.append(f"{url}: {exc}")
            continue
        try:
            probe.ping()
            return url, probe.api.api_version
        except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
            reasons.append(f"{url}: {exc}")
        finally:
            probe.close()
    raise SandboxUnavailableError("no Docker-API engine answered: " + "; ".join(reasons))


class ContainerBackend:
    """Runs each piece of code in a fresh, locked-down container.

    Network off, a memory limit with no swap beyond it, pids, CPU share, read-only root
    with size-capped tmpfs /scratch (workdir) and /tmp, non-root user, no
    capabilities, no-new-privileges, relax_gym's own seccomp profile
    (`relax_gym.sandbox.seccomp`: no namespaces, mounts, bpf, io_uring, ...),
    nofile/nproc ulimits, capped logs, a wall-clock kill and a client-side
    output cap. Raises SandboxUnavailableError at construction when no engine
    answers, the image is missing, or the engine would not apply the seccomp
    profile, so the caller can choose a fallback; code never runs without it.
    """

    name = "container"

    def __init__(self, config: SandboxConfig) -> None:
        self._config = config
        self._running = threading.BoundedSemaphore(_MAX_RUNNING)
        self.url, version = _connect(config)
        self._client = docker.DockerClient(
            base_url=self.url, version=version, timeout=_API_TIMEOUT_S, max_pool_size=_POOL_SIZE
        )
        # Output streams get their own client without a read timeout: code that
        # is silent for longer than any API timeout must not end its stream;
        # the wall-clock kill bounds how long a stream can stay open.
        self._streams = docker.DockerClient(base_url=self.url, version=version, timeout=None, max_pool_size=_POOL_SIZE)
        try:
            self._client.images.get(config.image)
        except docker.errors.ImageNotFound:
            self.close()
            raise SandboxUnavailableError(
                f"engine {self.url} answers but has no image {config.image!r}: "
                "build it with `bash scripts/build_sandbox_image.sh`"
            ) from None
        except (docker.errors.DockerException, requests.RequestException) as exc:
            self.close()
            raise SandboxUnavailableError(f"engine {self.url}: {exc}") from exc
        try:
            self.security_opt = self._enforced_seccomp()
        except SandboxUnavailableError:
            self.close()
            raise
        self._create_kwargs = _create_kwargs(config, self.security_opt)

    def _enforced_seccomp(self) -> str:
        """The `security_opt` entry that carries the profile to this engine, once seen enforced.

        Docker's API takes the profile itself ("seccomp=<json>") and refuses
        a path when the container starts; podman's (4.x) takes a path on the
        engine's host and refuses JSON at create ("opening seccomp profile
        failed: open {...}: file name too long"). So JSON is tried first, then
        a file written by `seccomp.profile_path()`, each by a whole probe run
        (create alone proves nothing on Docker, and neither proves the filter
        is in force); the first that passes `_PROBE_CODE` is kept for the process.
        """
        key = (self.url, self._config.image, seccomp.digest())
        with _ENFORCED_LOCK:
            if key in _ENFORCED:
                return _ENFORCED[key]
            reasons: list[str] = []
            for form, option in self._seccomp_candidates(reasons):
                try:
                    self._probe(option)
                except SandboxError as exc:
                    reasons.append(f"as {form}: {_shorten(str(exc))}")
                    continue
                _ENFORCED[key] = option
                return option
        raise SandboxUnavailableError(
            f"engine {self.url} would not apply the sandbox's seccomp profile, and code does not run "
            "without it (it blocks user namespaces, mounts, bpf, io_uring, ...): " + "; ".join(reasons)
        )

    def _seccomp_candidates(self, reasons: list[str]) -> Iterable[tuple[str, str]]:
        yield "JSON (Docker)", "seccomp=" + seccomp.profile_json()
        try:
            path = seccomp.profile_path()
        except OSError as exc:
            reasons.append(f"as a file: {exc}")
            return
        if not self.url.startswith("unix://"):
            reasons.append(
                f"(engine {self.url} is not on this machine: it can read a profile file only if {path} "
                "is copied to the same path on its host)"
            )
        yield f"a file on the engine's host (podman), {path}", f"seccomp={path}"

    def _probe(self, security_opt: str) -> None:
        """Run `_PROBE_CODE` with `security_opt`; raise SandboxError unless the profile is seen in force."""
        result = self._run(_PROBE_CODE, 60.0, "", _create_kwargs(self._config, security_opt))
        try:
            seen = json.loads(result.stdout)
        except ValueError:
            seen = None
        if not result.ok or seen != _PROBE_EXPECTED:
            raise SandboxError(
                f"the engine took the option but the probe saw {seen or result.summary(max_chars=300)!r}, "
                f"expected {_PROBE_EXPECTED}"
            )

    def run(self, code: str, *, timeout_s: float, stdin: str | None) -> ExecResult:
        if self.security_opt.startswith("seccomp=/") and not os.path.exists(self.security_opt.removeprefix("seccomp=")):
            seccomp.profile_path()  # removed since (a cache cleaner): write it again
        return self._run(code, timeout_s, stdin or "", self._create_kwargs)

    def _run(self, code: str, timeout_s: float, stdin: str, create_kwargs: dict) -> ExecResult:
        with self._running:
            started = time.monotonic()
            try:
                container = self._client.containers.create(self._config.image, _COMMAND, **create_kwargs)
            except (docker.errors.DockerException, requests.RequestException) as exc:
                raise SandboxError(f"could not create a sandbox container: {exc}") from exc
            try:
                # The SDK inspects what it created: the engine must have kept the profile it was given.
                _check_seccomp(container, create_kwargs["security_opt"])
                output, exit_code, timed_out, killed = self._execute(container, code, stdin, timeout_s)
            except (docker.errors.DockerException, requests.RequestException) as exc:
                raise SandboxError(f"sandbox container failed: {exc}") from exc
            finally:
                _remove(container)
        return ExecResult(
            stdout=output.stdout,
            stderr=output.stderr,
            exit_code=exit_code,
            timed_out=timed_out,
            # Podman 4.3 on cgroup v1 reports State.OOMKilled=False even after an
            # OOM kill, so read it off the exit status: a SIGKILL we did not send
            # came from the kernel's OOM killer inside the memory cgroup.
            oom_killed=exit_code == 137 and not killed,
            output_truncated=output.truncated,
            backend=self.name,
            duration_s=time.monotonic() - started,
            timeout_s=timeout_s,
        )

    def _execute(
        self, container: Container, code: str, stdin: str, timeout_s: float
    ) -> tuple[CappedOutput, int | None, bool, bool]:
        """create → attach → start → read in a thread with a cap → on timeout/cap close, kill → wait.

        This order avoids the engine hangs seen with podman: killing a
        container whose output is still unread makes wait() hang, so the
        stream is closed before the kill.
        """
        container.put_archive("/", _code_archive(code, stdin))
        stream = self._streams.api.attach(container.id, stdout=True, stderr=True, stream=True, demux=True)
        output = CappedOutput(self._config.output_limit_bytes)
        try:
            container.start()
            reader = threading.Thread(target=_drain, args=(stream, output), name="sandbox-io", daemon=True)
            reader.start()
            reader.join(timeout_s)
            timed_out = reader.is_alive()
            killed = timed_out or output.truncated
            if killed:
                _close_stream(stream)
                _kill(container)
                reader.join(_GRACE_S)
        finally:
            _close_stream(stream)
        return output, _wait(container), timed_out, killed

    def close(self) -> None:
        self._client.close()
        self._streams.close()


def _create_kwargs(config: SandboxConfig, security_opt: str) -> dict:
    memory = f"{config.memory_mb}m"
    tmpfs = f"rw,nosuid,nodev,size={config.scratch_mb}m,mode=1777"
    return {
        "network_mode": "none",
        "mem_limit": memory,
        "memswap_limit": memory,  # equal to mem_limit: no swap on top of it
        "pids_limit": config.pids,
        "nano_cpus": int(config.cpus * 1e9),
        "read_only": True,
        # Podman adds /run and /var/tmp tmpfs of unbounded size to a read-only
        # root; naming them here caps them too (/run stays root-owned, unwritable).
        "tmpfs": {"/scratch": tmpfs, "/tmp": tmpfs, "/var/tmp": tmpfs, "/run": "rw,nosuid,nodev,size=1m"},
        "working_dir": "/scratch",
        "environment": {"HOME": "/scratch", "TMPDIR": "/tmp"},
        "user": config.user,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges", security_opt],
        "ulimits": [
            Ulimit(name="nofile", soft=_NOFILE, hard=_NOFILE),
            Ulimit(name="nproc", soft=_NPROC, hard=_NPROC),
        ],
        # Output is read through attach; the engine's own log copy only needs to be bounded.
        "log_config": LogConfig(type=LogConfig.types.JSON, config={"max-size": "1m"}),
        "hostname": "sandbox",
        "labels": {"relax_gym.sandbox": "1"},
    }


def _seccomp_value(option: str) -> str | None:
    """The profile (JSON or path) of a "seccomp=..." or "seccomp:..." security option, else None."""
    for prefix in ("seccomp=", "seccomp:"):
        if option.startswith(prefix):
            return option.removeprefix(prefix)
    return None


def _same_profile(kept: str, sent: str) -> bool:
    if kept == sent:
        return True
    try:  # Docker may keep the JSON re-serialised.
        return json.loads(kept) == json.loads(sent)
    except ValueError:
        return False


def _check_seccomp(container: Container, security_opt: list[str]) -> None:
    """Raise SandboxError unless the created container's HostConfig kept the seccomp option it was created with."""
    sent = [value for value in map(_seccomp_value, security_opt) if value is not None]
    kept = [
        value
        for value in map(_seccomp_value, container.attrs.get("HostConfig", {}).get("SecurityOpt") or [])
        if value is not None
    ]
    if not all(any(_same_profile(k, s) for k in kept) for s in sent):
        raise SandboxError(
            f"the engine dropped the seccomp profile from container {container.short_id} "
            f"(HostConfig.SecurityOpt: {[_shorten(k) for k in kept]})"
        )


def _shorten(text: str, limit: int = 300) -> str:
    """An engine's message without the profile's JSON echoed back in full."""
    text = text.replace(seccomp.profile_json(), "<profile JSON>")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _code_archive(code: str, stdin: str) -> bytes:
    """A tar of /sandbox/{main.py,stdin}, read-only for everyone, without trailing padding.

    tarfile pads archives to a 10 KiB record. Podman's put_archive pipes the
    body into an untar helper that exits at the end-of-archive marker, so the
    padding written after it fails at random with "passing bulk input to
    subprocess: write |1: broken pipe" (6 of 60 puts here, podman 4.3). The archive
    ends at the marker instead.
    """
    buffer = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        folder = tarfile.TarInfo(_CODE_DIR)
        folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o555, now
        tar.addfile(folder)
        for name, text in (("main.py", code), ("stdin", stdin)):
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"{_CODE_DIR}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o444, now
            tar.addfile(info, io.BytesIO(data))
    # After close(), `offset` counts the members and the end-of-archive marker, not the padding.
    return buffer.getvalue()[: tar.offset]


def _drain(stream: Iterable[tuple[bytes | None, bytes | None]], output: CappedOutput) -> None:
    """Read (stdout, stderr) frames until the stream ends or the output cap is reached."""
    try:
        for out, err in stream:
            if out and not output.add(out, stderr=False):
                return
            if err and not output.add(err, stderr=True):
                return
    except (OSError, ValueError):
        # The stream was closed under us (timeout or cap): that is how reading is cancelled.
        return


def _close_stream(stream: CancellableStream) -> None:
    """Shut the stream's socket (this also wakes a blocked read), then release its HTTP response.

    CancellableStream.close() alone leaves the response's file object holding
    the socket's descriptor until garbage collection.
    """
    stream.close()
    stream._response.close()


def _kill(container: Container) -> None:
    try:
        container.kill()
    except docker.errors.APIError as exc:
        # It exited between the deadline and the kill.
        logger.debug("kill of %s: %s", container.short_id, exc)


def _wait(container: Container) -> int | None:
    try:
        return int(container.wait(timeout=_GRACE_S)["StatusCode"])
    except (docker.errors.DockerException, requests.RequestException) as exc:
        logger.warning("sandbox container %s did not report its exit: %s", container.short_id, exc)
        _kill(container)
        return None


def _remove(container: Container) -> None:
    try:
        container.remove(force=True)
    except (docker.errors.DockerException, requests.RequestException) as exc:
        logger.warning("could not remove sandbox container %s (label relax_gym.sandbox=1): %s", container.short_id, exc)
