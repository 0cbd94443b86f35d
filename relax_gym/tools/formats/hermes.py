"""Qwen2.5 / Qwen3 / Hermes tool calls: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

`hermes-loose` also reads those calls written without the tags (bare or in a ``` fence).
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_gym.tools.formats.llama3 import llama3_calls
from relax_gym.tools.formats.shared import Calls, make_turn, to_json
from relax_gym.tools.parser import CLOSE, OPEN, ParsedTurn, code_blocks, parse_tool_calls


def _trailing_fence(content: str) -> tuple[str, str]:
    """`(prose, body)` when `content` ends in a ```json (or bare ```) block; else `("", content)`."""
    content = content.rstrip()
    blocks = code_blocks(content)
    last = blocks[-1] if blocks else None
    if last is None or last.end != len(content) or last.language not in ("", "json"):
        return "", content
    return content[: last.start], last.body


@dataclass(frozen=True)
class HermesFormat:
    """Qwen / Hermes: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks after optional prose.

    `loose` (registered as "hermes-loose") also reads the calls small Qwen2.5 models write without
    the tags their template teaches, measured on Qwen2.5-Coder-0.5B-Instruct (docs/envs.md): when
    a reply has no `<tool_call>`, its content is calls if all of it is call-shaped JSON (an object
    with "name" and "arguments" or "parameters", a list of them, or objects joined by `;`; Llama 3's
    reader, so a pythonic `[f(x=1)]` list counts too), or if it ends in one ``` fence (```json or
    bare) whose whole body is that; the prose before the fence stays content. Anything else is
    prose, as in the strict format.
    """

    name: str = "hermes"
    loose: bool = False

    def parse(self, text: str) -> ParsedTurn:
        turn = parse_tool_calls(text)
        if not self.loose or turn.has_tool_calls:
            return turn
        prose, body = _trailing_fence(turn.content)
        found = llama3_calls(body, strict=False)
        if found is None:
            return turn
        return make_turn(prose, found, turn.reasoning)

    def write_calls(self, calls: Calls, content: str = "") -> str:
        blocks = [f"{OPEN}\n{to_json({'name': n, 'arguments': a})}\n{CLOSE}" for n, a in calls]
        return "\n".join(([content] if content else []) + blocks)
