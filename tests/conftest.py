"""Fixtures shared across test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from relax_gym.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError


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
