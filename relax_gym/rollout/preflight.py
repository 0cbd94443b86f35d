"""Certifies a model's chat template for exact multi-turn token bookkeeping.

Each synthetic conversation is built twice: by strict appending, exactly as the
rollout manager builds trajectories, and by one full re-render. Where they
differ, the report says where and shows both sides, and whether the difference
is expected: a template that rewrites earlier turns (Qwen3 drops old reasoning)
re-renders differently by design, and strict appending keeps the tokens the
model saw. A case that cannot be appended at all is an error. Tool calls are
written in the model's own tool-call format.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from relax_gym.messages import Message, audio, image, message, video
from relax_gym.models import LoadedModel
from relax_gym.models.template_traits import template_traits, turn_end_id
from relax_gym.rollout.tokens import ConversationTokens, first_difference
from relax_gym.tools.formats import ToolCallFormat
from relax_gym.video import Video, video_from_frames

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                       "required": ["city"]},
    },
}


def _says(fmt: ToolCallFormat, text: str) -> str:
    """`text` as a model of `fmt`'s family writes a reply with no call (gpt-oss: a final-channel message)."""
    return fmt.write_calls([], text)


def _calls(fmt: ToolCallFormat, name: str, *arguments: dict[str, Any]) -> tuple[str, list[str | None]]:
    """What a model of `fmt`'s family writes to make these calls, and the call ids it wrote (Mistral's)."""
    written = fmt.write_calls([(name, args) for args in arguments])
    return written, [c.id for c in fmt.parse(written).calls]


def _results(name: str, ids: list[str | None], *contents: Any) -> list[Message]:
    return [message("tool", *(c if isinstance(c, tuple) else (c,)), name=name,
                    **({"tool_call_id": i} if i else {})) for i, c in zip(ids, contents, strict=True)]


def _picture() -> Image.Image:
    img = Image.new("RGB", (224, 168), "white")
    ImageDraw.Draw(img).rectangle((40, 30, 120, 110), fill="red")
    return img


def _clip() -> Video:
    """A red square moving right over four frames, two per second."""
    frames = []
    for step in range(4):
        frame = Image.new("RGB", (96, 64), "white")
        ImageDraw.Draw(frame).rectangle((8 + 16 * step, 16, 32 + 16 * step, 40), fill="red")
        frames.append(frame)
    return video_from_frames(frames, 2.0)


def _tone() -> tuple[np.ndarray, int]:
    t = np.arange(8000) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000


Turn = tuple[str, list[Message]]  # (assistant text, the env's messages that follow it)


def cases(modalities: tuple[str, ...], fmt: ToolCallFormat) -> dict[str, tuple[list[Message], list[dict] | None,
                                                                         list[Turn]]]:
    """name -> (prompt messages, tools, turns); multimodal cases only for models that take them."""
    sys = message("system", "You are a helpful assistant.")
    paris, paris_ids = _calls(fmt, "get_weather", {"city": "Paris"})
    both, both_ids = _calls(fmt, "get_weather", {"city": "Paris"}, {"city": "Rome"})
    oslo, oslo_ids = _calls(fmt, "get_weather", {"city": "Oslo"})
    found: dict[str, tuple[list[Message], list[dict] | None, list[Turn]]] = {
        "plain multi-turn": ([sys, message("user", "Hi!")], None, [
            (_says(fmt, "Hello! How can I help?"), [message("user", "What is 2+2?")]),
            (_says(fmt, "2+2 = 4."), [message("user", "Thanks.")]),
            (_says(fmt, "You're welcome."), []),
        ]),
        "tool calls": ([sys, message("user", "Weather in Paris?")], [WEATHER_TOOL], [
            (paris, _results("get_weather", paris_ids, '{"temp_c": 18}')),
            (_says(fmt, "It is 18 °C in Paris."), []),
        ]),
        "parallel tool calls": ([sys, message("user", "Paris and Rome?")], [WEATHER_TOOL], [
            (both, _results("get_weather", both_ids, '{"temp_c": 18}', '{"temp_c": 24}')),
            (_says(fmt, "Paris 18 °C, Rome 24 °C."), []),
        ]),
        "think blocks": ([message("user", "Is 91 prime?")], None, [
            ("<think>\n91 = 7 * 13.\n</think>\n\nNo: 91 = 7 × 13.", [message("user", "And 97?")]),
            ("<think>\nNo divisor up to 9.\n</think>\n\nYes, 97 is prime.", []),
        ]),
        "think + tools": ([message("user", "Weather in Oslo?")], [WEATHER_TOOL], [
            ("<think>\nI should call the tool.\n</think>\n\n" + oslo, _results("get_weather", oslo_ids,
                                                                                 '{"temp_c": 3}')),
            ("<think>\nIt is cold.\n</think>\n\n3 °C in Oslo.", []),
        ]),
    }
    if "image" in modalities:
        zoom, zoom_ids = _calls(fmt, "zoom", {"bbox_2d": [40, 30, 120, 110]})
        crop = image(_picture().crop((40, 30, 120, 110)))
        found["images in prompt and tool response"] = ([message("user", image(_picture()), "What is drawn?")],
                                                       None, [
            (zoom, _results("zoom", zoom_ids, (crop,))),
            (_says(fmt, "A red square."), []),
        ])
    if "audio" in modalities:
        found["audio in prompt and follow-up"] = ([message("user", audio(*_tone()), "What do you hear?")], None, [
            (_says(fmt, "A tone."), [message("user", audio(*_tone()), "And now?")]),
            (_says(fmt, "The same tone."), []),
        ])
    if "video" in modalities:
        found["video in prompt and follow-up"] = ([message("user", video(_clip()), "What moves?")], None, [
            (_says(fmt, "A red square."), [message("user", video(_clip()), "Which way?")]),
            (_says(fmt, "To the right."), []),
        ])
    return found


@dataclass
class CaseResult:
    case: str
    match: bool
    appended_tokens: int
    rerendered_tokens: int
    first_diff: int | None = None
    appended_context: str = ""
    rerendered_context: str = ""
    error: str = ""
    #: the difference is the template rewriting earlier turns, which strict appending is built for
    expected: bool = False


def run_case(loaded: LoadedModel, name: str, prompt: list[Message], tools: list[dict] | None,
             turns: list[Turn]) -> CaseResult:
    tok = loaded.tokenizer
    stops, end = loaded.stop_token_ids(), turn_end_id(loaded)
    try:
        conv = ConversationTokens.start(loaded, prompt, tools)
        for text, env_messages in turns:
            ids = tok(text, add_special_tokens=False)["input_ids"] + [end]
            conv.append_generation(ids, [0.0] * len(ids), [0] * len(ids), stops)
            if env_messages:
                conv.append_observation(env_messages)
        rerendered = conv.rerendered_ids()
    except ValueError as err:  # TemplateError, ChatTemplateError, a message the template cannot take
        return CaseResult(name, False, 0, 0, error=str(err))
    diff = first_difference(conv.token_ids, rerendered)
    result = CaseResult(name, diff is None, len(conv.token_ids), len(rerendered), diff)
    if diff is not None:
        lo = max(0, diff - 8)
        result.appended_context = loaded.decode(conv.token_ids[lo:diff + 8])
        result.rerendered_context = loaded.decode(rerendered[lo:diff + 8])
        result.expected = conv.template_diff() is not None and conv.rewrites_history()
    return result


def preflight(loaded: LoadedModel) -> list[CaseResult]:
    from relax_gym.rollout.manager import tool_format_of

    fmt = tool_format_of(loaded)
    skip_tools = template_traits(loaded).ignores_tools
    return [run_case(loaded, name, *spec) for name, spec in cases(loaded.modalities, fmt).items()
            if not (skip_tools and _uses_tools(spec))]


def _uses_tools(spec: tuple[list[Message], list[dict] | None, list[Turn]]) -> bool:
    return spec[1] is not None or any(m["role"] == "tool" for _, env in spec[2] for m in env)


def report_dict(loaded: LoadedModel, results: list[CaseResult]) -> dict[str, Any]:
    """`certified`: every case appends (exactly, or differing only where the template rewrites history)."""
    traits = template_traits(loaded)
    warnings = []
    if traits.ignores_tools:
        warnings.append("the chat template ignores `tools`: the model would never see the tool schemas, and the "
                        "tool cases were skipped; pass a template that renders them (--chat-template / "
                        "model.chat_template: chatml-tools for a ChatML model)")
    return {
        "certified": all(r.match or r.expected for r in results),
        "exact": all(r.match for r in results),
        "strategy": "strict append: the tokens the model saw are trained; a full re-render differs where the "
                    f"template rewrites earlier turns ({traits.rewrites_history})" if traits.rewrites_history
                    else "strict append, equal to a full re-render",
        "rewrites_history": traits.rewrites_history,
        "end_tokens": list(traits.end_tokens),
        "warnings": warnings,
        "cases": [asdict(r) for r in results],
    }
