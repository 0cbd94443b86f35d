"""The embedded engine's glue to transformers: a batch's model inputs, and one `model.generate` per batch whose
sampling and stopping are ours.

`model.generate` keeps the model-specific work (KV cache, Qwen-VL's M-RoPE positions under left padding, splicing
image / audio features in at prefill); per-row sampling (`relax_gym.engines.sampling`) and stopping live in
`BatchDecoder`, which samples from the raw logits captured by a forward hook, so no processor `generate` adds from
a checkpoint's generation_config can change what the reported logprobs mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from relax_gym.engines.base import FinishReason, SamplingParams
from relax_gym.engines.continuous import left_padded
from relax_gym.engines.sampling import RowSampler
from relax_gym.engines.stopping import finish_reason
from relax_gym.models import LoadedModel, concat_media
from relax_gym.models.inputs import takes_token_types


class BatchInputs:
    """A batch's model inputs: left-padded ids and mask, plus every row's processor outputs concatenated."""

    def __init__(self, loaded: LoadedModel, pad_token_id: int, device: torch.device) -> None:
        self.model = loaded.model
        self.pad_token_id = pad_token_id
        self.device = device
        #: the processor that makes `mm_token_type_ids`, where the model reads them; typed for lists, takes tensors
        self.token_types: Any = loaded.processor if loaded.processor is not None and takes_token_types(
            loaded.model) else None

    def build(self, prompts: list[list[int]], mm_inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`prompts` left-padded, with their rows' processor outputs (`mm_inputs`) concatenated in row order."""
        ids, mask = left_padded(prompts, self.pad_token_id)
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self.token_types is not None:
            inputs["mm_token_type_ids"] = torch.tensor(self.token_types.create_mm_token_type_ids(ids))
        for key in dict.fromkeys(k for row in mm_inputs for k in row):
            value = concat_media(key, [row[key] for row in mm_inputs if key in row])
            inputs[key] = value.to(self.model.dtype) if value.is_floating_point() else value
        return {k: v.to(self.device) for k, v in inputs.items()}


class BatchDecoder(LogitsProcessor):
    """Per-row sampling and stop bookkeeping for one batch, installed as generate's logits processor.

    Each step it samples every row from the raw logits under that row's own params (`RowSampler`),
    records token and logprob, decides which rows stop, and returns scores that make
    generate's greedy pick exactly the sampled tokens.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        *,
        eos: frozenset[int],
        vocab: int,
        device: torch.device,
        generator: torch.Generator,
        decode: Callable[[list[int]], str],
        aborted: Callable[[int], bool],
        never: Sequence[int] = (),
    ) -> None:
        self.params = list(params)
        rows = len(params)
        self.sampler = RowSampler(params, device=device, generator=generator, never=never)
        self.stop_ids = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        for i, p in enumerate(params):
            self.stop_ids[i, sorted(eos | set(p.stop_token_ids))] = True
        self.decode, self.aborted = decode, aborted
        self.output_ids: list[list[int]] = [[] for _ in params]
        self.logprobs: list[list[float]] = [[] for _ in params]
        self.reasons: list[FinishReason | None] = [None] * rows
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.rows = torch.arange(rows, device=device)
        self.raw: torch.Tensor | None = None

    def capture(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook: the model's last-position logits, before any logits processor."""
        self.raw = output.logits[:, -1].float()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert self.raw is not None, "the logits hook did not run"
        tokens, logprobs = self.sampler.sample(self.raw)
        hit_stop_id = self.stop_ids[self.rows, tokens]
        step = torch.stack([tokens.double(), logprobs.double(), hit_stop_id.double()]).tolist()
        for i, (token, logprob, stop_id) in enumerate(zip(*step, strict=True)):
            if self.reasons[i] is None:
                self.output_ids[i].append(int(token))
                self.logprobs[i].append(logprob)
                self.reasons[i] = self._finish(i, bool(stop_id))
        if any(r is not None for r in self.reasons):
            self.done = torch.tensor([r is not None for r in self.reasons], device=self.done.device)
        # transformers types the hook with torch's legacy FloatTensor, which no tensor op is typed to return
        return torch.full_like(scores, -torch.inf).scatter_(1, tokens[:, None], 0.0)  # type: ignore[return-value]

    def _finish(self, i: int, stop_id: bool) -> FinishReason | None:
        return finish_reason(self.output_ids[i], self.params[i], stop_id=stop_id, aborted=self.aborted(i),
                             decode=self.decode)


class Stopper(StoppingCriteria):
    """Per-row stop flags, as `BatchDecoder` decided them this step."""

    def __init__(self, decoder: BatchDecoder) -> None:
        self.decoder = decoder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return self.decoder.done.clone()  # type: ignore[return-value]  # legacy BoolTensor in transformers' hook


def generate_sampled(model: PreTrainedModel, inputs: dict[str, torch.Tensor], decoder: BatchDecoder, *,
                     max_new_tokens: int, eos_token_ids: frozenset[int], pad_token_id: int,
                     rows: AbstractContextManager[Any]) -> None:
    """Runs `model.generate` over `inputs` until `decoder` has stopped every row (its outputs are the batch's),
    inside `rows` (the rows' LoRA adapters)."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=sorted(eos_token_ids),
        pad_token_id=pad_token_id,
        # Neutral values, so none is filled in from the checkpoint's generation_config.
        temperature=1.0,
        top_p=1.0,
        top_k=50,
        repetition_penalty=1.0,
    )
    hook = model.register_forward_hook(decoder.capture)
    try:
        with torch.inference_mode(), rows:
            model.generate(  # type: ignore[operator]  # from the model class's GenerationMixin, not PreTrainedModel
                **inputs,
                generation_config=config,
                logits_processor=LogitsProcessorList([decoder]),
                stopping_criteria=StoppingCriteriaList([Stopper(decoder)]),
            )
    finally:
        hook.remove()
