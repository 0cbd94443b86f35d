"""Limits and engine settings of the code-execution sandbox."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_IMAGE = "localhost/relax-gym-sandbox:latest"


class SandboxConfig(BaseModel):
    """What code run by `Sandbox` may use, and where it runs.

    The defaults suit short tool calls from a model (a calculation, a small
    script): a quarter GiB of memory, one CPU, ten seconds, 64 KiB of output.
    Every limit applies per run; each run gets a fresh container.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = Field(
        DEFAULT_IMAGE,
        description="Image with python3 on PATH; scripts/build_sandbox_image.sh builds the default offline.",
    )
    docker_url: str | None = Field(
        None,
        description="Docker-API engine URL (unix:///..., tcp://...); None tries DOCKER_HOST, "
        "podman's root socket, then Docker's.",
    )
    memory_mb: int = Field(256, ge=32, description="Memory limit (RAM, no swap), tmpfs writes included.")
    cpus: float = Field(1.0, gt=0, description="CPU share, in cores.")
    pids: int = Field(64, ge=4, description="Most processes/threads alive at once (fork bombs stop here).")
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one run, killed past it.")
    output_limit_bytes: int = Field(
        64 * 1024, ge=256, description="Most stdout+stderr bytes kept; the run is killed past it."
    )
    scratch_mb: int = Field(64, ge=1, description="Size of the writable /scratch (and /tmp) tmpfs.")
    require_container: bool = Field(
        False, description="Raise SandboxUnavailableError instead of falling back to a subprocess."
    )
    user: str = Field("65534:65534", description="uid:gid the code runs as inside the container (non-root).")
