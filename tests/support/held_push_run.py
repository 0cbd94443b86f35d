"""A distributed run, joined to a Ray cluster by address, whose weight push at one version is held in flight: the
engines' processes are stopped (SIGSTOP) before the push's calls are sent, so the calls wait in the engines'
queues while the test removes the trainer rank's node, then lets them go on (SIGCONT). Every node of Ray's
multi-node test cluster is a raylet on this machine, which is what lets a driver signal an engine's process.

    python tests/support/held_push_run.py RUN_DIR ADDRESS HOLD_AT [KEY=VALUE ...]

Writes RUN_DIR/push_in_flight ({"version", "engine_pids"}) once every engine's call of version HOLD_AT is sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax_gym.trainer.cluster.ray_handles import call
from relax_gym.trainer.cluster.run import ClusterTrainer
from support.cluster import config

#: how long after the last call is sent the marker is written (the calls leave this process on Ray's threads)
SENT_GRACE_S = 0.5


class HeldPush(ClusterTrainer):
    """Holds the push of version `hold_at` in flight: its calls sent to stopped engine processes."""

    def __init__(self, cfg: Any, hold_at: int):
        super().__init__(cfg)
        self.hold_at = hold_at
        self.held = False

    async def _publish(self) -> None:
        if self.held or self.backend.version != self.hold_at:
            return await super()._publish()
        self.held = True
        active = [s for s in self.fleet.slots.values() if s.state == "ACTIVE"]
        pids = [int((await call(s.actor.ready))["pid"]) for s in active]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        sent: list[str] = []
        load = self.fleet._load

        async def counted(slot: Any, weights: Any, version: int) -> int:
            pending = load(slot, weights, version)  # its call is sent at its first step, below
            sent.append(slot.engine_id)
            if len(sent) == len(active):
                asyncio.get_running_loop().call_later(SENT_GRACE_S, mark)
            return await pending

        def mark() -> None:
            (self.run_dir / "push_in_flight").write_text(json.dumps({"version": self.hold_at, "engine_pids": pids}))

        self.fleet._load = counted  # type: ignore[method-assign]
        try:
            await super()._publish()
        finally:
            self.fleet._load = load  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    run_dir, address, hold_at, overrides = Path(argv[0]), argv[1], int(argv[2]), argv[3:]
    cfg = config(run_dir, f"cluster.address={address}", *overrides)
    summary = asyncio.run(HeldPush(cfg, hold_at).run())
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
