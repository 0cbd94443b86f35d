"""DeepSeek tool calls, R1 / V3 and V3.1 shapes.

    R1 / V3  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json ...`
    V3.1     `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_gym.tools.formats.shared import Calls, call_with_json_args, make_turn, to_json
from relax_gym.tools.parser import MalformedToolCall, ParsedTurn, ToolCall, shown, split_reasoning

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_EOS = "<｜end▁of▁sentence｜>"


def _deepseek_call(raw: str) -> ToolCall | MalformedToolCall:
    sep = raw.find(DS_SEP)
    if sep < 0:
        return MalformedToolCall(raw, f"missing {DS_SEP} between the tool's name and its arguments")
    left, right = raw[:sep].strip(), raw[sep + len(DS_SEP) :]
    fence = right.find("```")
    if left == "function" and (fence >= 0 or "\n" in right.strip()):  # R1 / V3: function<sep>NAME\n```json\n{}\n```
        newline = right.find("\n")
        split = min(i for i in (fence, newline, len(right)) if i >= 0)
        name, args_text = right[:split].strip(), right[split:].strip()
        if args_text.startswith("```"):
            args_text = args_text[3:].removeprefix("json")
            close = args_text.rfind("```")
            if close < 0:
                return MalformedToolCall(raw, f"unclosed ```json block in the arguments of {shown(name)}")
            args_text = args_text[:close]
    else:  # V3.1: NAME<sep>{json}
        name, args_text = left, right
    if not name:
        return MalformedToolCall(raw, "a tool call needs the tool's name")
    return call_with_json_args(raw, name, args_text)


@dataclass(frozen=True)
class DeepSeekFormat:
    """DeepSeek: calls between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`, in the R1 or the V3.1 shape.

    Both shapes are read whatever the style; `style` ("r1" or "v3.1") picks what `write_calls`
    writes. Reasoning is the text before `</think>` (the R1 prompt opens the block).
    """

    name: str = "deepseek"
    style: str = "r1"

    def __post_init__(self) -> None:
        if self.style not in ("r1", "v3.1"):
            raise ValueError(f"DeepSeekFormat style must be 'r1' or 'v3.1', got {self.style!r}")

    def parse(self, text: str) -> ParsedTurn:
        reasoning, text = split_reasoning(text)
        text = text.rstrip().removesuffix(DS_EOS)
        opened = DS_CALLS_BEGIN in text
        text = text.replace(DS_CALLS_BEGIN, "").replace(DS_CALLS_END, "")
        found: list[ToolCall | MalformedToolCall] = []
        prose: list[str] = []
        pos = 0
        while (start := text.find(DS_CALL_BEGIN, pos)) >= 0:  # str.find: linear, as in the hermes parser
            end = text.find(DS_CALL_END, start + len(DS_CALL_BEGIN))
            if end < 0:
                break
            prose.append(text[pos:start])
            found.append(_deepseek_call(text[start + len(DS_CALL_BEGIN) : end]))
            pos = end + len(DS_CALL_END)
        tail = text[pos:]
        if DS_CALL_BEGIN in tail:
            cut = tail.index(DS_CALL_BEGIN)
            problem = f"unclosed {DS_CALL_BEGIN}: the call must end with {DS_CALL_END}"
            found.append(MalformedToolCall(tail[cut:], problem))
            tail = tail[:cut]
        prose.append(tail)
        if opened and not found:
            found.append(MalformedToolCall(text, f"{DS_CALLS_BEGIN} must be followed by {DS_CALL_BEGIN}"))
        return make_turn("".join(prose), found, reasoning)

    def write_calls(self, calls: Calls, content: str = "") -> str:
        if not calls:
            return content
        if self.style == "v3.1":
            body = "".join(f"{DS_CALL_BEGIN}{n}{DS_SEP}{to_json(a)}{DS_CALL_END}" for n, a in calls)
        else:
            body = "\n".join(
                f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{to_json(a)}\n```{DS_CALL_END}" for n, a in calls
            )
        return f"{content}{DS_CALLS_BEGIN}{body}{DS_CALLS_END}"

