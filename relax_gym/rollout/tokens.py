"""Exact token bookkeeping for one conversation: strict append, never re-tokenize.

Generated tokens are kept exactly as the engine produced them. Environment
turns are appended as the chat-template delta: the new messages rendered after
a fixed stand-in prefix (same system/tools header, a placeholder user and
assistant turn), minus that prefix. Because the prefix never contains the real
history, a template that rewrites earlier turns (e.g. strips old `<think>`
blocks) cannot break the append; `rerender_diff` then measures how far the
appended sequence is from a full re-render and the manager reports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from relax_gym.messages import Message, message
from relax_gym.models import MEDIA_KEYS, LoadedModel, chat_text, encode, render, sequence_inputs
from relax_gym.trajectory import Segment

_MARK = "\u2063RELAX\u2063"  # an invisible separator pair no template emits on its own


class TemplateError(ValueError):
    """The chat template does not behave as strict appending requires (named with the evidence)."""


def _media_of(messages: list[Message]) -> list[Any]:
    out: list[Any] = []
    for msg in messages:
        for part in msg["content"]:
            if part["type"] == "image":
                out.append(part["image"])
            elif part["type"] == "audio":
                out.append((part["audio"], part["sampling_rate"]))
    return out


def _encode(loaded: LoadedModel, text: str, messages: list[Message]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids of `text` whose media placeholders belong to `messages`, plus their features."""
    fast = getattr(loaded.tokenizer, "backend_tokenizer", None)
    if fast is not None and not _media_of(messages):
        # the same Rust tokenizer HF's __call__ runs, minus ~0.4 ms of Python per call on the hot path
        return fast.encode(text, add_special_tokens=False).ids, {}
    out = encode(loaded, text, messages)
    return out["input_ids"][0].tolist(), {k: out[k] for k in MEDIA_KEYS if k in out}


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
    media_features: list[dict[str, torch.Tensor]] = field(default_factory=list)
    prompt_len: int = 0
    turns: int = 0
    #: template text after an assistant's content, and the stand-in prefix rendered: fixed per conversation
    _closing: str = ""
    _stand_in_text: str = ""

    @classmethod
    def start(cls, loaded: LoadedModel, messages: list[Message], tools: list[dict[str, Any]] | None = None):
        conv = cls(loaded, tools or None, list(messages))
        conv._closing = conv._probe_closing()
        conv._stand_in_text = chat_text(loaded, conv._stand_in(), tools=conv.tools, add_generation_prompt=False)
        text = chat_text(loaded, conv.messages, tools=conv.tools, add_generation_prompt=True)
        ids, features = _encode(loaded, text, conv.messages)
        conv._append(ids, "prompt", text, conv.messages, features)
        conv.prompt_len = len(ids)
        return conv

    # --- appending ----------------------------------------------------------------
    def _append(self, ids: list[int], kind: str, text: str, new_messages: list[Message],
                features: dict[str, torch.Tensor]) -> None:
        start = len(self.token_ids)
        first_media = len(self.media)
        self.media += _media_of(new_messages)
        if features:
            self.media_features.append(features)
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.segments.append(Segment(kind, start, len(self.token_ids), self.turns, text,  # type: ignore[arg-type]
                                     list(range(first_media, len(self.media)))))

    def append_generation(self, output_ids: list[int], logprobs: list[float], version: int,
                          eos_ids: set[int]) -> str:
        """Adds the policy's tokens (trained) and returns the assistant text the env receives."""
        if len(output_ids) != len(logprobs):
            raise ValueError(f"engine returned {len(output_ids)} tokens but {len(logprobs)} logprobs")
        self.turns += 1
        start = len(self.token_ids)
        self.token_ids += output_ids
        self.loss_mask += [1] * len(output_ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [version] * len(output_ids)
        body = output_ids[:-1] if output_ids and output_ids[-1] in eos_ids else output_ids
        content = self.loaded.tokenizer.decode(body, skip_special_tokens=False)
        full = self.loaded.tokenizer.decode(output_ids, skip_special_tokens=False)
        self.segments.append(Segment("policy", start, len(self.token_ids), self.turns, full))
        self.messages.append(message("assistant", content))
        return content

    def append_observation(self, new_messages: list[Message]) -> int:
        """Closes the assistant turn and appends the env's messages with the next assistant header."""
        glue = self._closing_glue()
        if glue:
            ids, _ = _encode(self.loaded, glue, [])
            self._append(ids, "glue", glue, [], {})
        if not new_messages:
            return len(glue)
        delta = self._delta_text(new_messages)
        ids, features = _encode(self.loaded, delta, new_messages)
        self._append(ids, "env", delta, new_messages, features)
        self.messages += new_messages
        return len(ids)

    # --- template probes ----------------------------------------------------------
    def _stand_in(self) -> list[Message]:
        head = [self.messages[0]] if self.messages and self.messages[0]["role"] == "system" else []
        return [*head, message("user", "x"), message("assistant", "x")]

    def _probe_closing(self) -> str:
        """What the template writes after an assistant's content (e.g. `<|im_end|>\\n`)."""
        probe = [*self._stand_in()[:-1], message("assistant", _MARK)]
        rendered = chat_text(self.loaded, probe, tools=self.tools, add_generation_prompt=False)
        if rendered.count(_MARK) != 1:
            raise TemplateError("the chat template does not render assistant content verbatim")
        return rendered.split(_MARK, 1)[1]

    def _closing_glue(self) -> str:
        """The template's closing text, less what the policy already wrote (its end-of-turn token)."""
        generated_tail = self.segments[-1].text[len(self.messages[-1]["content"][0]["text"]):]
        if generated_tail and self._closing.startswith(generated_tail):
            return self._closing[len(generated_tail):]
        return self._closing

    def _delta_text(self, new_messages: list[Message]) -> str:
        before = self._stand_in_text
        after = chat_text(self.loaded, self._stand_in() + new_messages, tools=self.tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template rewrites earlier turns when messages are appended; "
                f"rendered prefix {before[-80:]!r} is not a prefix of {after[len(before) - 80:len(before) + 80]!r}"
            )
        return after[len(before):]

    # --- outputs ------------------------------------------------------------------
    def engine_media(self) -> dict[str, torch.Tensor]:
        """Processor outputs of every image / clip so far, concatenated in turn order."""
        return {k: torch.cat([f[k] for f in self.media_features if k in f])
                for k in MEDIA_KEYS if any(k in f for f in self.media_features)}

    def model_inputs(self) -> Any:
        return sequence_inputs(self.loaded, self.token_ids, self.media_features)

    def _full_render(self) -> tuple[list[int], bool]:
        """The whole conversation rendered at once, and whether it ends on a policy turn.

        A re-render closes a final policy turn with template glue that was never
        appended, so comparisons cut the re-render to the appended length.
        """
        ended_by_policy = self.segments[-1].kind == "policy"
        return render(self.loaded, self.messages, tools=self.tools,
                      add_generation_prompt=not ended_by_policy), ended_by_policy

    def rerender_diff(self) -> int | None:
        """First token index where a full re-render differs from the appended sequence, or None.

        Differences also come from the policy writing a non-canonical tokenization
        of its own text (re-tokenizing the decoded text merges differently); those
        do not matter for training, which uses the exact tokens. `template_diff`
        separates template problems from them.
        """
        rendered, ended_by_policy = self._full_render()
        if ended_by_policy:
            rendered = rendered[: len(self.token_ids)]
        return _first_difference(self.token_ids, rendered)

    def template_diff(self) -> int | None:
        """First character where the decoded sequence and a full re-render's text differ, or None.

        Decoded text does not depend on how it was tokenized, so a difference here
        is the template itself rendering the conversation differently than it was
        appended. The re-render is compared as template text (no tokenizer, no
        image processing): runs of a media placeholder token, which the processor
        expands, are collapsed to one on our side.
        """
        ended_by_policy = self.segments[-1].kind == "policy"
        full = chat_text(self.loaded, self.messages, tools=self.tools, add_generation_prompt=not ended_by_policy)
        ours = self.loaded.tokenizer.decode(self.token_ids)
        for pad in _placeholders(self.loaded):
            ours = re.sub(f"(?:{re.escape(pad)})+", lambda _m, pad=pad: pad, ours)
        return _first_difference(ours, full[: len(ours)] if ended_by_policy else full)


def _placeholders(loaded: LoadedModel) -> list[str]:
    """The media placeholder tokens the processor repeats once per embedding (e.g. `<|image_pad|>`)."""
    processor = loaded.processor
    names = ("image_token", "audio_token", "video_token")
    return [t for t in (getattr(processor, n, None) for n in names) if isinstance(t, str) and t]


def _first_difference(a: Any, b: Any) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
