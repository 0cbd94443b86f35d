"""The code-execution sandbox: containment against a real engine, and the subprocess fallback.

Container tests (marker `container`) run against whatever Docker-API engine
answers (`bash scripts/start_podman.sh && bash scripts/build_sandbox_image.sh`
here); they skip without one, unless RELAX_GYM_REQUIRE_CONTAINER=1 (CI), where
they fail. Each attack must be both contained and reported in the ExecResult.
Nothing asserts timings: pytest-timeout only guards against hangs.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import docker
import pytest
from pydantic import ValidationError

from relax_gym.sandbox import (
    ExecResult,
    Sandbox,
    SandboxConfig,
    SandboxFallbackWarning,
    SandboxUnavailableError,
    shared_sandbox,
)

pytestmark = pytest.mark.timeout(60)

BOGUS_ENGINE = "unix:///nonexistent/relax-gym-test.sock"


@pytest.fixture(scope="module")
def box(container_sandbox: Sandbox) -> Sandbox:
    """A container-backed sandbox with the default limits (tests/conftest.py)."""
    return container_sandbox


@pytest.fixture(scope="module")
def local() -> Iterator[Sandbox]:
    """The subprocess fallback, reached the way users reach it: no engine at the configured URL."""
    with pytest.warns(SandboxFallbackWarning):
        sandbox = Sandbox(SandboxConfig(docker_url=BOGUS_ENGINE))
    yield sandbox
    sandbox.close()


@pytest.mark.container
class TestContainer:
    def test_runs_code(self, box: Sandbox) -> None:
        result = box.run("print(6 * 7)")
        assert box.backend == "container"
        assert result.ok and result.backend == "container"
        assert result.stdout == "42\n" and result.stderr == ""
        assert "42" in result.summary()

    def test_stdin(self, box: Sandbox) -> None:
        result = box.run("import sys; print(sys.stdin.read().upper())", stdin="héllo\nworld")
        assert result.ok and result.stdout == "HÉLLO\nWORLD\n"

    def test_exception_gives_traceback(self, box: Sandbox) -> None:
        result = box.run("def f():\n    raise ValueError('boom')\nf()")
        assert not result.ok and result.exit_code == 1
        assert "Traceback" in result.stderr and "ValueError: boom" in result.stderr
        assert "ValueError: boom" in result.summary()

    def test_code_larger_than_an_argument(self, box: Sandbox) -> None:
        # 300 KB of source: more than the kernel's 128 KiB cap on one argv string.
        code = "x = 0\n" + "x += 1\n" * 40_000 + "print(x)\n"
        assert len(code) > 128 * 1024
        result = box.run(code)
        assert result.ok and result.stdout == "40000\n"

    def test_full_stdlib(self, box: Sandbox) -> None:
        result = box.run("import json, asyncio, multiprocessing, sqlite3, decimal; print(json.dumps([1]))")
        assert result.ok, result.stderr

    def test_network_is_off(self, box: Sandbox) -> None:
        # A server on the host's loopback: the container has its own, empty one.
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            code = f"""
import socket
print("interfaces", sorted(name for _, name in socket.if_nameindex()))
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3)
    print("loopback connected")
except OSError as exc:
    print("loopback refused", type(exc).__name__)
try:
    socket.getaddrinfo("example.com", 80)
    print("dns resolved")
except OSError as exc:
    print("dns failed", type(exc).__name__)
"""
            result = box.run(code)
        assert result.ok, result.stderr
        assert "interfaces ['lo']" in result.stdout
        assert "loopback refused" in result.stdout
        assert "dns failed" in result.stdout

    def test_writes_only_in_scratch(self, box: Sandbox) -> None:
        code = """
import os
for path in ["/evil", "/etc/evil", "/usr/evil", "/sandbox/evil", "/run/evil", "/scratch/ok", "/tmp/ok"]:
    try:
        with open(path, "w") as fh:
            fh.write("x")
        print(path, "written")
    except OSError as exc:
        print(path, "refused", exc.errno)
print("cwd", os.getcwd())
"""
        result = box.run(code)
        assert result.ok, result.stderr
        for path in ["/evil", "/etc/evil", "/usr/evil", "/sandbox/evil", "/run/evil"]:
            assert f"{path} refused" in result.stdout
        assert "/scratch/ok written" in result.stdout and "/tmp/ok written" in result.stdout
        assert "cwd /scratch" in result.stdout

    def test_scratch_is_size_capped(self, box: Sandbox) -> None:
        code = """
try:
    with open("/scratch/big", "wb") as fh:
        for _ in range(200):
            fh.write(b"x" * 2**20)
    print("wrote 200 MiB")
except OSError as exc:
    print("stopped", exc.errno)
"""
        result = box.run(code)
        assert "stopped" in result.stdout or result.oom_killed, result.summary()
        assert "wrote 200 MiB" not in result.stdout

    def test_fork_bomb_stops_at_pids_limit(self, box: Sandbox) -> None:
        code = """
import os, time
children = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children += 1
print(children)
"""
        result = box.run(code, timeout_s=20)
        assert result.ok, result.summary()
        assert int(result.stdout) < box.config.pids

    def test_endless_fork_bomb_is_killed(self, box: Sandbox) -> None:
        code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        result = box.run(code, timeout_s=3)
        assert not result.ok
        assert result.timed_out, result.summary()
        assert box.run("print('still fine')").ok

    def test_memory_bomb_is_oom_killed(self, box: Sandbox) -> None:
        result = box.run("hog = []\nwhile True:\n    hog.append(b'x' * 10**7)\n", timeout_s=30)
        assert result.oom_killed and not result.timed_out, result.summary()
        assert result.exit_code == 137 and not result.ok
        assert "[killed: memory limit]" in result.summary()

    def test_infinite_loop_times_out(self, box: Sandbox) -> None:
        result = box.run("print('started', flush=True)\nwhile True:\n    pass\n", timeout_s=2)
        assert result.timed_out and not result.ok and not result.oom_killed
        assert result.stdout == "started\n"  # output before the kill is kept
        assert "[timed out after 2s]" in result.summary()

    def test_silent_sleep_times_out(self, box: Sandbox) -> None:
        result = box.run("import time\ntime.sleep(600)", timeout_s=2)
        assert result.timed_out and not result.ok

    def test_huge_output_is_capped(self, box: Sandbox) -> None:
        code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\n"
        tracemalloc.start()
        try:
            result = box.run(code, timeout_s=30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert result.output_truncated and not result.ok and not result.oom_killed
        assert len(result.stdout) + len(result.stderr) <= box.config.output_limit_bytes
        assert peak < 16 * 2**20, f"reading 100 MB of output peaked at {peak} bytes of host memory"
        assert "[output truncated]" in result.summary()

    def test_host_files_are_invisible(self, box: Sandbox, tmp_path) -> None:
        secret = tmp_path / "secret.txt"
        token = secrets.token_hex(16)
        secret.write_text(token)
        code = f"""
import os
print("exists", os.path.exists({str(secret)!r}))
print("hostname", open("/etc/hostname").read().strip())
print("processes", len([p for p in os.listdir("/proc") if p.isdigit()]))
print("uid", os.getuid())
print([line for line in open("/proc/self/status") if line.startswith("CapEff")][0].strip())
"""
        result = box.run(code)
        assert result.ok, result.stderr
        assert token not in result.stdout
        assert "exists False" in result.stdout
        assert f"hostname {socket.gethostname()}" not in result.stdout
        assert int(result.stdout.split("processes ")[1].split()[0]) < 5  # its own PID namespace
        assert "uid 65534" in result.stdout  # not root
        assert "CapEff:\t0000000000000000" in result.stdout  # no capabilities

    def test_concurrent_runs(self, box: Sandbox) -> None:
        code = "import sys, time\ntime.sleep(0.5)\nprint(int(sys.stdin.read()) ** 2)"
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: box.run(code, stdin=str(i)), range(4)))
        assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(4)]
        assert all(r.ok for r in results)

    def test_arun(self, box: Sandbox) -> None:
        async def main() -> list[ExecResult]:
            return await asyncio.gather(*(box.arun(f"print({i})") for i in range(3)))

        assert [r.stdout for r in asyncio.run(main())] == ["0\n", "1\n", "2\n"]

    def test_missing_image_is_unavailable(self, box: Sandbox) -> None:
        config = SandboxConfig(require_container=True, image="localhost/relax-gym-no-such-image:latest")
        with pytest.raises(SandboxUnavailableError, match=r"build_sandbox_image\.sh"):
            Sandbox(config)

    def test_ordinary_programs_run_under_the_profile(self, box: Sandbox) -> None:
        # relax_gym's seccomp profile is an allowlist (relax_gym/sandbox/seccomp.py): what ordinary
        # programs do must stay on it. glibc's threads and fork go through clone3, refused, then clone.
        code = r"""
import asyncio, concurrent.futures, ctypes, json, multiprocessing as mp, os, pty, select, signal, socket
import sqlite3, subprocess, sys, threading, time
from multiprocessing import shared_memory

def square(x):
    return x * x

def main():
    out = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out["threads"] = sum(pool.map(square, range(10)))
    out["shell"] = subprocess.run("ls / | sort | head -1; timeout 5 sleep 0.01", shell=True,
                                  capture_output=True, text=True).stdout.split()
    out["posix_spawn"] = os.waitpid(os.posix_spawn("/bin/true", ["true"], os.environ), 0)[1]
    for method in ("fork", "spawn", "forkserver"):
        with mp.get_context(method).Pool(2) as pool:
            out[method] = sum(pool.map(square, range(10)))
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        out["process pool"] = sum(pool.map(square, range(10)))
    shm = shared_memory.SharedMemory(create=True, size=64)
    shm.buf[0] = 7
    out["shared_memory"] = shm.buf[0]
    shm.close()
    shm.unlink()

    async def tcp_echo():
        async def handle(reader, writer):
            writer.write(await reader.read(5))
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        writer.write(b"hello")
        echoed = await reader.read(5)
        writer.close()
        server.close()
        child = await asyncio.create_subprocess_exec("echo", "hi", stdout=asyncio.subprocess.PIPE)
        return echoed.decode(), (await child.communicate())[0].decode().strip()

    out["asyncio"] = asyncio.run(tcp_echo())
    db = sqlite3.connect("/scratch/db.sqlite")
    db.execute("pragma journal_mode=wal")
    db.execute("create table t (x)")
    db.executemany("insert into t values (?)", [(i,) for i in range(10)])
    out["sqlite"] = db.execute("select sum(x) from t").fetchone()[0]
    compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))(
        lambda a, b: a[0] - b[0])
    numbers = (ctypes.c_int * 3)(3, 1, 2)
    ctypes.CDLL(None).qsort(numbers, 3, ctypes.sizeof(ctypes.c_int), compare)
    out["ctypes callback"] = list(numbers)
    os.close(os.memfd_create("m"))
    os.close(os.eventfd(0))
    child = os.fork()
    if child == 0:
        os._exit(3)
    pidfd = os.pidfd_open(child)
    select.select([pidfd], [], [], 10)
    out["pidfd"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    fired = []
    signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.01)
    time.sleep(0.5)
    out["timer"] = fired
    parent, tty = pty.openpty()
    os.write(parent, b"x\n")
    out["pty"] = os.read(tty, 2).decode()
    a, b = socket.socketpair()
    a.send(b"y")
    out["socketpair"] = b.recv(1).decode()
    out["interfaces"] = [name for _, name in socket.if_nameindex()]
    print(json.dumps(out))

if __name__ == "__main__":
    main()
"""
        result = box.run(code, timeout_s=60)
        assert result.ok, result.summary()
        assert json.loads(result.stdout) == {
            "threads": 285,
            "shell": ["bin"],
            "posix_spawn": 0,
            "fork": 285,
            "spawn": 285,
            "forkserver": 285,
            "process pool": 285,
            "shared_memory": 7,
            "asyncio": ["hello", "hi"],
            "sqlite": 45,
            "ctypes callback": [1, 2, 3],
            "pidfd": 3,
            "timer": [1],
            "pty": "x\n",
            "socketpair": "y",
            "interfaces": ["lo"],
        }

    def test_no_container_left_behind(self, box: Sandbox) -> None:
        # Defined last: runs after the others in this class.
        client = docker.DockerClient(base_url=box.engine_url)
        try:
            left = client.containers.list(all=True, filters={"label": "relax_gym.sandbox=1"})
        finally:
            client.close()
        assert left == []


class TestSubprocessFallback:
    def test_runs_code(self, local: Sandbox) -> None:
        result = local.run("import sys; print(sys.stdin.read() * 2)", stdin="ab")
        assert local.backend == "subprocess" and local.engine_url is None
        assert result.ok and result.backend == "subprocess" and result.stdout == "abab\n"

    def test_exception_gives_traceback(self, local: Sandbox) -> None:
        result = local.run("1 / 0")
        assert result.exit_code == 1 and "ZeroDivisionError" in result.stderr

    def test_timeout(self, local: Sandbox) -> None:
        result = local.run("while True:\n    pass\n", timeout_s=2)
        assert result.timed_out and not result.ok

    def test_leftover_child_does_not_hold_the_run(self, local: Sandbox) -> None:
        # The child inherits the pipes; the run must end when the main process does.
        code = "import subprocess\nsubprocess.Popen(['sleep', '60'])"
        result = local.run(code, timeout_s=30)
        assert result.ok and not result.timed_out

    def test_output_cap(self, local: Sandbox) -> None:
        result = local.run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n")
        assert result.output_truncated and not result.ok
        assert len(result.stdout) == local.config.output_limit_bytes

    def test_memory_limit(self, local: Sandbox) -> None:
        result = local.run("x = bytearray(2 * 1024**3)")
        assert not result.ok and "MemoryError" in result.stderr

    def test_clean_env_and_fresh_dir(self, local: Sandbox, monkeypatch) -> None:
        monkeypatch.setenv("RELAX_GYM_TEST_SECRET", "hunter2")
        result = local.run("import os\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(os.listdir())")
        assert result.ok, result.stderr
        assert "RELAX_GYM_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout
        _, cwd, listing = result.stdout.splitlines()
        assert cwd != os.getcwd() and "relax-gym-sandbox-" in cwd
        assert "main.py" in listing
        assert not os.path.exists(cwd)  # removed after the run

    def test_concurrent_runs(self, local: Sandbox) -> None:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: local.run(f"print({i})"), range(8)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]

    def test_require_container_raises(self) -> None:
        with pytest.raises(SandboxUnavailableError, match="nonexistent"):
            Sandbox(SandboxConfig(docker_url=BOGUS_ENGINE, require_container=True))

    def test_fallback_warns_with_reason_and_remedy(self) -> None:
        with pytest.warns(SandboxFallbackWarning, match="NOT a security boundary") as record:
            Sandbox(SandboxConfig(docker_url=BOGUS_ENGINE)).close()
        message = str(record[0].message)
        assert BOGUS_ENGINE in message and "start_podman.sh" in message


def test_config_rejects_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        SandboxConfig(memory=256)


def test_summary_trims_long_output() -> None:
    result = ExecResult(
        stdout="a" * 10_000 + "END",
        stderr="",
        exit_code=0,
        timed_out=False,
        oom_killed=False,
        output_truncated=False,
        backend="subprocess",
        duration_s=0.1,
        timeout_s=10.0,
    )
    summary = result.summary(max_chars=300)
    assert summary.startswith("exit code: 0") and summary.rstrip().endswith("END")
    assert "chars omitted" in summary and len(summary) < 500


def test_envs_share_one_sandbox_per_config_and_a_math_env_runs_its_code_in_it():
    """Many episodes' envs, one sandbox: the engine is probed once per config in a process, not once per episode."""
    from relax_gym.envs.math import MathToolEnv

    config = SandboxConfig(timeout_s=7.0)
    sandbox = shared_sandbox(config)
    assert shared_sandbox(SandboxConfig(timeout_s=7.0)) is sandbox
    assert shared_sandbox(SandboxConfig(timeout_s=6.0)) is not sandbox
    envs = [MathToolEnv(sandbox_timeout_s=7.0) for _ in range(2)]
    assert all(env.sandbox_config == config for env in envs)
    assert [env.python("print(6 * 7)") for env in envs] == [sandbox.run("print(6 * 7)").summary()] * 2
