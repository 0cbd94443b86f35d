"""Every distributed-run test here reports itself before its deadline: when 80% of its pytest-timeout has passed,
each run it made prints its roles' states and last events, with every thread's stack, on the terminal; so a hang
under load says where it is (pytest-timeout then fails it, or tests/conftest.py's watchdog ends the suite)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from support.watchdog import TERMINAL_FD, describe_run, describe_tasks, dump_stacks, say

#: the share of a test's timeout after which it reports itself
REPORT_AT = 0.8


@pytest.fixture(autouse=True)
def report_before_the_deadline(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    try:
        from relax_gym.trainer.cluster.run import ClusterTrainer
    except ImportError:  # no Ray: this folder's Ray-free tests make no run
        yield
        return
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else request.config.getini("timeout") or 0)
    runs: list[Any] = []
    made = ClusterTrainer.__init__

    def remembered(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        runs.append(self)

    monkeypatch.setattr(ClusterTrainer, "__init__", remembered)
    fd = request.config.stash[TERMINAL_FD]

    def report() -> None:
        say(fd, f"\n{request.node.nodeid}: {REPORT_AT:.0%} of its {limit:g} s timeout passed; its runs:\n")
        for run in runs:
            say(fd, describe_run(run) + "\n")
        say(fd, describe_tasks() + "\n")
        dump_stacks(fd)

    timer = threading.Timer(limit * REPORT_AT, report)
    timer.daemon = True
    if limit > 0:
        timer.start()
    yield
    timer.cancel()
