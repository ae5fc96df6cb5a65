"""The independent reference of the engine tests (a uniquely named module, not ``conftest``)."""

import torch


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The whole sequence through the model without a cache, argmax, every step."""
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out
