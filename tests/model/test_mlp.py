"""GatedMLP: the dense MLP / shared experts formula, names, and bad input."""

import pytest
import torch

from k3.config import get_preset
from k3.model.mlp import GatedMLP


def test_silu_mlp_equals_swiglu_formula():
    cfg = get_preset("nano", hidden_act="silu", activation_situ_linear_beta=None)
    m = GatedMLP(16, 40, cfg)
    x = torch.randn(2, 3, 16)
    g, u = x @ m.gate_proj.weight.T, x @ m.up_proj.weight.T
    torch.testing.assert_close(m(x), (g * torch.sigmoid(g) * u) @ m.down_proj.weight.T)


def test_situ_mlp_equals_situ_formula_and_has_gradients():
    cfg = get_preset("nano")
    m = GatedMLP(16, 24, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(5, 16, requires_grad=True)
    g, u = x @ m.gate_proj.weight.T, x @ m.up_proj.weight.T
    ref = (4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)) @ m.down_proj.weight.T
    y = m(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn_like(y)
    params = [x, *m.parameters()]
    for a, b in zip(torch.autograd.grad(y, params, gy), torch.autograd.grad(ref, params, gy)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_names_shapes_no_bias_and_init():
    cfg = get_preset("nano", initializer_range=0.05)
    m = GatedMLP(64, 512, cfg)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == {
        "gate_proj.weight": (512, 64), "up_proj.weight": (512, 64), "down_proj.weight": (64, 512)}
    assert m.gate_proj.weight.std().item() == pytest.approx(0.05, rel=0.1)


def test_wrong_hidden_size_raises_value_error_naming_it():
    m = GatedMLP(16, 24, get_preset("nano"))
    with pytest.raises(ValueError, match="hidden size 16"):
        m(torch.randn(3, 15))
    with pytest.raises(ValueError, match="intermediate_size"):
        GatedMLP(16, 0, get_preset("nano"))
