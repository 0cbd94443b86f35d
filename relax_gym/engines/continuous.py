"""Continuous batching for the embedded engine: rows join a running decode and leave it when they stop.

Static batching (one `model.generate` per batch) runs every row until the batch's longest one stops,
and a request that arrives meanwhile waits for the whole batch. `RunningBatch` keeps the rows that
decode together over one KV cache instead: new requests are prefilled (identical prompts once, as a
GRPO group's are) and join at the next step, and finished rows leave at once.

It is written over the model's own forward and transformers' `DynamicCache`, not over transformers'
continuous batching (`generate_batch`, paged attention): on this project's CPU machine that ran a
64-row mixed-length workload on the tiny model at 683 tokens/s against 10,820 for static `generate`,
and it samples without per-request seeds and reports logprobs after top-k / top-p, where the engine's
contract is log softmax(raw / T) over the full vocabulary. The engine does the sampling
(`relax_gym.engines.sampling`); this module only moves the cache.

Text-only causal LMs whose cache layers are all full attention take this path
(`supports_continuous_batching`); models with a processor (media features are spliced in at
prefill, Qwen-VL's M-RoPE positions) or sliding-window layers keep static batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from relax_gym.models.forward_args import cache_argument, forward_parameters

__all__ = ["RunningBatch", "left_padded", "shared_prefix", "supports_continuous_batching"]


def supports_continuous_batching(model: PreTrainedModel, has_processor: bool) -> bool:
    """Whether `model` can decode in a `RunningBatch`: text only, explicit positions, full-attention cache."""
    if has_processor or cache_argument(model) is None:
        return False
    if not {"position_ids", "logits_to_keep"} <= forward_parameters(type(model).forward):
        return False
    cache = DynamicCache(config=model.config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


#: a prefix shared by all of a prefill's prompts runs once when that saves at least this many prompt tokens: below
#: it, the extra forward pass costs more than it saves
MIN_PREFIX_TOKENS_SAVED = 32
#: a row's room when its budget is not given: larger than any buffer `_room` sizes
UNBOUNDED = 1 << 40


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the prefix all `prompts` share, leaving each at least one token of its own (its last token's
    logits come from the pass over the rest)."""
    if not prompts:
        return 0
    limit = min(map(len, prompts)) - 1
    first = prompts[0]
    for i in range(limit):
        if any(p[i] != first[i] for p in prompts[1:]):
            return i
    return max(limit, 0)


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] token ids of `prompts` left-padded with `pad_token_id`, and their attention mask, on the CPU."""
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, longest - len(prompt):] = torch.tensor(prompt)
        mask[i, longest - len(prompt):] = 1
    return ids, mask


class SlackLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with room to grow.

    `DynamicLayer.update` concatenates, copying the whole cache at every decode step: at 64 rows of SmolLM2-135M
    and a 60-token cache that was 16 % of a step (torch profiler), and it grows with the length. Here a step
    writes its column in place. Rows joining (`append_rows`) and leaving (`keep_rows`) are written straight into
    fresh buffers; keys or values replaced from outside (transformers' `batch_select_indices`,
    `batch_repeat_interleave`) are copied into one at the next update, once. `cap`, which `RunningBatch` sets
    from its rows' token budgets, is the most positions the buffers can come to hold: no room past it (`_room`)."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None
    #: the most positions this layer's rows can still need (the widest row's budget), None where unknown
    cap: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old_keys, old_values = _kv(self.keys), _kv(self.values)
        held = old_keys.shape[-2] if old_keys.numel() else 0
        length = held + key_states.shape[-2]
        if not self._owns_views(old_keys, old_values) or length > _kv(self._key_buffer).shape[-2]:
            self._key_buffer = _with_room(old_keys, held, key_states, _room(length, self.cap))
            self._value_buffer = _with_room(old_values, held, value_states, _room(length, self.cap))
        keys, values = _kv(self._key_buffer), _kv(self._value_buffer)
        keys[:, :, held:length] = key_states
        values[:, :, held:length] = value_states
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        return self.keys, self.values

    def keep_rows(self, rows: torch.Tensor, start: int) -> None:
        """Keeps `rows` from column `start` on, gathered straight into buffers with room: gathering them into
        plain tensors (`batch_select_indices`) left the next `update` a second copy of the whole cache, 4.5 % of a
        64-row engine run on 2-digit sums (py-spy), where rows finish at different steps."""
        keys, values = _kv(self.keys), _kv(self.values)
        length = keys.shape[-2] - start
        self._key_buffer = _rows_with_room(keys, rows, start, _room(length, self.cap))
        self._value_buffer = _rows_with_room(values, rows, start, _room(length, self.cap))
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]

    def move_rows(self, to: torch.Tensor, source: torch.Tensor, count: int) -> None:
        """Copies rows `source` over rows `to` in place and keeps the first `count` rows: a row's copy for each that
        leaves, where `keep_rows` copies every row that stays. Only where `in_place` (`RunningBatch.keep` asks)."""
        keys, values = _kv(self._key_buffer), _kv(self._value_buffer)
        if len(to):
            keys.index_copy_(0, to, keys.index_select(0, source))
            values.index_copy_(0, to, values.index_select(0, source))
        length = _kv(self.keys).shape[-2]
        self._key_buffer, self._value_buffer = keys[:count], values[:count]
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]

    @property
    def in_place(self) -> bool:
        """Whether the keys and values are views of this layer's own buffers (not replaced from outside)."""
        return self.is_initialized and self._owns_views(_kv(self.keys), _kv(self.values))

    def append_rows(self, other: SlackLayer, width: int) -> None:
        """Appends `other`'s rows after these, both left-padded with zeros to `width` positions, in one buffer with
        room: concatenating left the old buffers and the joined copy alive together until the next `update`
        copied it once more, twice the cache at every join."""
        self._key_buffer = _stacked_with_room(_kv(self.keys), _kv(other.keys), width, _room(width, self.cap))
        self._value_buffer = _stacked_with_room(_kv(self.values), _kv(other.values), width, _room(width, self.cap))
        self.keys, self.values = self._key_buffer[:, :, :width], self._value_buffer[:, :, :width]

    def _owns_views(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether `keys` and `values` are still the prefixes of this layer's buffers that `update` left."""
        return all(buffer is not None and view.data_ptr() == buffer.data_ptr() and view.shape[:2] == buffer.shape[:2]
                   and view.stride() == buffer.stride()
                   for view, buffer in ((keys, self._key_buffer), (values, self._value_buffer)))


def _with_room(old: torch.Tensor, kept: int, new: torch.Tensor, size: int) -> torch.Tensor:
    """A buffer shaped like `new` with `size` positions, its first `kept` positions copied from `old`."""
    batch, heads, _, dim = new.shape
    buffer = new.new_empty(batch, heads, size, dim)
    if kept:
        buffer[:, :, :kept] = old
    return buffer


def _room(length: int, cap: int | None) -> int:
    """Positions a buffer holding `length` gets: half as many again, at least 64, so it grows rarely; but no more
    than `cap`, the most its rows can come to need (an eval's 64 rows of 24-token answers needed 70 of 134)."""
    roomy = length + max(64, length // 2)
    return roomy if cap is None else max(length, min(roomy, cap))


def _stacked_with_room(first: torch.Tensor, second: torch.Tensor, width: int, size: int) -> torch.Tensor:
    """`first`'s rows then `second`'s, each right-aligned in `width` positions with zeros before (masked, but
    finite, so no NaN reaches attention), in the front of a buffer of `size` positions."""
    rows, heads, _, dim = first.shape
    buffer = first.new_empty(rows + len(second), heads, size, dim)
    for part, tensor in ((buffer[:rows], first), (buffer[rows:], second)):
        pad = width - tensor.shape[-2]
        part[:, :, :pad].zero_()
        part[:, :, pad:width] = tensor
    return buffer


def _rows_with_room(old: torch.Tensor, rows: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """`old[rows, :, start:]` written into the front of a buffer of `size` positions."""
    _, heads, held, dim = old.shape
    length = held - start
    buffer = old.new_empty(len(rows), heads, size, dim)
    torch.index_select(old[:, :, start:], 0, rows, out=buffer[:, :, :length])
    return buffer


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """`model`'s `DynamicCache` with `SlackLayer`s (`supports_continuous_batching` checked its layers are all
    full-attention `DynamicLayer`s)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [SlackLayer() for _ in cache.layers]
    return cache


def _cap(cache: DynamicCache, width: int, room: torch.Tensor) -> None:
    """Tells `cache`'s layers the most positions they can come to hold: its `width` now, plus the most tokens a
    row may still feed (a step adds a column and takes one from every row's room, so this holds until rows join
    or leave)."""
    cap = width + (int(room.max()) if len(room) else 0)
    for layer in _layers(cache):
        layer.cap = cap


def _layers(cache: DynamicCache) -> list[SlackLayer]:
    """The cache's layers: every cache here is `new_cache`'s, all `SlackLayer`s."""
    return cast(list[SlackLayer], cache.layers)


def _kv(tensor: torch.Tensor | None) -> torch.Tensor:
    """A prefilled layer's keys or values (a `DynamicLayer` holds None only before its first update)."""
    assert tensor is not None
    return tensor


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`x` with zeros prepended along `dim` up to `width`."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.ndim - 1 - dim) + [missing, 0]
    return F.pad(x, pad)


class RunningBatch:
    """Rows decoding together: a left-padded KV cache [B, H, T, D] per layer and its attention mask [B, T].

    Each row feeds `last` (its latest token) at position `positions` in the next `step`. Rows come
    from `prefill` and `join`, and go with `keep`. Positions count a row's own tokens, so left
    padding never shifts them, as `generate` derives them from the mask. `room` is how many more
    tokens each row may feed (its budget, from `prefill`), which caps the cache's buffers.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self._cache_argument = cache_argument(model) or "past_key_values"
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)
        #: tokens each row may still feed, on the CPU (`UNBOUNDED` where its budget is not given)
        self.room = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.mask.shape[0]

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], room: Sequence[int] | None = None) -> tuple[RunningBatch, torch.Tensor]:
        """A new batch of `prompts` and each row's next-token logits [B, V] in fp32; its `last` is for the
        caller to set once it has sampled. Identical prompts run once and share their cache rows, and a prefix
        all the prompts share (a chat template's system turn) runs once for them all. `room`: how many tokens
        each row may feed after its prompt (its `max_new_tokens` - 1: the last sampled token is never fed), so
        the cache holds no room it cannot use; None: unbounded."""
        unique: dict[tuple[int, ...], int] = {}
        rows = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        distinct = list(unique)
        budgets = torch.tensor([UNBOUNDED] * len(prompts) if room is None else list(room), dtype=torch.long)
        cache = new_cache(self.model)
        shared = shared_prefix(distinct)
        if (len(distinct) - 1) * shared < MIN_PREFIX_TOKENS_SAVED:
            shared = 0
        _cap(cache, max(map(len, distinct)), budgets)
        if shared:  # the prefix once, its cache rows repeated for every prompt; padding sits between it and the rest
            head = torch.tensor([distinct[0][:shared]], device=self.device)
            self.model(input_ids=head, position_ids=torch.arange(shared, device=self.device)[None], use_cache=True,
                       logits_to_keep=1, **{self._cache_argument: cache})
            cache.batch_repeat_interleave(len(distinct))
        ids, tail_mask = (t.to(self.device) for t in left_padded([p[shared:] for p in distinct], self.pad_token_id))
        mask = F.pad(tail_mask, (shared, 0), value=1)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=shared + (tail_mask.cumsum(-1) - 1).clamp(
                            min=0), use_cache=True, logits_to_keep=1, **{self._cache_argument: cache}).logits[:, -1]
        logits = logits.float()
        batch = RunningBatch(self.model, self.pad_token_id)
        batch.cache, batch.mask, batch.positions, batch.room = cache, mask, mask.sum(-1), budgets
        if len(unique) < len(prompts):  # shared prompts: each row takes its prompt's cache row and logits
            index = torch.tensor(rows, device=self.device)
            batch._select(index)
            logits = logits[index]
        return batch, logits

    def join(self, other: RunningBatch) -> None:
        """Appends `other`'s rows after these, left-padding the shorter cache to the longer one's length."""
        if not len(other):
            return
        if not len(self):
            self.cache, self.mask, self.positions, self.last = other.cache, other.mask, other.positions, other.last
            self.room = other.room
            return
        assert self.cache is not None and other.cache is not None
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.room = torch.cat([self.room, other.room])
        _cap(self.cache, width, self.room)
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            mine.append_rows(theirs, width)
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(other.mask, width, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.last = torch.cat([self.last, other.last])

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """Feeds every row its `last` token; returns next-token logits [B, V] in fp32."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        logits = self.model(input_ids=self.last[:, None], attention_mask=self.mask,
                            position_ids=self.positions[:, None], use_cache=True,
                            **{self._cache_argument: self.cache}).logits[:, -1].float()
        self.positions = self.positions + 1
        self.room = self.room - 1
        return logits

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> list[int]:
        """Only `rows` (ascending) go on; returns the order they stand in from now on, as indices of the old rows.

        Where every column stays in use, the last rows move into the places of those that leave (a row's copy
        for each that leaves: with 64 stories ending at different steps, gathering the whole cache anew at each
        end was 2-4 % of the run, py-spy); else the rows are gathered in order and the columns no remaining row
        uses are dropped from the left."""
        if len(rows) == len(self):
            return rows
        if not rows:
            self.cache = None
            self.mask, self.positions, self.last = self.mask[:0, :0], self.positions[:0], self.last[:0]
            self.room = self.room[:0]
            return []
        assert self.cache is not None
        unused = int(self.mask[torch.tensor(rows, device=self.device)].any(0).int().argmax())  # the first column used
        order, in_place = rows, unused == 0 and all(layer.in_place for layer in _layers(self.cache))
        if in_place:
            count, staying = len(rows), set(rows)
            to = [i for i in range(count) if i not in staying]
            source = [i for i in rows if i >= count]
            order = list(range(count))
            for place, row in zip(to, source, strict=True):
                order[place] = row
            places, moved = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (to, source))
            for layer in _layers(self.cache):
                layer.move_rows(places, moved, count)
        index = torch.tensor(order, device=self.device)
        self.room = self.room[order]
        self.mask, self.positions = self.mask[index][:, unused:], self.positions[index]
        if len(self.last):
            self.last = self.last[index]
        _cap(self.cache, self.mask.shape[1], self.room)
        if not in_place:
            for layer in _layers(self.cache):
                layer.keep_rows(index, unused)
        return order

    def _select(self, rows: torch.Tensor) -> None:
        assert self.cache is not None
        for layer in _layers(self.cache):
            layer.batch_select_indices(rows)
        self.mask, self.positions = self.mask[rows], self.positions[rows]
        if len(self.last):
            self.last = self.last[rows]
