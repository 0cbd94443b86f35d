"""The embedded engine's sampler: per-row temperature, top-k / top-p and seeded draws over a batch of logits,
and each chosen token's logprob.

Pure torch, no model: `RowSampler` is built once per batch from the rows' `SamplingParams` and maps raw
last-position logits to (tokens, logprobs). Top-k / top-p and never-sampled tokens shape only the choice;
the logprob is always log softmax(raw / T) over the full vocabulary (T = 1 for greedy rows), which is what
the trainer recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from relax_gym.engines.base import SamplingParams


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks to -inf what top-k (0 = off) and top-p drop, per row; both masks act on the full
    distribution, as SGLang's sampler does. The most likely token always survives."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    drop |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
    return torch.full_like(logits, -torch.inf).scatter(1, order, ordered.masked_fill(drop, -torch.inf))


def seeded_generators(params: Sequence[SamplingParams], device: torch.device) -> list[torch.Generator | None]:
    """Each row's own generator, seeded once from its `seed` (None for an unseeded row)."""
    return [None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed) for p in params]


class RowSampler:
    """Samples one token per row under that row's own params.

    Rows with a `seed` draw from their own generator (`row_generators`, else seeded once here), whatever
    else is in the batch; the others share `generator`. Tokens in `never` are not sampled (nor picked greedily).
    """

    def __init__(self, params: Sequence[SamplingParams], *, device: torch.device, generator: torch.Generator,
                 never: Sequence[int] = (), row_generators: Sequence[torch.Generator | None] | None = None) -> None:
        def tensor(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        self.temperature = tensor([p.temperature for p in params], torch.float32)
        self.greedy = self.temperature == 0
        self.top_k = tensor([p.top_k for p in params], torch.long)
        self.top_p = tensor([p.top_p for p in params], torch.float32)
        self.all_greedy = all(p.temperature == 0 for p in params)
        self.any_greedy = any(p.temperature == 0 for p in params)
        #: every row at T = 1 (or greedy, whose logprob is at T = 1): dividing by the temperature changes nothing
        self.unit_temperature = all(p.temperature in (0, 1) for p in params)
        self.truncates = any(p.top_k > 0 or p.top_p < 1 for p in params if p.temperature > 0)
        self.generator = generator
        #: a row keeps its generator across steps (and, under continuous batching, across batches)
        self.row_generators = list(row_generators) if row_generators is not None else seeded_generators(params, device)
        self.seeded = [i for i, g in enumerate(self.row_generators) if g is not None]
        self.never = torch.tensor(never, dtype=torch.long, device=device) if never else None

    def sample(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token and its log p under softmax(raw / T) (T = 1 for greedy), untruncated.

        Each full-vocabulary pass costs about a millisecond at 64 rows of a 49k vocabulary, so the passes a batch
        does not need are skipped: the argmax without greedy rows, the division at T = 1 (else it is done once, for
        the draw and the logprob alike), and the log-softmax's output (the chosen token's logprob is its logit less
        the logsumexp; where nothing was truncated or barred, the log of its probability, which the draw computed:
        a logsumexp is the slowest of those passes)."""
        temperature = torch.where(self.greedy, 1.0, self.temperature)[:, None]
        scaled = raw if self.unit_temperature else raw / temperature
        # a greedy row's temperature is 1, so its argmax over `allowed` is the raw logits' (placeholders barred)
        allowed = scaled if self.never is None else scaled.index_fill(1, self.never, -torch.inf)
        if self.all_greedy:
            tokens = allowed.argmax(dim=-1)
        else:
            kept = top_k_top_p(allowed, self.top_k, self.top_p) if self.truncates else allowed
            probs = kept.softmax(dim=-1)
            # Inverse-CDF draws, one uniform per row: one searchsorted for the batch, where a multinomial per
            # seeded row cost a third of a small model's decode step. A seeded row's uniform comes from its own
            # generator, so its draws do not depend on the rest of the batch.
            uniform = torch.rand(len(probs), generator=self.generator, device=probs.device)
            for i in self.seeded:
                uniform[i] = torch.rand(1, generator=self.row_generators[i], device=probs.device)[0]
            cdf = probs.cumsum(dim=-1)
            drawn = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
            drawn = drawn.clamp_(max=probs.shape[-1] - 1)
            # rounding can land a draw past the last token with mass (on one of none): take the likeliest instead
            stray = probs.gather(1, drawn[:, None]).squeeze(1) == 0
            if stray.any():
                drawn[stray] = probs[stray].argmax(dim=-1)
            tokens = torch.where(self.greedy, allowed.argmax(dim=-1), drawn) if self.any_greedy else drawn
            if kept is scaled:  # nothing truncated or barred: `probs` is softmax(scaled), so its log is the logprob
                return tokens, probs.gather(1, tokens[:, None]).squeeze(1).log()
        logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - scaled.logsumexp(dim=-1)
        return tokens, logprobs
