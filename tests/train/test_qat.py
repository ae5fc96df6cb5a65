"""QAT end to end: a nano model with MXFP4 weights / MXFP8 activations in its routed experts learns
real text, and its master weights receive straight-through gradients."""

import sysconfig
from pathlib import Path

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.train.qat import FakeQuantMXExperts, enable_qat


@pytest.mark.slow
def test_qat_training_reduces_loss_on_real_text():
    root = Path(sysconfig.get_paths()["stdlib"])
    data = torch.tensor(list((root / "textwrap.py").read_bytes() + (root / "fnmatch.py").read_bytes()))
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("nano")).train()
    assert enable_qat(model)
    assert all(isinstance(m.experts, FakeQuantMXExperts) for m in model.moe_layers())
    expert_w = model.moe_layers()[0].experts.w1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        starts = torch.randint(0, len(data) - 129, (8,), generator=g)
        batch = torch.stack([data[s:s + 128] for s in starts])
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        assert expert_w.grad is not None and expert_w.grad.abs().sum() > 0  # STE reaches the masters
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 2.0, losses
