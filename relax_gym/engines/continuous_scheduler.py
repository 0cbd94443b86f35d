"""Continuous batching for the embedded engine (text-only models): each step, queued requests (up to
`max_batch_size` rows in all) are prefilled and join the running batch (`RunningBatch`), and rows leave it as
they stop, so a short request never waits for a long one.

Rows sample with the same `RowSampler` as static batching, so a seeded request gets the same tokens either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relax_gym.engines.base import EngineError, GenerateOutput
from relax_gym.engines.continuous import RunningBatch
from relax_gym.engines.request_queue import Job
from relax_gym.engines.sampling import RowSampler, seeded_generators
from relax_gym.engines.scheduler import Scheduler, failed_alone
from relax_gym.engines.stopping import finish_reason


@dataclass(eq=False)
class Row:
    """One request decoding in the running batch."""

    job: Job
    #: the weights it decodes with: updates wait for an empty batch, so it is the version it started on
    version: int
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(eq=False, kw_only=True)
class ContinuousScheduler(Scheduler):
    #: the running batch's rows, and the jobs joining it (the worker's own, read after it fails)
    rows: list[Row] = field(default_factory=list, init=False)
    admitting: list[Job] = field(default_factory=list, init=False)

    def held(self) -> list[Job]:
        jobs = [*self.admitting, *(row.job for row in self.rows)]
        self.admitting.clear()
        self.rows.clear()
        return jobs

    def serve(self) -> None:
        """One running batch: queued requests join it every step, finished rows leave it at once.

        Nothing joins while a weight update waits, so the running rows finish on the weights they
        started with (each output has one version) and the update lands when the batch is empty,
        as between static batches; a pause likewise lets the running rows finish.
        """
        queue, rows = self.queue, self.rows
        batch = RunningBatch(self.model, self.pad_token_id)
        while True:
            if not rows:
                with queue.cond:
                    queue.busy = False
                    queue.cond.notify_all()
                if not self.wait_for_jobs():
                    break
                queue.coalesce()
            with queue.cond:
                jobs = [] if queue.updates or queue.closed else queue.take(queue.max_batch_size - len(rows))
                queue.busy = bool(jobs or rows)
            if jobs:
                self.admitting[:] = jobs
                self._admit(batch, rows, jobs)
                self.admitting.clear()
            if rows:
                self._advance(batch, rows)
        queue.drain(self.weights.version)

    def _admit(self, batch: RunningBatch, rows: list[Row], jobs: list[Job]) -> None:
        """Prefills `jobs`, samples their first tokens and adds the rows that go on to `batch`; a prefill, a
        seed or a first sample that fails is retried one job at a time, so a bad request fails alone and the
        worker never dies of a request's error. Jobs of different adapters prefill apart (a shared prompt
        prefix runs once for a group: its cache is its adapter's)."""
        groups: dict[str | None, list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.request.adapter, []).append(job)
        if len(groups) > 1:
            for group in groups.values():
                self._admit(batch, rows, group)
            return
        adapter = jobs[0].request.adapter
        try:
            self.adapters.check(adapter)  # unloaded while the job was queued
            with self.adapters.rows(adapter):
                joining, logits = batch.prefill([job.request.input_ids for job in jobs],
                                                room=[max(0, job.request.sampling.max_new_tokens - 1)
                                                      for job in jobs])
            new = [Row(job, self.weights.version, seeded_generators([job.request.sampling], self.device)[0])
                   for job in jobs]
            going, tokens = self._sample(new, logits)
        except Exception as err:
            if len(jobs) > 1:
                for job in jobs:
                    self._admit(batch, rows, [job])
                return
            jobs[0].resolve(failed_alone(jobs[0], err))
            return
        if going:  # rows that ended on their first token never join
            order = joining.keep(going)
            joining.last = tokens[order]
            rows += [new[i] for i in order]
            batch.join(joining)

    def _advance(self, batch: RunningBatch, rows: list[Row]) -> None:
        """One decode step of every running row; a step that fails ends them all with its error."""
        try:
            with self.adapters.rows([row.job.request.adapter for row in rows]):
                logits = batch.step()
        except Exception as err:
            for row in rows:
                row.job.resolve(EngineError(f"generation failed for request {row.job.request.rid!r}: {err!r}"))
            rows.clear()
            batch.keep([])
            return
        going, tokens = self._sample(rows, logits)
        order = batch.keep(going)
        batch.last = tokens[order]
        rows[:] = [rows[i] for i in order]

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Samples each row's next token, answers the rows that end; returns the rows that go on and all tokens."""
        params = [row.job.request.sampling for row in rows]
        sampler = RowSampler(params, device=self.device, generator=self.generator, never=self.never,
                             row_generators=[row.generator for row in rows])
        tokens, logprobs = sampler.sample(logits)
        going: list[int] = []
        for i, (row, token, logprob) in enumerate(zip(rows, *torch.stack([tokens.double(), logprobs.double()]).tolist(),
                                                      strict=True)):
            token = int(token)
            row.output_ids.append(token)
            row.logprobs.append(logprob)
            job = row.job
            reason = finish_reason(
                row.output_ids, job.request.sampling, decode=self.decode,
                stop_id=token in self.eos_token_ids or token in job.request.sampling.stop_token_ids,
                aborted=self.queue.ends(job),
            )
            if reason is None:
                going.append(i)
            else:
                self.answer(job, GenerateOutput(row.output_ids, row.logprobs, reason, row.version,
                                                len(job.request.input_ids)))
        return going, tokens
