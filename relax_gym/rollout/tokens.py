"""Exact token bookkeeping for one conversation: strict token-in / token-out, never re-render the history.

The policy's tokens are kept exactly as the engine produced them, and the
trainer trains on exactly this sequence. Environment turns are appended as a
chat-template delta computed without the real history: the template renders a
stand-in conversation (the same system turn and tools, a placeholder user turn,
a marker assistant turn) followed by the env's new messages and the next
assistant header, and the delta is what follows the marker turn's own end token
(`<|im_end|>`, `<|eot_id|>`, `<|end|>`, ...). In that render the marker turn is
never the last message, which matters: real templates render a turn differently
when it is last (Qwen3 writes an empty think block only on a last turn; gpt-oss
ends a last turn with `<|return|>`), while a turn the env answers is never last.

A template that rewrites earlier turns (Qwen3 drops old reasoning, Mistral moves
the system prompt to the last user turn) therefore cannot break appending. A
full re-render of such a conversation differs from the appended sequence by
design; `template_diff` measures it and the manager reports it as expected
(`rerender_expected`) when the template is known to rewrite history.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from relax_gym.engines.base import GenerateRequest, SamplingParams
from relax_gym.messages import Message, message, text
from relax_gym.models import MEDIA_KEYS, LoadedModel, chat_text, concat_media, encode, render_ids, sequence_inputs
from relax_gym.models.inputs import at_model_rate
from relax_gym.models.template_traits import (
    MARK,
    NEXT,
    TemplateError,
    TemplateTraits,
    after_mark,
    common_prefix,
    template_traits,
)
from relax_gym.trajectory import Segment
from relax_gym.video import Video

__all__ = ["ConversationTokens", "PromptCache", "TemplateError", "first_difference"]


def _media_of(messages: list[Message]) -> list[Any]:
    out: list[Any] = []
    for msg in messages:
        for part in msg["content"]:
            if part["type"] == "image":
                out.append(part["image"])
            elif part["type"] == "audio":
                out.append((part["audio"], part["sampling_rate"]))
            elif part["type"] == "video":
                out.append(part["video"])
    return out


def _encode(loaded: LoadedModel, text: str, messages: list[Message]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids of `text` whose media placeholders belong to `messages`, plus their features."""
    fast = getattr(loaded.tokenizer, "backend_tokenizer", None)
    if fast is not None and not _media_of(messages):
        # the same Rust tokenizer HF's __call__ runs, minus ~0.4 ms of Python per call on the hot path
        return fast.encode(text, add_special_tokens=False).ids, {}
    out = encode(loaded, text, messages)
    return out["input_ids"][0].tolist(), {k: out[k] for k in MEDIA_KEYS if k in out}


class PromptCache:
    """Rendered and tokenized text-only prompts, by content, for one model.

    A GRPO group's episodes start from the same messages, and a short episode's bookkeeping is
    mostly that render (a Jinja pass over the whole template) and its tokenization, so the group
    renders once. Prompts with media are never cached (their parts hold images and audio).
    Least-recently-used entries go beyond `size`.
    """

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, tuple[str, list[int]]] = OrderedDict()

    @staticmethod
    def key(messages: list[Message], tools: list[dict[str, Any]] | None) -> Hashable | None:
        """The prompt's identity, or None when a message holds anything but text parts."""
        parts: list[Hashable] = []
        for msg in messages:
            if set(msg) - {"role", "content"} or any(p["type"] != "text" for p in msg["content"]):
                return None
            parts.append((msg["role"], *(p["text"] for p in msg["content"] if p["type"] == "text")))
        return tuple(parts), None if tools is None else json.dumps(tools, sort_keys=True, default=repr)

    def get(self, key: Hashable) -> tuple[str, list[int]] | None:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
        return hit

    def render(self, loaded: LoadedModel, messages: list[Message],
               tools: list[dict[str, Any]] | None) -> tuple[str, list[int], dict[str, torch.Tensor]]:
        """`_render_prompt`'s answer, from the cache when the prompt is text only and was rendered before."""
        key = self.key(messages, tools)
        if key is None:
            return _render_prompt(loaded, messages, tools)
        hit = self.get(key)
        if hit is None:
            text, ids, _ = _render_prompt(loaded, messages, tools)  # text only: no media features
            hit = self._items[key] = (text, ids)
            if len(self._items) > self.size:
                self._items.popitem(last=False)
        return hit[0], list(hit[1]), {}  # a conversation's ids are its own to extend


def _render_prompt(loaded: LoadedModel, messages: list[Message],
                   tools: list[dict[str, Any]] | None) -> tuple[str, list[int], dict[str, torch.Tensor]]:
    """The prompt's template text with the generation prompt, its token ids and its media features."""
    text = chat_text(loaded, messages, tools=tools, add_generation_prompt=True)
    ids, features = _encode(loaded, text, messages)
    return text, ids, features


@dataclass
class ConversationTokens:
    """One episode's tokens with per-token mask, logprobs and versions, kept in step with its messages."""

    loaded: LoadedModel
    tools: list[dict[str, Any]] | None
    messages: list[Message]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    media: list[Any] = field(default_factory=list)
    #: the audio clips of `media` as engine requests carry them (`at_model_rate`), resampled once, on arrival
    request_audios: list[tuple[np.ndarray, int]] = field(default_factory=list)
    #: each turn's processor outputs for `media` (pixel_values, image_grid_thw, ...), in turn order
    turn_mm_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    prompt_len: int = 0
    turns: int = 0
    traits: TemplateTraits | None = None
    #: whether the last policy turn ended on a stop token (which then stands for the template's end token)
    _ended_by_stop: bool = True
    #: the template refused a marker turn without tool calls before tool results (see `_delta`)
    _stand_in_calls: bool = False

    @classmethod
    def start(cls, loaded: LoadedModel, messages: list[Message], tools: list[dict[str, Any]] | None = None,
              *, cache: PromptCache | None = None):
        """The conversation of the rendered prompt; `cache` (one per model) reuses a text-only prompt's render."""
        conv = cls(loaded, tools or None, list(messages), traits=template_traits(loaded))
        render = _render_prompt if cache is None else cache.render
        text, ids, features = render(loaded, conv.messages, conv.tools)
        conv._append(ids, "prompt", text, conv.messages, features)
        conv.prompt_len = len(ids)
        return conv

    # --- appending ----------------------------------------------------------------
    def _append(self, ids: list[int], kind: str, text: str, new_messages: list[Message],
                features: dict[str, torch.Tensor]) -> None:
        start = len(self.token_ids)
        first_media = len(self.media)
        self.media += _media_of(new_messages)
        new_audios = [x for x in self.media[first_media:] if isinstance(x, tuple)]  # images and videos are not
        self.request_audios += at_model_rate(self.loaded, new_audios)
        if features:
            self.turn_mm_inputs.append(features)
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.segments.append(Segment(kind, start, len(self.token_ids), self.turns, text,  # type: ignore[arg-type]
                                     list(range(first_media, len(self.media)))))

    def append_generation(self, output_ids: list[int], logprobs: list[float], versions: list[int],
                          eos_ids: set[int] | frozenset[int]) -> str:
        """Adds the policy's tokens (trained), with each one's logprob and weight version, and returns the
        assistant text the env receives."""
        if not len(output_ids) == len(logprobs) == len(versions):
            raise ValueError(f"engine returned {len(output_ids)} tokens but {len(logprobs)} logprobs and "
                             f"{len(versions)} versions")
        self.turns += 1
        start = len(self.token_ids)
        self.token_ids += output_ids
        self.loss_mask += [1] * len(output_ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += versions
        self._ended_by_stop = bool(output_ids) and output_ids[-1] in eos_ids
        body = output_ids[:-1] if self._ended_by_stop else output_ids
        content = self.loaded.decode(body)
        full = self.loaded.decode(output_ids)
        self.segments.append(Segment("policy", start, len(self.token_ids), self.turns, full))
        self.messages.append(message("assistant", content))
        return content

    def append_observation(self, new_messages: list[Message]) -> int:
        """Closes the assistant turn and appends the env's messages with the next assistant header.

        Returns the number of tokens appended.
        """
        assert self.traits is not None  # set by `start`
        end_token, rest = self._delta(new_messages)
        closing = "" if self._ended_by_stop else end_token  # a stop token already stands for the end token
        lead = len(rest) - len(rest.lstrip())
        if new_messages and self.traits.starts_with_added_token(rest[lead:]) is None:
            lead = 0  # whitespace before ordinary text tokenizes with it: keep the delta in one piece
        glue, env = (closing + rest, "") if not new_messages else (closing + rest[:lead], rest[lead:])
        appended = 0
        if glue:
            ids, _ = _encode(self.loaded, glue, [])
            self._append(ids, "glue", glue, [], {})
            appended += len(ids)
        if env:
            ids, features = _encode(self.loaded, env, new_messages)
            self._append(ids, "env", env, new_messages, features)
            appended += len(ids)
        self.messages += new_messages
        return appended

    # --- the template delta ---------------------------------------------------------
    def _stand_in(self, calls_for: list[Message] | None = None) -> list[Message]:
        """The conversation's system turn, a placeholder user turn and a marker assistant turn.

        With `calls_for`, the marker turn carries tool calls named (and id'd) after
        those tool results, for templates that look them up (gpt-oss names a tool
        result after the call it answers).
        """
        head = [self.messages[0]] if self.messages and self.messages[0]["role"] == "system" else []
        calls = [{"type": "function", **({"id": m["tool_call_id"]} if m.get("tool_call_id") else {}),
                  "function": {"name": m.get("name") or "tool", "arguments": {}}}
                 for m in calls_for or () if m["role"] == "tool"]
        assistant = message("assistant", MARK, **({"tool_calls": calls} if calls else {}))
        return [*head, message("user", "x"), assistant]

    def _delta(self, new_messages: list[Message]) -> tuple[str, str]:
        """(the end token closing the assistant turn, the template text after it up to the next generation).

        The marker turn first goes without tool calls: a template that renders
        calls may refuse ones it cannot take (Llama 3 takes one per turn), while the
        text after the turn does not depend on them. Only if the template refuses
        that does the marker turn carry calls matching the tool results.
        """
        answers_calls = any(m["role"] == "tool" for m in new_messages)
        if not (answers_calls and self._stand_in_calls):
            try:
                return self._delta_after(self._stand_in(), new_messages)
            except ValueError:
                if not answers_calls:
                    raise
                self._stand_in_calls = True  # this template wants them: later tool turns go straight there
        return self._delta_after(self._stand_in(new_messages), new_messages)

    def _delta_after(self, stand_in: list[Message], new_messages: list[Message]) -> tuple[str, str]:
        assert self.traits is not None
        rendered = chat_text(self.loaded, stand_in + new_messages, tools=self.tools, add_generation_prompt=True)
        if not new_messages:
            after = after_mark(rendered, "closing a turn the env does not answer")
            found = _first_of(after, self.traits.end_tokens)
            if found is None:
                raise TemplateError(f"the chat template ends an assistant turn with none of the end tokens "
                                    f"{list(self.traits.end_tokens)}: {after[:120]!r}")
            cut = len(rendered) - len(after) + found
        else:
            cut = self._end_of_stand_in(stand_in, new_messages, rendered)
        end_token = max((t for t in self.traits.end_tokens if rendered.startswith(t, cut)), key=len)
        return end_token, rendered[cut + len(end_token):]

    def _end_of_stand_in(self, stand_in: list[Message], new_messages: list[Message], rendered: str) -> int:
        """Where the last end token before the first new message starts, in `rendered`.

        Found in a render whose first new message holds a marker instead of its
        content: the last end token between the stand-in turn's start and that
        marker closes the stand-in turn (a header or a moved system prompt may
        follow it). The text up to there must not depend on the new messages.
        """
        assert self.traits is not None
        located: list[Message] = [{**new_messages[0], "content": [text(NEXT)]}, *new_messages[1:]]
        probe = chat_text(self.loaded, stand_in + located, tools=self.tools, add_generation_prompt=True)
        upto = probe.find(NEXT)
        if upto < 0:
            raise TemplateError(f"the chat template does not render the content of a {new_messages[0]['role']!r} "
                                "message after an assistant turn")
        floor = probe.find(MARK)
        if floor < 0:  # the template left the marker content out (it rendered the tool calls alone)
            asked = chat_text(self.loaded, stand_in[:-1], tools=self.tools, add_generation_prompt=True)
            floor = common_prefix(asked, probe)
        cut = max((probe.rfind(t, floor, upto) for t in self.traits.end_tokens), default=-1)
        if cut < 0:
            raise TemplateError(f"the chat template ends an assistant turn with none of the end tokens "
                                f"{list(self.traits.end_tokens)}: {probe[floor:upto][:160]!r}")
        if rendered[:cut] != probe[:cut]:
            raise TemplateError("the chat template renders earlier turns differently depending on the content of "
                                f"a new {new_messages[0]['role']!r} message: {rendered[max(0, cut - 80):cut]!r}")
        return cut

    # --- outputs ------------------------------------------------------------------
    def request(self, sampling: SamplingParams, rid: str | None = None, *,
                return_routed_experts: bool = False) -> GenerateRequest:
        """The engine request that continues this conversation: its tokens, its media (audio at the model's rate)
        and their processor outputs."""
        return GenerateRequest(
            input_ids=list(self.token_ids),
            sampling=sampling,
            images=[x for x in self.media if isinstance(x, Image.Image)],
            audios=self.request_audios,
            videos=[x for x in self.media if isinstance(x, Video)],
            mm_inputs=self.mm_inputs() or None,
            rid=rid,
            return_routed_experts=return_routed_experts,
        )

    def mm_inputs(self) -> dict[str, torch.Tensor]:
        """Processor outputs of every image / clip so far, concatenated in turn order."""
        return {k: concat_media(k, [f[k] for f in self.turn_mm_inputs if k in f])
                for k in MEDIA_KEYS if any(k in f for f in self.turn_mm_inputs)}

    def model_inputs(self) -> Any:
        return sequence_inputs(self.loaded, self.token_ids, self.turn_mm_inputs)

    def _history(self) -> tuple[list[Message], Segment | None]:
        """The messages up to the last generation prompt, and the final policy turn if the sequence ends on one.

        A final policy turn is compared as generated: the template's own rendering
        of a last assistant message (Qwen3 adds an empty think block) is not what
        the model saw, which was the generation prompt followed by its tokens.
        """
        last = self.segments[-1] if self.segments[-1].kind == "policy" else None
        return (self.messages[:-1] if last is not None else self.messages), last

    def rewrites_history(self) -> bool:
        """Whether the template rewrites earlier turns: a full re-render differs from this sequence by design."""
        return self.traits is not None and self.traits.rewrites_history is not None

    def rerendered_ids(self) -> list[int]:
        """The token ids a full re-render gives (plus the final policy turn's own tokens)."""
        history, last = self._history()
        ids = render_ids(self.loaded, history, tools=self.tools, add_generation_prompt=True)
        return ids + (self.token_ids[last.start:last.end] if last is not None else [])

    def rerender_diff(self) -> int | None:
        """First token index where a full re-render differs from the appended sequence, or None.

        Differences also come from the policy writing a non-canonical tokenization
        of its own text (re-tokenizing the decoded text merges differently); those
        do not matter for training, which uses the exact tokens. `template_diff`
        separates template problems from them.
        """
        return first_difference(self.token_ids, self.rerendered_ids())

    def template_diff(self) -> int | None:
        """First character where the decoded sequence and a full re-render's text differ, or None.

        Decoded text does not depend on how it was tokenized, so a difference here
        is the template itself rendering the conversation differently than it was
        appended: expected for templates that rewrite history (`traits.rewrites_history`).
        The re-render is compared as template text (no tokenizer, no image
        processing): runs of a media placeholder token, which the processor
        expands, are collapsed to one on our side.
        """
        history, last = self._history()
        if len(self.segments) == 2 and last is not None:  # the prompt and one reply: the history is the prompt
            full = self.segments[0].text
        else:
            full = chat_text(self.loaded, history, tools=self.tools, add_generation_prompt=True)
        ours = self.loaded.decode(self.token_ids)
        if any(isinstance(m, Video) for m in self.media):
            # a video's expansion is more than repeated placeholders (Qwen3-VL writes each frame group's time and
            # vision tags), so the processor expands the re-render too, and the texts are compared expanded
            full = self.loaded.decode(encode(self.loaded, full, history)["input_ids"][0].tolist())
        else:
            for pad in _placeholders(self.loaded):
                ours = re.sub(f"(?:{re.escape(pad)})+", _literal(pad), ours)
        if last is not None:
            full += last.text
        return first_difference(ours, full)


def _placeholders(loaded: LoadedModel) -> list[str]:
    """The media placeholder tokens the processor repeats once per embedding (e.g. `<|image_pad|>`)."""
    processor = loaded.processor
    names = ("image_token", "audio_token", "video_token")
    return [t for t in (getattr(processor, n, None) for n in names) if isinstance(t, str) and t]


def _literal(replacement: str) -> Callable[[re.Match[str]], str]:
    """A `re.sub` replacement that inserts `replacement` as it is (a str would have its backslashes read)."""
    return lambda _match: replacement


def first_difference(a: Any, b: Any) -> int | None:
    """The first index where `a` and `b` differ (one being a prefix of the other: its length), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _first_of(text: str, tokens: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(t) for t in tokens) if i >= 0]
    return min(found) if found else None


