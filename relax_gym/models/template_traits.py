"""What a chat template does that strict token appending must know, found by rendering probe conversations.

Real templates are not append-stable: Qwen3's drops the reasoning of assistant
turns before the last query and writes an empty think block only on a last
turn; gpt-oss ends the last assistant message with `<|return|>` and earlier
ones with `<|end|>`; Mistral's moves the system prompt to the last user turn.
The probes here find, for any template, the texts that end an assistant turn
and whether (and how) a turn's rendering changes once a message follows it.
Results are cached per model, template and template kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_gym.messages import Message, message
from relax_gym.models.inputs import chat_text
from relax_gym.models.loading import LoadedModel

#: invisible-separator-wrapped markers no template emits on its own: an assistant's content, the next message's
MARK = "\u2063RELAX\u2063"
NEXT = "\u2063NEXT\u2063"


class TemplateError(ValueError):
    """The chat template does not behave as strict appending requires (named with the evidence)."""


@dataclass(frozen=True)
class TemplateTraits:
    #: texts that end an assistant turn: the model's stop tokens and the template's own end-of-message tokens
    end_tokens: tuple[str, ...]
    #: the token the template closes a last assistant turn with (`<|im_end|>`, `<end_of_turn>`, `<|return|>`), or None
    turn_end: str | None
    #: why a full re-render of a conversation differs from appending it turn by turn; None when it does not
    rewrites_history: str | None
    #: the template renders the same text with and without `tools`: the model would never see the schemas
    ignores_tools: bool
    #: the tokenizer's added tokens (control and markup), longest first
    added_tokens: tuple[str, ...]

    def starts_with_added_token(self, text: str) -> str | None:
        """The added token `text` starts with, or None."""
        return next((t for t in self.added_tokens if text.startswith(t)), None)


_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool", "description": "A probe.",
                 "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
}


def _render(loaded: LoadedModel, messages: list[Message], *, generation: bool = False,
            tools: list[dict[str, Any]] | None = None) -> str:
    return chat_text(loaded, messages, tools=tools, add_generation_prompt=generation)


def _added_tokens(loaded: LoadedModel) -> tuple[str, ...]:
    return tuple(sorted(loaded.tokenizer.get_added_vocab(), key=len, reverse=True))


def _first_token(loaded: LoadedModel, text: str) -> str | None:
    """The first token of `text` when it is an added token (a control or markup token), else None."""
    return next((t for t in _added_tokens(loaded) if text.startswith(t)), None)


def after_mark(text: str, what: str) -> str:
    """The text after the one marker assistant content in `text`; TemplateError if it is not there exactly once."""
    if text.count(MARK) != 1:
        raise TemplateError(f"the chat template does not render an assistant's content verbatim ({what}: the "
                            f"content appears {text.count(MARK)} times in {text[-200:]!r})")
    return text.split(MARK, 1)[1]


def _end_tokens(loaded: LoadedModel) -> tuple[tuple[str, ...], str | None]:
    """The end tokens, and the one the template closes a last assistant turn with."""
    tok = loaded.tokenizer
    found = [t for t in tok.convert_ids_to_tokens(sorted(loaded.stop_token_ids())) if isinstance(t, str)]
    asked = [message("user", "x"), message("assistant", MARK)]
    closings = [_first_token(loaded, after_mark(text, "probing how a turn ends"))
                for text in (_render(loaded, asked), _render(loaded, [*asked, message("user", NEXT)]))]
    found += [t for t in dict.fromkeys(closings) if t is not None and t not in found]
    return tuple(found), closings[0]


def _rewrites_history(loaded: LoadedModel) -> str | None:
    """How an assistant turn's rendering changes once a message follows it, or None."""
    for head in ([message("system", "S")], []):
        asked = [*head, message("user", "x"), message("assistant", f"<think>\nr\n</think>\n\n{MARK}")]
        try:
            last = _render(loaded, asked)
            followed = _render(loaded, [*asked, message("user", NEXT)])
        except ValueError:  # a template that refuses a system turn (ChatTemplateError): probe without one
            continue
        if MARK not in last or MARK not in followed:
            return "it drops the content of earlier assistant turns"
        before_last, before_followed = last.split(MARK, 1)[0], followed.split(MARK, 1)[0]
        if before_last != before_followed:
            if "<think>" in before_last and "<think>" not in before_followed:
                return "it drops the reasoning of assistant turns once a later user turn follows"
            return (f"the conversation up to an assistant turn renders as {before_last[-60:]!r} while the turn is "
                    f"last and as {before_followed[-60:]!r} once a message follows it")
        end_last = last.split(MARK, 1)[1]
        end_followed = followed.split(MARK, 1)[1]
        if not end_followed.startswith(end_last):
            return (f"the last assistant turn ends with {end_last[:40]!r}, earlier ones with "
                    f"{end_followed[:len(end_last) + 10]!r}")
        prompted = _render(loaded, asked[:-1], generation=True)
        plain = _render(loaded, [*asked[:-1], message("assistant", MARK), message("user", NEXT)])
        if not plain.startswith(prompted + MARK):
            at = common_prefix(prompted + MARK, plain)
            return (f"the generation prompt writes {prompted[at:][:40]!r} where the history renders "
                    f"{plain[at:].split(MARK)[0][:40]!r} before an assistant's content")
        return None
    return None


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _ignores_tools(loaded: LoadedModel) -> bool:
    asked = [message("user", "x")]
    try:
        return _render(loaded, asked, generation=True, tools=[_PROBE_TOOL]) == _render(loaded, asked, generation=True)
    except ValueError:  # a template that refuses tools (ChatTemplateError) does not ignore them silently
        return False


def template_traits(loaded: LoadedModel) -> TemplateTraits:
    """The traits of `loaded`'s current template and template kwargs, probed once and cached on `loaded`."""
    template = getattr(loaded.processor, "chat_template", None) or loaded.tokenizer.chat_template
    key = (template, repr(sorted(loaded.template_kwargs.items())))
    cache: dict[Any, TemplateTraits] = loaded.__dict__.setdefault("_template_traits", {})
    if key not in cache:
        end_tokens, turn_end = _end_tokens(loaded)
        cache[key] = TemplateTraits(end_tokens, turn_end, _rewrites_history(loaded), _ignores_tools(loaded),
                                    _added_tokens(loaded))
    return cache[key]


def turn_end_id(loaded: LoadedModel) -> int:
    """The stop token a model ends an assistant turn with: the one its template closes turns with, if the
    model stops on it (Gemma: `<end_of_turn>`, not `<eos>`), else the tokenizer's EOS, else the lowest stop id."""
    stops = loaded.stop_token_ids()
    closing = template_traits(loaded).turn_end
    if closing is not None and (token := loaded.tokenizer.convert_tokens_to_ids(closing)) in stops:
        return int(token)
    eos = loaded.tokenizer.eos_token_id
    if eos in stops:
        return int(eos)
    if not stops:
        raise ValueError(f"model {loaded.name!r} has no stop token ids")
    return min(stops)
