"""Helpers shared by the engine tests: requests as the rollout manager builds them, and the
teacher-forced logprobs the trainer would recompute for what an engine generated."""

from __future__ import annotations

import torch

from relax_gym import messages as M
from relax_gym.engines.base import GenerateRequest, SamplingParams
from relax_gym.models import MEDIA_KEYS, LoadedModel, processor_inputs, sequence_inputs


def make_request(loaded: LoadedModel, conversation: list[M.Message], sampling: SamplingParams) -> GenerateRequest:
    """Exact ids, raw media, and the processor's media outputs."""
    inputs = processor_inputs(loaded, conversation)
    parts = [p for message in conversation for p in message["content"]]
    return GenerateRequest(
        inputs["input_ids"][0].tolist(),
        sampling,
        images=[p["image"] for p in parts if p["type"] == "image"],
        audios=[(p["audio"], p["sampling_rate"]) for p in parts if p["type"] == "audio"],
        mm_inputs={k: inputs[k] for k in MEDIA_KEYS if k in inputs} or None,
    )


def teacher_forced(loaded: LoadedModel, request: GenerateRequest, output_ids: list[int]) -> torch.Tensor:
    """log softmax(logits / T) of the generated tokens, from one unpadded forward pass."""
    media = [request.mm_inputs] if request.mm_inputs else []
    with torch.no_grad():
        logits = loaded.model(**sequence_inputs(loaded, request.input_ids + output_ids, media)).logits[0].float()
    scaled = logits[len(request.input_ids) - 1 : -1] / (request.sampling.temperature or 1.0)
    return scaled.log_softmax(-1).gather(1, torch.tensor(output_ids)[:, None]).squeeze(1)
