"""Linear layers through oneDNN on x86 CPUs, where torch's float32 matmul (MKL) runs at half the cores' rate.

Measured on this project's 2-core AMD EPYC (AVX-512, 2 threads; `benchmarks/onednn_linear.py`): torch's float32
`F.linear` and `mm` go to MKL's sgemm, which reaches 215 GFLOP/s on every shape tried, the rate of 256-bit FMAs
here, while oneDNN's matmul on the same tensors (`torch.ops.mkldnn._linear_pointwise`, the kernel behind
inductor's CPU linear) reaches 410-520, in float32, with float32 accumulation. torch sends float32 products to
oneDNN only when their precision may be lowered (`torch.backends.mkldnn.matmul.fp32_precision`), which no one
asked for, so this module routes `nn.Linear` itself: `use_onednn_linears` turns a model's `nn.Linear` layers into
`OneDNNLinear` (a subclass: checkpoints, `deepcopy`, pickling and peft's `isinstance` checks see a Linear), whose
forward and both backward products run through oneDNN. Nothing else in torch changes.

It applies to float32 on a CPU, outside autocast, for products of at least `MIN_MULTIPLY_ADDS`: a oneDNN call
costs about 10 us more than MKL's, which a tiny model's 64-wide layers never earn back. Anything else, or a
torch without oneDNN, or a CPU that is not x86, keeps `F.linear`; `RELAX_GYM_ONEDNN=0` turns it off.

The cost is memory: SmolLM2's arithmetic run peaks 0.35 GB higher with it (benchmarks/RESULTS.md, the memory
section, which says what was ruled out).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "MAX_GRADIENT_COPY_BYTES", "MIN_MULTIPLY_ADDS", "OneDNNLinear", "onednn_available", "onednn_product",
    "use_onednn_linears",
]

#: products smaller than this (rows x in x out) stay on `F.linear`: oneDNN's extra call cost outweighs its rate
MIN_MULTIPLY_ADDS = 1 << 21
#: a weight gradient whose output gradient is larger than this goes to torch's mm (see `_Linear.backward`)
MAX_GRADIENT_COPY_BYTES = 16 << 20


def onednn_available() -> bool:
    """Whether this process routes linears through oneDNN: an x86 CPU, a torch built with it, and not turned off."""
    return (os.environ.get("RELAX_GYM_ONEDNN", "1") != "0"
            and platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias by oneDNN; `weight` may be a strided view (the backward passes transposes)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """`F.linear` with its forward and its two backward products on oneDNN (bias gradient: a sum; a large weight
    gradient's product on torch's mm)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_product(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_product(rows, weight.t(), None).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            inputs = x.reshape(-1, x.shape[-1])
            # oneDNN copies a transposed left operand: for a vocabulary head that copy of the output gradient is
            # rows x 49k floats (100 MB at 512 rows, raising the step's peak), where torch's mm reads it in place
            small = rows.numel() * rows.element_size() <= MAX_GRADIENT_COPY_BYTES
            grad_weight = onednn_product(rows.t(), inputs.t(), None) if small else rows.t().mm(inputs)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose large float32 CPU products run on oneDNN (module docstring); the same parameters."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if (input.device.type != "cpu" or input.dtype != torch.float32 or weight.dtype != torch.float32
                or input.numel() * self.out_features < MIN_MULTIPLY_ADDS or torch.is_autocast_enabled("cpu")):
            return F.linear(input, weight, bias)
        if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _Linear.apply(input, weight, bias)
        return onednn_product(input, weight, bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Turns each plain `nn.Linear` of `model` into a `OneDNNLinear` in place, where `onednn_available()`; returns
    how many it turned (0 where it is not available). Subclasses of `nn.Linear` (quantized or adapter layers)
    keep their own forward."""
    if not onednn_available():
        return 0
    turned = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            turned += 1
    return turned
