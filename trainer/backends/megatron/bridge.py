"""HF ↔ Megatron weights through mbridge, on megatron-core's local (no Transformer Engine) layer spec.

mbridge (0.15.1) already knows the Qwen2/Qwen3 layouts (fused QKV per query
group, fc1 = [gate; up], TP splits), so no converter is written by hand here.
Its stock bridges, however, assume Transformer Engine, CUDA and transformers 4;
the subclasses below carry the six fixes they need (each measured), each
marked `fix N` where it is made:

1. the layer spec: TE's spec is always requested → the local spec
   (`use_transformer_engine=False`, torch RMSNorm), which runs anywhere, with
   torch's SDPA as core attention (`SDPAttention`: no full score matrix);
2. `rope_theta` moved to `config.rope_parameters["rope_theta"]` in transformers 5;
3. names: the local spec has separate `input_layernorm` / `pre_mlp_layernorm`
   modules where TE fuses them into the linears → two extra name mappings;
4. sequence parallelism (switched on for TP > 1) needs apex's norm, which the
   local spec lacks → off; so are the kernel fusions that need TE/apex;
5. model construction calls `.cuda()` and builds the causal mask on CUDA → the
   caller runs bridge calls under `compat.cuda_on_cpu()` (the backend does);
6. upstream bug: a tied-embedding bridge rewrites the class-wide
   `_DIRECT_MAPPING`, so a later untied model in the same process would map
   `output_layer` to the embeddings → every instance gets its own copies.

Importing this module registers the subclasses under the HF model types
`qwen3`, `qwen3_moe` and `qwen2` in mbridge's registry, so `AutoBridge.from_config`
picks them (fixes 7 to 9, for mixture-of-experts layers, are `Qwen3MoeLocalBridge`'s).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from mbridge.core import AutoBridge, Bridge, register_model
from mbridge.core.safetensor_io import SafeTensorIO
from mbridge.models.qwen2 import Qwen2Bridge
from mbridge.models.qwen3 import Qwen3Bridge
from mbridge.models.qwen3moe import Qwen3MoEBridge
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.spec_utils import ModuleSpec
from transformers import PretrainedConfig

from relax_gym.trainer.backends.megatron import compat
from relax_gym.trainer.backends.megatron.sdpa_attention import SDPAttention

WeightSource = Path | Mapping[str, torch.Tensor]

#: fix 4: settings of the local spec, no sequence parallelism and none of the fusions that need
#: TE / apex kernels, on every device (`_build_base_config` adds CPU initialisation where there is no GPU)
_LOCAL_SPEC_CONFIG: dict[str, Any] = {
    "sequence_parallel": False,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
}


class _StateDictIO:
    """mbridge's weight reader (`SafeTensorIO`'s loading half) over an in-memory HF state dict."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = state_dict

    def load_some_hf_weight(self, hf_weight_names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {name: self.state_dict[name] for name in hf_weight_names}

    def load_one_hf_weight(self, hf_weight_name: str) -> torch.Tensor:
        return self.state_dict[hf_weight_name]


class _LocalSpecFixes(Bridge):
    """The fixes shared by the Qwen2 and Qwen3 bridges (mixed in before mbridge's class)."""

    # mbridge's tables (megatron name -> HF name, or -> HF names), copied per instance below
    _DIRECT_MAPPING: dict[str, str]
    _ATTENTION_MAPPING: dict[str, list[str]]
    _MLP_MAPPING: dict[str, list[str]]
    _OTHER_MAPPING: dict[str, list[str]]

    def __init__(self, hf_config: PretrainedConfig, dtype: torch.dtype = torch.float32, **kwargs: Any):
        # fix 6: per-instance mapping tables (mbridge's tied-embedding hook mutates them in place)
        self._DIRECT_MAPPING = dict(self._DIRECT_MAPPING)
        self._ATTENTION_MAPPING = dict(self._ATTENTION_MAPPING)
        # fix 3: the local spec's norms are modules of their own
        self._MLP_MAPPING = {
            **self._MLP_MAPPING,
            "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        }
        self._OTHER_MAPPING = {
            **self._OTHER_MAPPING,
            "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
        }
        super().__init__(hf_config, dtype=dtype, **kwargs)

    def _build_base_config(self, text_config_key: str | None = None, **kwargs: Any) -> Any:
        """fix 4 (and CPU initialisation): the local spec's settings, under the caller's overrides."""
        local = {**_LOCAL_SPEC_CONFIG, "use_cpu_initialization": compat.needed()}
        return super()._build_base_config(text_config_key, **{**local, **kwargs})

    def _get_transformer_layer_spec(self, vp_stage: int | None = None) -> ModuleSpec:
        """fix 1: megatron-core's own modules instead of Transformer Engine's, with SDPA as core attention (the
        local `DotProductAttention` builds the full score matrix)."""
        self.has_vp_stage = True  # read by mbridge's model provider; megatron-core ≥ 0.13 takes vp_stage
        block = get_gpt_decoder_block_spec(
            self.config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
        for layer in block.layer_specs:
            attention = layer.submodules.self_attention.submodules
            if attention.core_attention is DotProductAttention:
                attention.core_attention = SDPAttention
        return block

    def _get_gptmodel_args(self) -> dict[str, Any]:
        """fix 2: transformers 5 keeps the RoPE base in `rope_parameters`; only plain RoPE maps."""
        rope = getattr(self.hf_config, "rope_parameters", None) or {
            "rope_type": "default", "rope_theta": self.hf_config.rope_theta,
        }
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"RoPE scaling {rope['rope_type']!r} has no mapping to megatron-core here")
        return {
            "vocab_size": self.hf_config.vocab_size,
            "max_sequence_length": self.hf_config.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": rope["rope_theta"],
        }

    def _get_actual_hf_path(self, weight_path: str | Path) -> str:
        """A local folder as it is: nothing is resolved against a hub."""
        return str(weight_path)

    def _get_safetensor_io(self, weights: WeightSource) -> SafeTensorIO | _StateDictIO:
        """Weights from a checkpoint folder or, without a round trip through disk, an HF state dict."""
        if isinstance(weights, Mapping):
            return _StateDictIO(weights)
        return SafeTensorIO(str(weights))


@register_model("qwen3")
class Qwen3LocalBridge(_LocalSpecFixes, Qwen3Bridge):
    """Qwen3 (per-head q/k RMSNorm, no QKV bias) on the local spec."""

    def _build_config(self) -> Any:
        if getattr(self.hf_config, "attention_bias", False):
            raise NotImplementedError("Qwen3 with attention_bias=True (o_proj bias too) is not mapped")
        return super()._build_config()


@register_model("qwen2")
class Qwen2LocalBridge(_LocalSpecFixes, Qwen2Bridge):
    """Qwen2 / Qwen2.5 (QKV bias, no q/k norm) on the local spec."""


#: a SequentialMLP expert's parameter: decoder.layers.L.mlp.experts.local_experts.E.linear_fcN.weight
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
#: mbridge's (grouped) name of an expert's parameter: ...mlp.experts.linear_fcN.weightE
_GROUPED_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


# fix 9: megatron-core 0.16's router gating tests `te_general_gemm is not None`, a name it binds only when
# Transformer Engine imports: without TE every MoE forward raised NameError. None is what it means to test for.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


@register_model("qwen3_moe")
class Qwen3MoeLocalBridge(_LocalSpecFixes, Qwen3MoEBridge):
    """Qwen3-MoE on the local spec: experts as megatron-core's `SequentialMLP` (one linear pair per expert, no
    grouped-GEMM kernel: it runs on a CPU), under the HF layout of transformers 5 (each layer's experts fused
    into `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]).

    mbridge names experts as its grouped MLP does (`linear_fc1.weightE`) and gathers them over expert-parallel
    ranks under those names when exporting; the SequentialMLP's own names are mapped onto them here (fix 7),
    the fused HF tensors sliced per expert on load and stacked again on export (fix 8). Expert tensor
    parallelism is not mapped: MoE models train with tp = 1, expert parallelism taken from the data-parallel
    ranks (`expert_model_parallel_size`)."""

    def _build_config(self) -> Any:
        if getattr(self.hf_config, "mlp_only_layers", None) or getattr(self.hf_config, "decoder_sparse_step", 1) != 1:
            raise NotImplementedError("a Qwen3-MoE model with dense layers (mlp_only_layers, decoder_sparse_step) "
                                      "is not mapped: every layer must be sparse")
        if self.mpu.tp_size > 1:
            raise NotImplementedError("a mixture-of-experts model trains with tp = 1 here (expert tensor "
                                      "parallelism is not mapped); use ep (expert parallelism) or dp")
        return self._build_base_config(
            moe_ffn_hidden_size=self.hf_config.moe_intermediate_size,
            moe_router_topk=self.hf_config.num_experts_per_tok,
            num_moe_experts=self.hf_config.num_experts,
            moe_aux_loss_coeff=0.0,  # no load-balancing loss in RL (mbridge's default too)
            moe_router_load_balancing_type="none",
            moe_router_score_function="softmax",
            # transformers' router: softmax over all experts, top-k, renormalised when norm_topk_prob; megatron's
            # top-k of the logits then softmax over them is the renormalised form, pre-softmax the other
            moe_router_pre_softmax=not self.hf_config.norm_topk_prob,
            moe_grouped_gemm=False,  # SequentialMLP: no grouped-GEMM kernel
            moe_token_dispatcher_type="alltoall",  # its side CUDA stream is `compat`'s host stand-in on a CPU
            qk_layernorm=True,
        )

    def _weight_name_mapping_mcore_local_to_global(self, model: torch.nn.Module,
                                                    consider_ep: bool = True) -> dict[str, str]:
        """fix 7: each SequentialMLP expert under mbridge's grouped name, before mbridge offsets it by the
        expert-parallel rank."""
        names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        per_rank = self.config.num_moe_experts // self.mpu.ep_size
        offset = per_rank * self.mpu.ep_rank if consider_ep else 0
        return {local: _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.{m[2]}.weight{int(m[1]) + offset}", name)
                for local, name in names.items()}

    def _weight_name_mapping_mlp(self, name: str) -> list[str]:
        """fix 8: an expert's parameter comes from its layer's fused HF tensor."""
        if found := _GROUPED_EXPERT.match(name):
            fused = "gate_up_proj" if found[2] == "linear_fc1" else "down_proj"
            return [f"model.layers.{found[1]}.mlp.experts.{fused}"]
        return super()._weight_name_mapping_mlp(name)

    def _weight_to_mcore_format(self, mcore_weights_name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
        """fix 8: this expert's slice of the fused tensor ([2I, H] = [gate; up] for fc1, [H, I] for fc2, the
        layouts megatron's fc1 / fc2 have); `mcore_weights_name` is the local (this rank's) name."""
        if found := _LOCAL_EXPERT.search(mcore_weights_name):
            expert = int(found[1]) + self.config.num_moe_experts // self.mpu.ep_size * self.mpu.ep_rank
            return hf_weights[0][expert].to(self.dtype)
        return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)

    def _weight_to_hf_format(self, mcore_weights_name: str,
                             mcore_weights: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
        """fix 8: one expert's slice, named `<fused name>#<expert>` for `export_weights` to stack."""
        if found := _GROUPED_EXPERT.match(mcore_weights_name):
            fused = self._weight_name_mapping_mlp(mcore_weights_name)[0]
            return [f"{fused}#{found[3]}"], [mcore_weights]
        return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)

    def export_weights(self, models: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        """mbridge's export, each layer's expert slices stacked into its fused tensor once all have come."""
        slices: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in super().export_weights(models):
            fused, _, expert = name.partition("#")
            if not expert:
                yield name, tensor
                continue
            got = slices.setdefault(fused, {})
            got[int(expert)] = tensor
            if len(got) == self.config.num_moe_experts:
                yield fused, torch.stack([got[e] for e in range(len(got))])
                del slices[fused]


def make_bridge(hf_config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> Bridge:
    """The registered bridge for this HF config; the parallel layout is read from megatron's state."""
    if hf_config.model_type not in ("qwen3", "qwen2", "qwen3_moe"):
        raise NotImplementedError(
            f"model type {hf_config.model_type!r}: the Megatron backend maps qwen3, qwen3_moe and qwen2 text models"
        )
    return AutoBridge.from_config(hf_config, dtype=dtype)


def export_hf(bridge: Bridge, models: list[torch.nn.Module], keep: bool = True) -> dict[str, torch.Tensor]:
    """Full (TP-gathered, PP-broadcast) CPU copies under HF names; collective over all ranks.

    Every rank must take part in the gather, but only one needs the copies: a rank with `keep` false lets
    each gathered tensor go at once and returns {}, so a job of N ranks holds one CPU copy of the model, not N.
    A tied model also gets `lm_head.weight` (the embedding tensor), as HF's own
    `state_dict()` has it, so `load_state_dict(strict=True)` accepts the result.
    """
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # mbridge broadcasts the parameters themselves in place; keep that out of autograd
        for name, tensor in bridge.export_weights(models):
            if keep:
                state[name] = tensor.detach().to("cpu", copy=True)
    if keep and getattr(bridge.hf_config, "tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
