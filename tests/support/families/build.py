"""Builders behind `families.FAMILIES`: a tokenizer per vocabulary and a tiny random-weight model per family.

Each tokenizer is the project's in-memory byte-level BPE (`relax_gym.models.tokenizer.train_bpe`)
with the family's own special tokens, end / pad / BOS tokens and chat template. Each model is a
real architecture of the family (Qwen3, Qwen2, Llama, Mistral, Gemma 3, gpt-oss; Qwen2.5-VL and
Qwen3-VL for images) at the size of `relax_gym.models.tiny`'s: hidden 64, 2 layers, random weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from relax_gym.models import LoadedModel, build_tiny_vl, config_modalities, frames_video
from relax_gym.models.tiny import seeded, vl_image_processor, vl_video_processor
from relax_gym.models.tokenizer import MARKUP_TOKENS, QWEN_SPLIT, SPECIAL_TOKENS, train_bpe

TEMPLATES = Path(__file__).parent / "templates"

# cl100k-style split (Llama 3, gpt-oss): digits in runs of up to three rather than one by one.
TIKTOKEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
HEAD_DIM = 16
# Qwen2.5-VL: 14 px patches merged 2x2, one image token per 28x28 px; 4..64 tokens an image.
VL25_PATCH, VL25_MERGE = 14, 2


@dataclass(frozen=True)
class Vocab:
    """A family's tokens: control tokens (special), markup kept by decoding, and the named ones."""

    special: tuple[str, ...]
    markup: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None = None
    unk: str | None = None
    add_bos: bool = False  # `tokenizer(text)` prepends BOS (as Llama 3 / Mistral / Gemma / R1-Distill do)
    split: str = QWEN_SPLIT


DEEPSEEK_TOOL_TOKENS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
)

VOCABS: dict[str, Vocab] = {
    # Qwen3 / Qwen3-VL: exactly the embedded tiny models' vocabulary (one shared training).
    "qwen3": Vocab(SPECIAL_TOKENS, MARKUP_TOKENS, eos="<|im_end|>", pad="<|endoftext|>"),
    # Qwen2.5 has <tool_call> tokens but no <think> / <tool_response> ones.
    "qwen2.5": Vocab(SPECIAL_TOKENS, ("<tool_call>", "</tool_call>"), eos="<|im_end|>", pad="<|endoftext|>"),
    "llama3": Vocab(
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|finetune_right_pad_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        (),
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        bos="<|begin_of_text|>",
        add_bos=True,
        split=TIKTOKEN_SPLIT,
    ),
    "mistral": Vocab(
        (
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        (),
        eos="</s>",
        pad="<unk>",
        bos="<s>",
        unk="<unk>",
        add_bos=True,
    ),
    # R1-Distill-Qwen: pad is the EOS token, as in its tokenizer config.
    "deepseek-r1": Vocab(
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        ("<think>", "</think>", *DEEPSEEK_TOOL_TOKENS),
        eos="<｜end▁of▁sentence｜>",
        pad="<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        add_bos=True,
    ),
    "gpt-oss": Vocab(
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|return|>",
            "<|constrain|>",
            "<|channel|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|call|>",
        ),
        (),
        eos="<|return|>",
        pad="<|endoftext|>",
        bos="<|startoftext|>",
        split=TIKTOKEN_SPLIT,
    ),
    "gemma": Vocab(
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        (),
        eos="<eos>",
        pad="<pad>",
        bos="<bos>",
        unk="<unk>",
        add_bos=True,
    ),
}


def template(name: str) -> str:
    """A family's chat template source, as written in templates/<name>.jinja."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def tokenizer(vocab: Vocab, chat_template: str) -> PreTrainedTokenizerFast:
    """A fresh tokenizer over `vocab`'s cached trained BPE, carrying `chat_template`."""
    # unk / bos are passed even when None: saved as null, so a loader's class default (Qwen2Tokenizer's
    # unk `<|endoftext|>`) does not add a token the model has no embedding for.
    kwargs: dict[str, Any] = {
        "eos_token": vocab.eos,
        "pad_token": vocab.pad,
        "bos_token": vocab.bos,
        "unk_token": vocab.unk,
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(train_bpe(vocab.special, vocab.markup, split=vocab.split)),
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        add_bos_token=vocab.add_bos,
        **kwargs,
    )


def _ids(tok: PreTrainedTokenizerFast) -> dict[str, Any]:
    return {
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
    }


def _seeded_model(cls: type[PreTrainedModel], config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    with seeded(seed):
        return cls(config)


def _finish(model: PreTrainedModel, tok: PreTrainedTokenizerFast, stop_tokens: tuple[str, ...]) -> PreTrainedModel:
    """The family's generation defaults: stop on every one of `stop_tokens`, pad with the pad token."""
    ids = tok.convert_tokens_to_ids(list(stop_tokens))
    if tok.unk_token_id is not None and tok.unk_token_id in ids:
        raise ValueError(f"a stop token of {stop_tokens} is not in the vocabulary")
    model.generation_config.eos_token_id = ids
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model.eval()


def _text_config(name: str, tok: PreTrainedTokenizerFast) -> tuple[type[PreTrainedModel], PretrainedConfig]:
    common = {**TEXT, **_ids(tok), "head_dim": HEAD_DIM}
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if name == "qwen3":
        return Qwen3ForCausalLM, Qwen3Config(**common, tie_word_embeddings=True, rope_parameters=rope)
    if name in ("qwen2.5", "deepseek-r1"):  # R1-Distill-Qwen is a Qwen2 model
        return Qwen2ForCausalLM, Qwen2Config(**common, tie_word_embeddings=True, rope_parameters=rope)
    if name == "llama3":
        rope = {"rope_type": "default", "rope_theta": 500_000.0}
        return LlamaForCausalLM, LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
    if name == "mistral":
        return MistralForCausalLM, MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if name == "gemma":
        config = Gemma3TextConfig(
            **common,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=256,
            layer_types=["sliding_attention", "full_attention"],
        )
        return Gemma3ForCausalLM, config
    if name == "gpt-oss":
        config = GptOssConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
        )
        return GptOssForCausalLM, config
    raise KeyError(name)


def build_text(name: str, vocab: str, stop_tokens: tuple[str, ...]) -> LoadedModel:
    tok = tokenizer(VOCABS[vocab], template(name))
    cls, config = _text_config(name, tok)
    model = _finish(_seeded_model(cls, config), tok, stop_tokens)
    return LoadedModel(model, tok, None, ("text",), name)


def build_qwen3_vl(name: str, stop_tokens: tuple[str, ...]) -> LoadedModel:
    """The embedded tiny Qwen3-VL (same vocabulary as qwen3), with the family template."""
    model, processor = build_tiny_vl()
    chat_template = template(name)
    processor.chat_template = chat_template
    processor.tokenizer.chat_template = chat_template
    model = _finish(model, processor.tokenizer, stop_tokens)
    return LoadedModel(model, processor.tokenizer, processor, config_modalities(model.config), name)


def build_qwen25_vl(name: str, stop_tokens: tuple[str, ...]) -> LoadedModel:
    """Qwen2.5-VL: a 2-layer, 32-wide windowed vision tower over 14 px patches, M-RoPE text model."""
    tok = tokenizer(VOCABS["qwen2.5"], template(name))
    image, video, start, end = tok.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    )
    config = Qwen2_5_VLConfig(
        text_config={
            **TEXT,
            **_ids(tok),
            # M-RoPE splits head_dim / 2 = 8 frequencies over (t, h, w).
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": VL25_PATCH,
            "spatial_merge_size": VL25_MERGE,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "out_hidden_size": TEXT["hidden_size"],
        },
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    model = _finish(_seeded_model(Qwen2_5_VLForConditionalGeneration, config), tok, stop_tokens)
    image_processor = vl_image_processor(VL25_PATCH, VL25_MERGE)
    video_processor = vl_video_processor(VL25_PATCH, VL25_MERGE, stands_for="Qwen2VLVideoProcessor")
    processor = frames_video(Qwen2_5_VLProcessor)(
        image_processor=image_processor, tokenizer=tok, video_processor=video_processor, chat_template=template(name)
    )
    return LoadedModel(model, tok, processor, config_modalities(model.config), name)


@functools.cache
def load(name: str, vocab: str, stop_tokens: tuple[str, ...]) -> LoadedModel:
    """The family's model, built once per process."""
    if name == "qwen3-vl":
        return build_qwen3_vl(name, stop_tokens)
    if name == "qwen2.5-vl":
        return build_qwen25_vl(name, stop_tokens)
    return build_text(name, vocab, stop_tokens)
