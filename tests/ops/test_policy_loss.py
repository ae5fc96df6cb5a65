"""k3.ops.policy_loss: the clipped token-level surrogate and group advantages against hand-computed
numbers, and a toy policy whose right behaviour is one token: the loss teaches it, the same loop
with the rewards shuffled does not."""

import math

import pytest
import torch

from k3.ops.policy_loss import clipped_policy_loss, group_advantages


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, degenerate = group_advantages(r, g)
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25, 0.0, 0.0] and degenerate == 1
    std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 4)  # population std of group 0 = 0.4330
    scaled, _ = group_advantages(r, g, scale_std=True)
    assert scaled[:4].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert scaled[4:].tolist() == [0.0, 0.0]  # an all-equal group is zero, never 0/0
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


def test_clipped_loss_two_groups_by_hand():
    # rollout a (group 0, A = +0.5): tokens with ratio 1.5 (clipped to 1.2) and 0.9
    # rollout b (group 0, A = -0.5): tokens with ratio 0.5 (clipped to 0.8) and 1.1; a masked token
    # rollout c (group 1, all equal, A = 0): one token
    old = torch.log(torch.tensor([0.2, 0.5, 0.4, 0.3, 0.6, 0.1]))
    new = torch.log(torch.tensor([0.3, 0.45, 0.2, 0.33, 0.9, 0.25]))
    adv = torch.tensor([0.5, 0.5, -0.5, -0.5, -0.5, 0.0])
    mask = torch.tensor([1, 1, 1, 1, 0, 1])
    logp = new.clone().requires_grad_(True)
    loss, st = clipped_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # s = min(r·A, clip(r)·A): a: min(0.75, 0.6) = 0.6, min(0.45, 0.45) = 0.45;
    # b: min(-0.25, -0.4) = -0.4, min(-0.55, -0.55) = -0.55; c: 0. loss = -(0.6+0.45-0.4-0.55+0)/5
    assert loss.item() == pytest.approx(-(0.6 + 0.45 - 0.4 - 0.55) / 5, rel=1e-5)
    assert st["clip_fraction"] == pytest.approx(2 / 5) and st["tokens"] == 5
    loss.backward()
    # the clipped branches carry no gradient; an unclipped token's d(-r·A/5)/dlogp = -r·A/5
    want = torch.tensor([0.0, -0.9 * 0.5 / 5, 0.0, 1.1 * 0.5 / 5, 0.0, 0.0])
    assert torch.allclose(logp.grad, want, atol=1e-6)


def test_k3_kl_by_hand_and_bad_shapes():
    lp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.2]))
    d = math.log(0.25 / 0.5)
    loss, st = clipped_policy_loss(lp, lp, torch.zeros(2), torch.ones(2), beta=0.1, ref_logp=ref)
    assert st["kl"] == pytest.approx((math.exp(d) - d - 1) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * (math.exp(d) - d - 1) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        clipped_policy_loss(lp, lp, torch.zeros(2), torch.ones(2), beta=0.1)
    with pytest.raises(ValueError, match="mask shape"):
        clipped_policy_loss(lp, lp, torch.zeros(2), torch.ones(3))


def _toy_run(shuffle: bool, steps: int = 60, G: int = 16, V: int = 16, target: int = 3, seed: int = 0):
    """A softmax policy over V tokens (logits = a parameter); reward 1 for ``target``. Each step:
    sample G tokens, advantages per group, one clipped update (old = the sampling logprobs)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.zeros(V, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.1)
    rewards = []
    for _ in range(steps):
        with torch.no_grad():
            probs = theta.softmax(-1)
            acts = torch.multinomial(probs, G, replacement=True, generator=g)
            old = probs.log()[acts]
        r = (acts == target).float()
        rewards.append(r.mean().item())
        if shuffle:
            r = r[torch.randperm(G, generator=g)]
        adv, _ = group_advantages(r, torch.zeros(G, dtype=torch.long))
        for _ in range(2):  # two updates on the same samples: the ratio moves off 1
            loss, _ = clipped_policy_loss(theta.log_softmax(-1)[acts], old, adv, torch.ones(G))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return rewards, theta.softmax(-1)[target].item()


def test_toy_policy_learns_the_one_right_token_and_shuffled_rewards_do_not():
    rewards, p = _toy_run(shuffle=False)
    assert sum(rewards[-10:]) / 10 >= 0.9 and p >= 0.9
    shuffled, p_shuffled = _toy_run(shuffle=True)
    assert sum(shuffled[-10:]) / 10 < 0.5 and p_shuffled < 0.5
