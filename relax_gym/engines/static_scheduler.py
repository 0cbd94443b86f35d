"""Static batching for the embedded engine (models with a processor, or `batching="static"`): the worker takes
everything pending (after a short coalescing window) and runs it as one left-padded `model.generate` call
(`hf_generation`), which runs until its last row stops while requests arriving meanwhile form the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_gym.engines.base import GenerateOutput
from relax_gym.engines.hf_generation import BatchDecoder, generate_sampled
from relax_gym.engines.request_queue import Job
from relax_gym.engines.scheduler import Scheduler, failed_alone


@dataclass(eq=False, kw_only=True)
class StaticScheduler(Scheduler):
    def serve(self) -> None:
        """One batch at a time; weight updates land between batches."""
        queue = self.queue
        while self.wait_for_jobs():
            queue.coalesce()
            with queue.cond:
                jobs = queue.take()
                queue.busy = bool(jobs)
            try:
                if jobs:
                    self._run(jobs, self.weights.version)
            finally:
                with queue.cond:
                    queue.busy = False
                    queue.cond.notify_all()
        queue.drain(self.weights.version)

    def _run(self, jobs: list[Job], version: int) -> None:
        """One batch; if it fails, its rows run one by one so a bad request fails alone."""
        try:
            outputs = self._generate(jobs, version)
        except Exception as err:
            if len(jobs) > 1:
                for job in jobs:
                    self._run([job], version)
                return
            jobs[0].resolve(failed_alone(jobs[0], err))
            return
        for job, output in zip(jobs, outputs, strict=True):
            self.answer(job, output)

    def _generate(self, jobs: list[Job], version: int) -> list[GenerateOutput]:
        for job in jobs:
            self.adapters.check(job.request.adapter)  # unloaded while the job was queued
        prompts = [job.request.input_ids for job in jobs]
        inputs = self.inputs.build(prompts, [job.mm_inputs for job in jobs])
        decoder = BatchDecoder(
            [job.request.sampling for job in jobs],
            eos=self.eos_token_ids,
            vocab=self.model.get_output_embeddings().out_features,
            device=self.device,
            generator=self.generator,
            decode=self.decode,
            aborted=lambda i: self.queue.ends(jobs[i]),
            never=self.never,
        )
        generate_sampled(self.model, inputs, decoder,
                         max_new_tokens=max(job.request.sampling.max_new_tokens for job in jobs),
                         eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                         rows=self.adapters.rows([job.request.adapter for job in jobs]))
        return [
            GenerateOutput(ids, lps, reason or "length", version, len(prompt))
            for ids, lps, reason, prompt in zip(
                decoder.output_ids, decoder.logprobs, decoder.reasons, prompts, strict=True
            )
        ]
