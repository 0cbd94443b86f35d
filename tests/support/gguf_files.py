"""A GGUF file written as llama.cpp's converter lays one out, for a tiny Llama (the real SmolLM2's architecture).

Written with the `gguf` package's own writer, tensor-name map and quantizer, so what transformers reads is a
file of the real format, not one of ours: llama.cpp's tensor names (`blk.N.attn_q.weight`, ...), its q/k row
order (each head's rotary halves interleaved, which transformers undoes for llama), the hparams under
`llama.*`, and a GPT-2-style BPE tokenizer with its chat template in the metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from relax_gym.models import LoadedModel, build_tokenizer


def tiny_llama(seed: int = 0) -> LoadedModel:
    """A random tiny Llama over the project's test tokenizer, tied embeddings as SmolLM2 has; its weights are
    scaled up so greedy decoding has clear winners (fp32 round trips then decode the same tokens)."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(20)
    return LoadedModel(model, tokenizer, None, ("text",), "tiny-llama")


def _interleave_rotary_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order for q / k projections: per head, the two rotary halves interleaved."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [""] * len(tokenizer)
    types = [gguf.TokenType.NORMAL] * len(tokenizer)
    for text, index in state["model"]["vocab"].items():
        tokens[index] = text
    for added in state["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], gguf.TokenType.CONTROL
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def write_gguf(loaded: LoadedModel, path: Path, quantization: str = "F32", architecture: str = "llama") -> Path:
    """`loaded` (a Llama) as a GGUF file at `path`: matrices in `quantization` ("F32" or "Q8_0"), norms in F32.
    `architecture` is what the file claims to be (another name makes an unsupported file)."""
    model, config = loaded.model, loaded.model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    _tokenizer_metadata(writer, loaded.tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # llama.cpp writes a tied output matrix once, as token_embd
        tensor = tensor.detach().float()
        if name.endswith("self_attn.q_proj.weight"):
            tensor = _interleave_rotary_halves(tensor, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            tensor = _interleave_rotary_halves(tensor, config.num_key_value_heads)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, f"no GGUF name for {name}"
        array: np.ndarray = tensor.numpy()
        if quantization == "Q8_0" and array.ndim == 2:
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(target, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
