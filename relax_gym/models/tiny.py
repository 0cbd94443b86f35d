"""Embedded tiny models: real Qwen architectures with random weights, built in milliseconds.

They let every part of the stack (rollouts, engines, trainers, the CLI) run on a
CPU with no hub access while going through the same code paths as a real
checkpoint: Qwen3 for text, Qwen3-MoE for routed experts, Qwen3-VL for images and
video, Qwen2-Audio for audio, Qwen3-Omni's thinker for all of them at once, on one
trained-in-memory tokenizer and one chat template.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    Qwen2VLImageProcessorPil,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    WhisperFeatureExtractor,
)

from relax_gym.models.chat_template import CHAT_TEMPLATE
from relax_gym.models.tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer
from relax_gym.models.video_processor import FramesVideoProcessor, frames_video

# Qwen3-VL patches are 16 px, merged 2x2: one image token per 32x32 px. Bounding the area to 4..64
# tokens keeps any image (a 896x672 one included) to at most 256 patches.
VL_PATCH, VL_MERGE = 16, 2
# 32 mel bins over 2 s chunks at 16 kHz: 200 frames, i.e. 25 audio tokens per second, 50 per chunk.
AUDIO_MEL_BINS, AUDIO_CHUNK_S = 32, 2

ModelT = TypeVar("ModelT", bound=PreTrainedModel)

_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seeds weight init without disturbing the caller's global RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _token_ids(tokenizer: PreTrainedTokenizerFast, tokens: list[str]) -> list[int]:
    """`convert_tokens_to_ids` of a list: a list (transformers types the result as either form)."""
    return cast("list[int]", tokenizer.convert_tokens_to_ids(tokens))


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    eos, pad = _token_ids(tokenizer, [EOS_TOKEN, PAD_TOKEN])
    return {"vocab_size": len(tokenizer), "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None}


def _finish(model: ModelT, tokenizer: PreTrainedTokenizerFast) -> ModelT:
    """Qwen's generation defaults: stop at `<|im_end|>` or `<|endoftext|>`, greedy unless asked."""
    ids = _special_ids(tokenizer)
    model.generation_config.eos_token_id = [ids["eos_token_id"], ids["pad_token_id"]]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    model.generation_config.bos_token_id = None
    return model.eval()


def vl_image_processor(patch: int, merge: int) -> Qwen2VLImageProcessorPil:
    """The PIL image processor of the tiny Qwen-VL models: 4..64 merged patches per image, mean/std 0.5."""
    area = (patch * merge) ** 2
    return Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=2,
        min_pixels=4 * area,
        max_pixels=64 * area,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def vl_video_processor(patch: int, merge: int, stands_for: str = "Qwen3VLVideoProcessor") -> FramesVideoProcessor:
    """The video processor of the tiny Qwen-VL models: 2 frames per temporal patch, 4..64 merged patches per
    clip in all (a clip's frames share the budget), mean/std 0.5."""
    area = (patch * merge) ** 2
    return FramesVideoProcessor(patch_size=patch, merge_size=merge, temporal_patch_size=2, stands_for=stands_for,
                                size={"shortest_edge": 4 * area, "longest_edge": 2 * 64 * area})


def build_tiny_text(seed: int = 0) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """Qwen3ForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, tied embeddings (as Qwen3-0.6B)."""
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        **_TEXT,
        **_special_ids(tokenizer),
        head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    with seeded(seed):
        model = Qwen3ForCausalLM(config)
    return _finish(model, tokenizer), tokenizer


def build_tiny_vl(seed: int = 0) -> tuple[Qwen3VLForConditionalGeneration, ProcessorMixin]:
    """Qwen3-VL with a 2-layer, 32-wide vision tower; images go through the PIL image processor."""
    tokenizer = build_tokenizer()
    image_token, video_token, start, end = _token_ids(
        tokenizer, ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    )
    config = Qwen3VLConfig(
        text_config={
            **_TEXT,
            **_special_ids(tokenizer),
            "head_dim": 16,
            # M-RoPE splits head_dim / 2 = 8 frequencies over (t, h, w).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": VL_PATCH,
            "spatial_merge_size": VL_MERGE,
            "temporal_patch_size": 2,
            "out_hidden_size": _TEXT["hidden_size"],
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1],
        },
        image_token_id=image_token,
        video_token_id=video_token,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    with seeded(seed):
        model = Qwen3VLForConditionalGeneration(config)
    processor = frames_video(Qwen3VLProcessor)(
        image_processor=vl_image_processor(VL_PATCH, VL_MERGE), tokenizer=tokenizer,
        video_processor=vl_video_processor(VL_PATCH, VL_MERGE), chat_template=CHAT_TEMPLATE)
    return _finish(model, tokenizer), processor


def build_tiny_moe(seed: int = 0) -> tuple[Qwen3MoeForCausalLM, PreTrainedTokenizerFast]:
    """Qwen3MoeForCausalLM (Qwen3-30B-A3B's architecture): both layers sparse, 8 experts of width 32, 2 routed
    per token, top-k weights renormalised; otherwise the text model's shape."""
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        **_TEXT,
        **_special_ids(tokenizer),
        num_experts=8,  # heads of 64 / 4 = 16, as the text model's (this config takes no head_dim)
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    with seeded(seed):
        model = Qwen3MoeForCausalLM(config)
    return _finish(model, tokenizer), tokenizer


#: the names Qwen-Omni processors read off their tokenizer, given to this tokenizer's own tokens
OMNI_TOKENS: dict[str, str] = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}


def build_tiny_omni(seed: int = 0) -> tuple[Qwen3OmniMoeThinkerForConditionalGeneration, ProcessorMixin]:
    """Qwen3-Omni's thinker: text, images, audio and video in one conversation. A mixture-of-experts language
    model (tiny-moe's experts) under tiny-vl's vision tower (which encodes images and video frames alike) and a
    2-layer, 32-wide audio encoder over tiny-audio's 32-bin mel features. The stock Qwen3-Omni processor drives
    it, with `FramesVideoProcessor` for its video part; its clip pixel budget is that processor's own."""
    tokenizer = build_tokenizer(OMNI_TOKENS)
    image, video, audio, vision_start, vision_end, audio_start = _token_ids(tokenizer, [
        "<|image_pad|>", "<|video_pad|>", "<|AUDIO|>", "<|vision_start|>", "<|vision_end|>", "<|audio_bos|>"])
    # fields the model reads (its position ids) that the config class does not declare, as real checkpoints have
    vision_tags: dict[str, Any] = {"vision_start_token_id": vision_start, "vision_end_token_id": vision_end}
    config = Qwen3OmniMoeThinkerConfig(
        text_config={
            **_TEXT, **_special_ids(tokenizer), "head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True},
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": VL_PATCH,
            "spatial_merge_size": VL_MERGE, "temporal_patch_size": 2, "out_hidden_size": _TEXT["hidden_size"],
            "num_position_embeddings": 64, "deepstack_visual_indexes": [1],
        },
        audio_config={
            "num_mel_bins": AUDIO_MEL_BINS, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
            "d_model": 32, "output_dim": _TEXT["hidden_size"], "downsample_hidden_size": 16,
        },
        image_token_id=image, video_token_id=video, audio_token_id=audio, audio_start_token_id=audio_start,
        **vision_tags,
    )
    with seeded(seed):
        model = Qwen3OmniMoeThinkerForConditionalGeneration(config)
    processor = frames_video(Qwen3OmniMoeProcessor)(
        image_processor=vl_image_processor(VL_PATCH, VL_MERGE),
        video_processor=vl_video_processor(VL_PATCH, VL_MERGE),
        feature_extractor=WhisperFeatureExtractor(feature_size=AUDIO_MEL_BINS, chunk_length=AUDIO_CHUNK_S),
        tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
    )
    return _finish(model, tokenizer), processor


def build_tiny_audio(seed: int = 0) -> tuple[Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor]:
    """Qwen2-Audio with a 2-layer, 32-wide Whisper-style encoder over 32-bin, 2-second mel chunks."""
    tokenizer = build_tokenizer()
    feature_extractor = WhisperFeatureExtractor(feature_size=AUDIO_MEL_BINS, chunk_length=AUDIO_CHUNK_S)
    config = Qwen2AudioConfig(
        audio_config={
            "num_mel_bins": AUDIO_MEL_BINS,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            # conv2 halves the frames: positions = frames / 2.
            "max_source_positions": feature_extractor.nb_max_frames // 2,
        },
        text_config={"model_type": "qwen2", **_TEXT, **_special_ids(tokenizer)},
        audio_token_index=_token_ids(tokenizer, ["<|AUDIO|>"])[0],
    )
    with seeded(seed):
        model = Qwen2AudioForConditionalGeneration(config)
    processor = Qwen2AudioProcessor(
        feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )
    return _finish(model, tokenizer), processor
