"""A small byte-level BPE tokenizer with Qwen's special tokens, trained in memory.

The embedded tiny models must run with no hub access, yet exercise the same
token machinery as a real Qwen checkpoint: Qwen2's pre-tokenizer regex (digits
split one by one), byte-level fallback for any text, ChatML and multimodal
special tokens, and `<tool_call>` / `<think>` markers that survive
`skip_special_tokens` decoding so the tool-call parser still sees them.

`train_bpe` trains the same vocabulary with another family's special tokens
(and pre-tokenizer regex), for test fixtures of other model families.
"""

from __future__ import annotations

import functools
import json
import random

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from relax_gym.models.chat_template import CHAT_TEMPLATE

VOCAB_SIZE = 1024
# Qwen2's pre-tokenizer split: words with a leading non-letter, single digits, punctuation runs, newlines.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Control tokens: removed by `decode(skip_special_tokens=True)`.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_eos|>",
)
# Markup the model writes and parsers read: single tokens, but kept when decoding (as in Qwen).
MARKUP_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

_WORDS = (
    "the a an of to and in is it that for on with as be are was this by at or from not but have has "
    "what which who how when where why all can will would should could one two three four five six seven "
    "eight nine ten first second last next step answer question problem solve solution result number "
    "total sum product difference ratio value equal equals let then so therefore because since if else "
    "we you they he she i my your our their there here each every some many more less than most least "
    "time day year people water apple apples book books box boxes coin coins ball balls price cost "
    "buy sells bought sold left right up down image picture audio sound color red green blue object "
    "find count look think check compute calculate verify tool call function search read write file "
    "code python print return def import true false none null error output input list string integer "
    "final correct wrong yes no hello world user assistant system please help sure okay good thanks"
)
_SENTENCES = (
    "Let me think step by step.",
    "The answer is {a}.",
    "So the final answer is \\boxed{{{a}}}.",
    "We have {a} + {b} = {s}, so the total is {s}.",
    "If {a} apples cost {b} coins each, then {a} * {b} = {p}.",
    "Compute {a} - {b} and then multiply by {c}.",
    "Let x = {a}. Then x^2 = {q} and 2x + {b} = {r}.",
    "The ratio is \\frac{{{a}}}{{{b}}}, which equals {a}/{b}.",
    "I should call a tool to check the result.",
    "The image shows {a} red boxes and {b} blue balls.",
    "Error: invalid arguments: expression: field required",
    "Let me verify: {s} - {b} = {a}. Correct.",
)
_TOOLS = (
    ("calculator", "Evaluates an arithmetic expression.", "expression", "string"),
    ("python", "Runs Python code and returns its output.", "code", "string"),
    ("search", "Searches the documents for a query.", "query", "string"),
    ("zoom_in", "Crops and enlarges a region of the image.", "bbox", "array"),
    ("get_weather", "Returns the weather of a city.", "city", "string"),
)


def _corpus(lines: int = 3000) -> list[str]:
    """Deterministic text in the shapes tiny-model episodes use: words, arithmetic, tool JSON, chat prose."""
    rng = random.Random(0)
    words = _WORDS.split()
    corpus = [
        "You may call one or more functions to assist with the user query.",
        "You are provided with function signatures within XML tags:",
        "For each function call, return a json object with function name and arguments within XML tags:",
    ]
    for name, description, arg, kind in _TOOLS:
        schema = {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {arg: {"type": kind, "description": f"The {arg}."}},
                    "required": [arg],
                },
            },
        }
        corpus += [json.dumps(schema)] * 10
    for _ in range(lines):
        a, b, c = rng.randint(0, 99), rng.randint(1, 99), rng.randint(1, 9)
        nums = {"a": a, "b": b, "c": c, "s": a + b, "p": a * b, "q": a * a, "r": 2 * a + b}
        corpus.append(rng.choice(_SENTENCES).format(**nums))
        corpus.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + ".")
        name, _, arg, kind = rng.choice(_TOOLS)
        value = f"{a} * {b} + {c}" if kind == "string" else [a, b, a + c, b + c]
        corpus.append(json.dumps({"name": name, "arguments": {arg: value}}))
    return corpus


def train_bpe(
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    markup_tokens: tuple[str, ...] = MARKUP_TOKENS,
    *,
    split: str = QWEN_SPLIT,
    extra_text: tuple[str, ...] = (),
    vocab_size: int = VOCAB_SIZE,
) -> str:
    """A byte-level BPE trained on the shared corpus (plus `extra_text`), as tokenizer JSON.

    `special_tokens` are added as control tokens (dropped by `decode(skip_special_tokens=True)`),
    `markup_tokens` as single tokens that decoding keeps; both come after the trained vocabulary,
    whose size is `vocab_size` minus their count. `split` is the pre-tokenizer regex. Cached per
    argument tuple, so each distinct tokenizer is trained once per process (well under a second).
    """
    return _train_bpe(tuple(special_tokens), tuple(markup_tokens), split, tuple(extra_text), vocab_size)


@functools.cache
def _train_bpe(
    special_tokens: tuple[str, ...],
    markup_tokens: tuple[str, ...],
    split: str,
    extra_text: tuple[str, ...],
    vocab_size: int,
) -> str:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    reserved = len(special_tokens) + len(markup_tokens)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - reserved,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() + list(extra_text), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in markup_tokens])
    return tok.to_str()


def _trained_bpe() -> str:
    """The embedded tiny models' tokenizer as JSON; cached so every build after the first costs only a parse."""
    return train_bpe(SPECIAL_TOKENS, MARKUP_TOKENS)


def build_tokenizer(extra_special_tokens: dict[str, str] | None = None) -> PreTrainedTokenizerFast:
    """A fresh tokenizer object (callers may mutate it) over the cached trained vocabulary.

    `extra_special_tokens` names some of its special tokens for processors that read them off the tokenizer
    (`image_token`, `audio_token`, ... as the Qwen-Omni processors do); the vocabulary stays the same."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe()),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        **({"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}),
    )
