"""`OneDNNLinear`: the same products and gradients as `F.linear`, and `F.linear` itself where oneDNN does not pay."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from relax_gym.cpu import onednn_linear
from relax_gym.cpu.onednn_linear import OneDNNLinear, onednn_available, use_onednn_linears
from relax_gym.models.tiny import build_tiny_text

pytestmark = pytest.mark.skipif(not onednn_available(), reason="oneDNN linears apply to x86 CPUs with oneDNN")


def _pair(in_features: int, out_features: int, bias: bool) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=bias)
    routed = copy.deepcopy(plain)
    assert use_onednn_linears(routed) == 1
    return plain, routed


@pytest.mark.parametrize("shape", [(64, 576), (4, 16, 576)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("weight_grad_on", ["onednn", "torch mm"])
def test_products_and_gradients_match_f_linear(shape: tuple[int, ...], bias: bool, weight_grad_on: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if weight_grad_on == "torch mm":  # as for a vocabulary head, whose output gradient is too large to copy
        monkeypatch.setattr(onednn_linear, "MAX_GRADIENT_COPY_BYTES", 0)
    plain, routed = _pair(576, 192, bias)
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    grad = torch.randn(*shape[:-1], 192)
    expected, got = plain(x), routed(x2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(routed.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(routed.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-5)


def test_a_strided_input_and_a_frozen_weight() -> None:
    plain, routed = _pair(576, 576, True)
    routed.weight.requires_grad_(False)
    x = torch.randn(576, 64).t().requires_grad_(True)  # a transposed view, as attention outputs can be
    x2 = x.detach().clone().t().contiguous().t().requires_grad_(True)
    plain(x).sum().backward()
    routed(x2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    assert routed.weight.grad is None
    with torch.no_grad():
        torch.testing.assert_close(routed(x2), plain(x), rtol=1e-5, atol=1e-5)


def test_small_products_bfloat16_and_autocast_keep_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> torch.Tensor:
        raise AssertionError("oneDNN was called")

    monkeypatch.setattr(onednn_linear, "onednn_product", refuse)
    _, routed = _pair(64, 64, True)
    x = torch.randn(8, 64)
    assert torch.equal(routed(x), F.linear(x, routed.weight, routed.bias))  # 32K multiply-adds
    _, big = _pair(576, 576, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert big(torch.randn(64, 576)).dtype == torch.bfloat16
    big.to(torch.bfloat16)
    assert big(torch.randn(64, 576, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_a_model_turned_keeps_its_state_copies_and_pickles() -> None:
    model, _ = build_tiny_text()
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert use_onednn_linears(model) == linears > 0
    assert list(model.state_dict()) == keys
    assert all(isinstance(m, nn.Linear) for m in model.modules() if isinstance(m, OneDNNLinear))
    assert type(copy.deepcopy(model).lm_head) is OneDNNLinear
    assert type(pickle.loads(pickle.dumps(model)).lm_head) is OneDNNLinear


def test_a_tiny_model_forward_and_backward_match_the_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's layers are below the size threshold, so it is lowered to route every linear."""
    monkeypatch.setattr(onednn_linear, "MIN_MULTIPLY_ADDS", 0)
    plain, _ = build_tiny_text()
    routed = copy.deepcopy(plain)
    use_onednn_linears(routed)
    ids = torch.randint(0, plain.config.vocab_size, (3, 12))
    expected, got = plain(ids).logits, routed(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    expected.logsumexp(-1).sum().backward()
    got.logsumexp(-1).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), routed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAX_GYM_ONEDNN", "0")
    model, _ = build_tiny_text()
    assert use_onednn_linears(model) == 0
    assert not any(isinstance(m, OneDNNLinear) for m in model.modules())
