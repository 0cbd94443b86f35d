"""gpt-oss's harmony tool calls: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` messages.

Reasoning is the analysis channel; content the final channel and recipient-less commentary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from relax_gym.tools.formats.shared import Calls, call_with_json_args, make_turn, to_json
from relax_gym.tools.parser import MalformedToolCall, ParsedTurn, ToolCall, shown

H_START, H_END, H_CALL, H_RETURN = "<|start|>", "<|end|>", "<|call|>", "<|return|>"
H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|channel|>", "<|message|>", "<|constrain|>"
_H_SPLIT = re.compile(r"(<\|(?:start|end|call|return)\|>)")
_H_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


@dataclass(frozen=True)
class HarmonyFormat:
    """gpt-oss's harmony: messages `<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY`.

    The generation prompt ends at `<|start|>assistant`, so the text starts with the first
    message's header; messages are joined by `<|end|><|start|>assistant` (or `<|call|>...`).
    A message addressed `to=functions.NAME` (in its header, before or after `<|channel|>`)
    is a tool call with JSON arguments; `analysis` is reasoning; `final` and recipient-less
    `commentary` (a preamble) are content. Messages written for another role are dropped;
    text with no harmony markup at all is content.
    """

    name: str = "harmony"

    def parse(self, text: str) -> ParsedTurn:
        content: list[str] = []
        reasoning: list[str] = []
        found: list[ToolCall | MalformedToolCall] = []
        pieces = _H_SPLIT.split(text)  # chunk, delimiter, chunk, ...: the group keeps the delimiters
        for i in range(0, len(pieces), 2):
            chunk, opened = pieces[i], i > 0 and pieces[i - 1] == H_START
            cut = chunk.find(H_MESSAGE)
            header = chunk if cut < 0 else chunk[:cut]
            if cut < 0 and not opened and H_CHANNEL not in header:  # no header at all: bare text
                content.append(chunk)
                continue
            pre, _, post = header.partition(H_CHANNEL)
            found_recipient = _H_RECIPIENT.search(header)
            recipient = found_recipient.group(1) if found_recipient else None
            role = next((w for w in pre.split() if not w.startswith("to=")), None)
            if role not in (None, "assistant"):
                continue  # the model wrote another role's message (e.g. a tool's reply)
            if cut < 0:  # a header cut off before its message
                if recipient is not None:
                    problem = f"the call to {shown(recipient)} has no {H_MESSAGE} with its arguments"
                    found.append(MalformedToolCall(chunk, problem))
                continue
            body = chunk[cut + len(H_MESSAGE) :]
            channel = next((w for w in post.replace(H_CONSTRAIN, " ").split() if not w.startswith("to=")), None)
            if recipient is not None:
                if not recipient.startswith(_FUNCTIONS) or len(recipient) == len(_FUNCTIONS):
                    hint = f"unknown recipient {shown(recipient)}: address a tool call to=functions.TOOL_NAME"
                    found.append(MalformedToolCall(chunk, hint))
                else:
                    found.append(call_with_json_args(chunk, recipient[len(_FUNCTIONS) :], body))
            elif channel == "analysis":
                reasoning.append(body.strip())
            else:
                content.append(body.strip())
        return make_turn("\n".join(c for c in content if c.strip()), found, "\n".join(r for r in reasoning if r))

    def write_calls(self, calls: Calls, content: str = "") -> str:
        messages: list[tuple[str, str]] = []  # (message, the token that ends it)
        if content or not calls:
            channel = "commentary" if calls else "final"
            messages.append((f"{H_CHANNEL}{channel}{H_MESSAGE}{content}", H_END))
        for n, a in calls:
            header = f"{H_CHANNEL}commentary to={_FUNCTIONS}{n} {H_CONSTRAIN}json"
            messages.append((f"{header}{H_MESSAGE}{to_json(a)}", H_CALL))
        return "".join(
            msg + (f"{stop}{H_START}assistant" if i < len(messages) - 1 else "")
            for i, (msg, stop) in enumerate(messages)
        )

