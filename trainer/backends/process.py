"""`ProcessBackend`: the training backend in a child process of its own (`trainer.own_process: true`).

In one process the trainer, the embedded engine and the rollout manager share one GIL. With a small
model every role is mostly Python, so an async run on two cores cannot overlap them: measured on the
quickstart's setting, the trainer's step grew by a third while the engine and the event loop ran
beside it (benchmarks/RESULTS.md). A child process has its own interpreter, so the trainer's Python
runs beside the rollout's instead of taking turns with it.

The child is spawned (no fork of a process that holds threads and torch state), so a script that
starts a run must guard its entry point with `if __name__ == "__main__":`, as for any spawned
worker (the `relax-gym` command does). It builds the same backend `make_backend` builds, placed on
`cpu.trainer`'s cores, and answers the `TrainBackend` calls sent over a pipe, one at a time
(`backends.forwarding`: this is its pipe transport). Arguments and results travel by cloudpickle (a loss
function may be a closure); tensors by value, except the weights, which the child writes into shared memory.
An exception in the child is re-raised here as itself, with the child's traceback in its notes; a child that
dies ends the call with `TrainerProcessError`, naming its exit code.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing  # registers the shared-memory tensor reductions with ForkingPickler

from relax_gym.cpu.threads import ThreadPlacement
from relax_gym.errors import RunStopped
from relax_gym.trainer.backends.forwarding import Forwarder, answer

__all__ = ["ProcessBackend", "TrainerProcessError"]


class TrainerProcessError(RunStopped):
    """The trainer's child process died: the run stops, keeping its checkpoints, and resumes when rerun."""

#: how often a waiting call checks that the child is still alive
POLL_S = 1.0


def _serve(conn: Connection, cfg_json: str, placement: ThreadPlacement) -> None:
    """The child: builds the backend, then answers (method, args, kwargs) until told to stop (`answer`, and the
    two calls that move the weights through shared memory)."""
    placement.apply()
    from relax_gym.trainer.config import TrainConfig
    from relax_gym.trainer.policy import load_policy, make_backend

    try:
        cfg = TrainConfig.model_validate_json(cfg_json)
        backend = make_backend(cfg, load_policy(cfg))
    except BaseException as err:  # the parent hears why the child could not start
        conn.send_bytes(cloudpickle.dumps((False, _with_trace(err))))
        return
    conn.send_bytes(cloudpickle.dumps((True, backend.version)))
    shared: dict[str, torch.Tensor] = {}  # the weights in shared memory (`ProcessBackend.hf_state_dict`)
    while True:
        method, args, kwargs = cloudpickle.loads(conn.recv_bytes())
        if method == "stop":
            return
        dumps = cloudpickle.dumps
        try:
            if method == "share_weights":  # once: shared-memory copies, sent as handles (ForkingPickler)
                shared = {name: tensor.detach().to("cpu", copy=True).share_memory_()
                          for name, tensor in backend.hf_state_dict().items()}
                reply: tuple[bool, Any] = (True, (shared, backend.version))
                dumps = ForkingPickler.dumps
            elif method == "export_weights":  # each step after: the weights written into the shared copies
                for name, tensor in backend.hf_state_dict().items():
                    shared[name].copy_(tensor)
                reply = (True, (None, backend.version))
            else:
                reply = (True, answer(backend, method, args, kwargs))
        except BaseException as err:
            reply, dumps = (False, _with_trace(err)), cloudpickle.dumps
        conn.send_bytes(dumps(reply))


def _with_trace(err: BaseException) -> BaseException:
    """`err` carrying the child's traceback as a note (tracebacks do not cross processes)."""
    err.add_note("in the trainer process:\n" + "".join(traceback.format_exception(err)).rstrip())
    return err


class ProcessBackend(Forwarder):
    """`TrainBackend` over the backend `make_backend(cfg, ...)` builds, run in a spawned child process."""

    def __init__(self, cfg: Any, placement: ThreadPlacement | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, cfg.model_dump_json(), placement or ThreadPlacement()),
                                    name="relax-gym-trainer", daemon=True)
        self._process.start()
        child.close()
        ok, value = self._receive("start")
        if not ok:
            self._process.join(10)
            raise value
        super().__init__(value)
        self._shared: dict[str, torch.Tensor] | None = None  # the child's weights in shared memory

    def _died(self, method: str) -> TrainerProcessError:
        self._process.join(5)  # reaped, so its exit code is known
        return TrainerProcessError(f"the trainer process died (exit code {self._process.exitcode}) during {method}; "
                                   "the run keeps its checkpoints and resumes from the last one when rerun")

    def _receive(self, method: str) -> tuple[bool, Any]:
        try:
            while not self._conn.poll(POLL_S):
                if not self._process.is_alive():
                    raise self._died(method)
            return cloudpickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise self._died(method) from None

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
        try:
            self._conn.send_bytes(cloudpickle.dumps((method, args, kwargs)))
        except OSError:  # the pipe broke: the child is gone
            raise self._died(method) from None
        ok, value = self._receive(method)
        if not ok:
            raise value
        return value

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The child writes its weights into shared memory (set up on the first call) and this process copies
        them out: no pickling of the weights on either side, which in an async run cost the rollout's process
        milliseconds of its GIL each step."""
        if self._shared is None:
            self._shared = self._call("share_weights")
        else:
            self._call("export_weights")
        return {name: tensor.clone() for name, tensor in self._shared.items()}

    def close(self) -> None:
        """Stops the child (it finishes the call it is in first); a child that does not stop is killed."""
        if self._process.is_alive():
            with contextlib.suppress(OSError):  # the child went away in between
                self._conn.send_bytes(cloudpickle.dumps(("stop", (), {})))
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        self._conn.close()
