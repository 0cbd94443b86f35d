"""Latency of one sandbox run of `print(1)`: a fresh container vs the subprocess fallback.

The container's price is isolation: create, put the code, start, attach,
wait and remove per run. This measures it end to end, as a tool call sees it.

    python benchmarks/sandbox_latency.py [N]
"""

from __future__ import annotations

import statistics
import sys
import time

from relax_gym.sandbox import SandboxConfig, SandboxUnavailableError
from relax_gym.sandbox.container import ContainerBackend
from relax_gym.sandbox.local import SubprocessBackend

CODE = "print(1)"


def _latencies(backend: ContainerBackend | SubprocessBackend, n: int) -> dict[str, float]:
    backend.run(CODE, timeout_s=30, stdin=None)  # warm-up: first-use costs are not per-run costs
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        result = backend.run(CODE, timeout_s=30, stdin=None)
        samples.append(time.perf_counter() - started)
        if not result.ok:
            raise RuntimeError(f"{backend.name} run failed:\n{result.summary()}")
    return {
        "median_s": statistics.median(samples),
        "p90_s": statistics.quantiles(samples, n=10, method="inclusive")[-1],
    }


def measure(n: int = 20) -> dict:
    """Median and p90 seconds per run for each backend, and container/subprocess (of the medians).

    `container` is None (with `container_unavailable` saying why) where no engine answers.
    """
    config = SandboxConfig(require_container=True)
    local = SubprocessBackend(config)
    results: dict = {"n": n, "subprocess": _latencies(local, n)}
    try:
        container = ContainerBackend(config)
    except SandboxUnavailableError as exc:
        results.update(container=None, container_unavailable=str(exc), ratio=None)
        return results
    try:
        results["container"] = _latencies(container, n)
    finally:
        container.close()
    results["ratio"] = results["container"]["median_s"] / results["subprocess"]["median_s"]
    return results


def markdown(results: dict) -> str:
    lines = [
        f"Sandbox latency per run of `{CODE}` (n={results['n']})",
        "",
        "| backend | median (s) | p90 (s) |",
        "|---|---|---|",
    ]
    for name in ("container", "subprocess"):
        row = results.get(name)
        if row is None:
            lines.append(f"| {name} | unavailable | {results['container_unavailable']} |")
        else:
            lines.append(f"| {name} | {row['median_s']:.3f} | {row['p90_s']:.3f} |")
    if results["ratio"] is not None:
        lines += ["", f"container / subprocess (medians): {results['ratio']:.1f}x"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 20)))
