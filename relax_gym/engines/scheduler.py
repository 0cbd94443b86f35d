"""What the embedded engine's two schedulers share: the worker thread's body (`Scheduler.run`), applying weight
updates while nothing runs, and answering a finished request.

The worker is the only thread that touches the model, so it needs no lock around it; a bug in the worker itself
answers every caller with an EngineError rather than leaving one waiting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import PreTrainedModel

from relax_gym.cpu.threads import ThreadPlacement, release_openmp_workers
from relax_gym.engines.base import EngineError, GenerateOutput, RequestError
from relax_gym.engines.hf_generation import BatchInputs
from relax_gym.engines.model_weights import ModelWeights
from relax_gym.engines.request_queue import Job, RequestQueue
from relax_gym.engines.resident_adapters import ResidentAdapters
from relax_gym.models.moe_routing import recording


@dataclass(eq=False, kw_only=True)
class Scheduler(ABC):
    """Takes jobs off `queue` and decodes them on `model`; what it decodes with is fixed when the engine is built."""

    queue: RequestQueue
    weights: ModelWeights
    inputs: BatchInputs
    model: PreTrainedModel
    adapters: ResidentAdapters
    device: torch.device
    generator: torch.Generator
    eos_token_ids: frozenset[int]
    #: token ids never sampled: the media placeholders, which have no features behind them in an output
    never: tuple[int, ...]
    decode: Callable[[list[int]], str]
    pad_token_id: int
    placement: ThreadPlacement

    def run(self) -> None:
        """The worker thread's body, in `placement`."""
        self.placement.apply()
        try:
            self.serve()
        except Exception as err:  # a bug in the worker itself: every caller hears of it, none is left waiting
            failure = EngineError(f"the embedded engine's worker failed: {err!r}")
            queue = self.queue
            with queue.cond:
                queue.closed = True
                jobs = [*self.held(), *queue.jobs]
                queue.jobs.clear()
                queue.cond.notify_all()
            for job in jobs:
                job.resolve(failure)
            queue.drain(self.weights.version)
            raise

    @abstractmethod
    def serve(self) -> None:
        """Runs batches until the engine closes, then drains the queue."""

    def held(self) -> list[Job]:
        """The jobs this scheduler holds unanswered, handed over (it forgets them) for a failed worker to answer."""
        return []

    def wait_for_jobs(self) -> bool:
        """With nothing running: applies weight updates as they come, and returns once there are jobs to take
        (True) or the engine is closed (False)."""
        queue = self.queue
        while True:
            if not queue.has_work():  # idle: its OpenMP workers would slow whoever computes (`cpu_threads`)
                release_openmp_workers()
            with queue.cond:
                queue.cond.wait_for(queue.has_work)
                if queue.closed:
                    return False
                update = queue.updates.popleft() if queue.updates else None
            if update is None:
                return True
            self.weights.apply(update)

    def answer(self, job: Job, output: GenerateOutput) -> None:
        """Resolves `job` with `output`, and its routed experts when it asked for them."""
        if job.request.return_routed_experts:
            try:
                output = replace(output, routed_experts=self._routed_experts(job, output.output_ids))
            except Exception as err:  # this request's failure, not the batch's
                job.resolve(EngineError(f"routed experts of request {job.request.rid!r}: {err!r}"))
                return
        job.resolve(output)

    def _routed_experts(self, job: Job, output_ids: list[int]) -> np.ndarray:
        """SGLang's layout ([token, layer, top_k] int32, flat) of the sequence the model ran: prompt and output
        but the last token. One forward of that sequence, on the weights and in the dtype that generated it (an
        update waits for the batch to empty), rather than the decode steps' own routes, which would need every
        row tracked through the running batch's padding; the two differ only by floating-point order (a
        token's route does not depend on its batch)."""
        ran = [*job.request.input_ids, *output_ids][:-1]
        if not ran:
            return np.empty(0, dtype=np.int32)
        inputs = self.inputs.build([ran], [job.mm_inputs])
        with recording(self.model) as routes, torch.no_grad(), self.adapters.rows(job.request.adapter):
            self.model(**inputs)
        return torch.stack([layer[0] for layer in routes], dim=1).to(torch.int32).cpu().numpy().reshape(-1)


def failed_alone(job: Job, err: Exception) -> EngineError:
    """The error of a request that failed in a batch of its own. A ValueError there is the request's: the model's
    or the sampler's check of its inputs (media that miss their placeholders, a number past a C type), so it is a
    `RequestError` (a 400 from `relax-gym serve`)."""
    kind = RequestError if isinstance(err, ValueError) else EngineError
    return kind(f"generation failed for request {job.request.rid!r}: {err!r}")
