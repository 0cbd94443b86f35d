"""A launched server's process: `kill_with_parent` ends it with the process that started it."""

from __future__ import annotations

import subprocess
import sys
import time

from relax_gym.engines.http_engine import kill_with_parent

STARTER = """
import subprocess, sys
from relax_gym.engines.http_engine import kill_with_parent
print(subprocess.Popen(kill_with_parent(["sleep", "60"])).pid, flush=True)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            state = next(line for line in status if line.startswith("State:")).split()[1]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, waiting for a parent to reap it


def test_a_server_started_with_kill_with_parent_ends_with_the_process_that_started_it() -> None:
    pid = int(subprocess.run([sys.executable, "-c", STARTER], capture_output=True, text=True, check=True).stdout)
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


def test_kill_with_parent_runs_the_command_itself_under_the_same_pid() -> None:
    process = subprocess.Popen(kill_with_parent(["sh", "-c", 'echo "$$"']), stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=10)
    assert int(out) == process.pid  # the launcher became the server: stop() signals the server's own pid
