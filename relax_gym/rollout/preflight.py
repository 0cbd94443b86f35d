"""Certifies a model's chat template for exact multi-turn token continuity.

Each synthetic conversation is built twice: by strict appending, exactly as the
rollout manager builds trajectories, and by one full re-render. Where they
differ, training would see a token sequence the model never produced or will
never see again at inference; the report says where and shows both sides.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from relax_gym.messages import Message, audio, image, message
from relax_gym.models import LoadedModel, render
from relax_gym.rollout.manager import _eos_ids
from relax_gym.rollout.tokens import ConversationTokens, TemplateError

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                       "required": ["city"]},
    },
}


def _call(city: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "get_weather", "arguments": {"city": city}})}\n</tool_call>'


def _picture() -> Image.Image:
    img = Image.new("RGB", (224, 168), "white")
    ImageDraw.Draw(img).rectangle((40, 30, 120, 110), fill="red")
    return img


def _tone() -> tuple[np.ndarray, int]:
    t = np.arange(8000) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000


Turn = tuple[str, list[Message]]  # (assistant text, the env's messages that follow it)


def cases(modalities: tuple[str, ...]) -> dict[str, tuple[list[Message], list[dict] | None, list[Turn]]]:
    """name -> (prompt messages, tools, turns); multimodal cases only for models that take them."""
    sys = message("system", "You are a helpful assistant.")
    found: dict[str, tuple[list[Message], list[dict] | None, list[Turn]]] = {
        "plain multi-turn": ([sys, message("user", "Hi!")], None, [
            ("Hello! How can I help?", [message("user", "What is 2+2?")]),
            ("2+2 = 4.", [message("user", "Thanks.")]),
            ("You're welcome.", []),
        ]),
        "tool calls": ([sys, message("user", "Weather in Paris?")], [WEATHER_TOOL], [
            (_call("Paris"), [message("tool", '{"temp_c": 18}', name="get_weather")]),
            ("It is 18 °C in Paris.", []),
        ]),
        "parallel tool calls": ([sys, message("user", "Paris and Rome?")], [WEATHER_TOOL], [
            (_call("Paris") + "\n" + _call("Rome"), [message("tool", '{"temp_c": 18}', name="get_weather"),
                                                     message("tool", '{"temp_c": 24}', name="get_weather")]),
            ("Paris 18 °C, Rome 24 °C.", []),
        ]),
        "think blocks": ([message("user", "Is 91 prime?")], None, [
            ("<think>\n91 = 7 * 13.\n</think>\n\nNo: 91 = 7 × 13.", [message("user", "And 97?")]),
            ("<think>\nNo divisor up to 9.\n</think>\n\nYes, 97 is prime.", []),
        ]),
        "think + tools": ([message("user", "Weather in Oslo?")], [WEATHER_TOOL], [
            ("<think>\nI should call the tool.\n</think>\n\n" + _call("Oslo"),
             [message("tool", '{"temp_c": 3}', name="get_weather")]),
            ("<think>\nIt is cold.\n</think>\n\n3 °C in Oslo.", []),
        ]),
    }
    if "image" in modalities:
        found["images in prompt and tool response"] = ([message("user", image(_picture()), "What is drawn?")],
                                                       None, [
            ('<tool_call>\n{"name": "zoom", "arguments": {"bbox_2d": [40, 30, 120, 110]}}\n</tool_call>',
             [message("tool", image(_picture().crop((40, 30, 120, 110))), name="zoom")]),
            ("A red square.", []),
        ])
    if "audio" in modalities:
        found["audio in prompt and follow-up"] = ([message("user", audio(*_tone()), "What do you hear?")], None, [
            ("A tone.", [message("user", audio(*_tone()), "And now?")]),
            ("The same tone.", []),
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


def run_case(loaded: LoadedModel, name: str, prompt: list[Message], tools: list[dict] | None,
             turns: list[Turn]) -> CaseResult:
    tok = loaded.tokenizer
    eos = _eos_ids(loaded)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    end = end if end in eos else tok.eos_token_id
    try:
        conv = ConversationTokens.start(loaded, prompt, tools)
        for text, env_messages in turns:
            ids = tok(text, add_special_tokens=False)["input_ids"] + [end]
            conv.append_generation(ids, [0.0] * len(ids), 0, eos)
            if env_messages:
                conv.append_observation(env_messages)
        diff = conv.rerender_diff()
    except (TemplateError, ValueError) as err:
        return CaseResult(name, False, 0, 0, error=str(err))
    rerendered = render(loaded, conv.messages, tools=tools, add_generation_prompt=False)
    result = CaseResult(name, diff is None, len(conv.token_ids), len(rerendered), diff)
    if diff is not None:
        lo = max(0, diff - 8)
        result.appended_context = tok.decode(conv.token_ids[lo:diff + 8])
        result.rerendered_context = tok.decode(rerendered[lo:diff + 8])
    return result


def preflight(loaded: LoadedModel) -> list[CaseResult]:
    return [run_case(loaded, name, *spec) for name, spec in cases(loaded.modalities).items()]


def report_dict(results: list[CaseResult]) -> dict[str, Any]:
    return {"certified": all(r.match for r in results), "cases": [asdict(r) for r in results]}
