"""Router balancing: one-step-delayed Quantile Balancing in the loop, sign/off modes, accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.stats import ForwardStats
from k3.ops.routing import quantile_balance_update, sign_update
from k3.train.balance import RouterBalancer
from k3.train.config import TrainConfig
from k3.train.loop import Trainer


def _trace_trainer(base, data, name, balance):
    """A nano Trainer whose router forwards are traced: bias used and scores seen, per step."""
    tc = TrainConfig.build(overrides=dict(
        preset="nano", data=str(data), out=str(base / name), steps=5, batch_size=2, grad_accum=2,
        curriculum=[[0, 32]], threads=1, eval_interval=0, final_eval_batches=1, plot=False,
        balance=balance, lr=0.01))
    t = Trainer(tc)
    moe = t.model.moe_layers()
    used = [[] for _ in moe]     # per layer, per forward: (step, bias the forward routed with)
    scores = [[] for _ in moe]   # per layer, per forward: (step, scores [N, E])
    counts = [[] for _ in moe]
    after = []                   # per step: biases after the step's update
    for i, layer in enumerate(moe):
        layer.register_forward_pre_hook(
            lambda m, a, i=i: used[i].append((t.step, m.gate.e_score_correction_bias.clone())))
        def record(m, args, kwargs, out, i=i):   # what the training forward returned to the trainer
            st = kwargs.get("stats")
            scores[i].append((t.step, None if st is None else st.router[m].scores))
            counts[i].append((t.step, None if st is None else st.router[m].counts))
        layer.register_forward_hook(record, with_kwargs=True)
    t.on_step_end.append(lambda tr, rec: after.append(
        [m.gate.e_score_correction_bias.clone() for m in moe]))
    return t, moe, used, scores, counts, after


def test_quantile_balancing_routes_step_t_with_the_bias_from_step_t_minus_1(env):
    base, data = env
    t, moe, used, scores, _, after = _trace_trainer(base, data, "qb", "quantile")
    t.train()
    steps = t.tc.steps
    assert len(after) == steps
    for i, layer in enumerate(moe):
        train_fwd = [(s, b) for s, b in used[i][:2 * steps]]  # 2 micro-batches per step; then eval
        for s in range(steps):
            prev = torch.zeros(layer.num_experts) if s == 0 else after[s - 1][i]
            for step_of, bias in train_fwd[2 * s:2 * s + 2]:
                assert step_of == s
                assert torch.equal(bias, prev)            # never the bias computed from step s
            # the bias installed after step s is QB of step s's scores (both micro-batches)
            sc = torch.cat([x for st, x in scores[i][2 * s:2 * s + 2]])
            assert torch.equal(after[s][i], quantile_balance_update(sc, prev, layer.top_k))
        assert not torch.equal(after[0][i], after[1][i])  # the bias does move step to step


def test_sign_mode_uses_the_summed_counts_and_off_keeps_the_bias(env):
    base, data = env
    t, moe, used, _, counts, after = _trace_trainer(base, data, "sign", "sign")
    t.train()
    for i in range(len(moe)):
        prev = torch.zeros(moe[i].num_experts)
        for s in range(t.tc.steps):
            c = counts[i][2 * s][1] + counts[i][2 * s + 1][1]
            prev = sign_update(c, prev, t.tc.balance_rate)
            assert torch.equal(after[s][i], prev)
    t, moe, _, _, counts, after = _trace_trainer(base, data, "off", "off")
    t.train()
    assert all(torch.equal(b, torch.zeros_like(b)) for step in after for b in step)
    recs = [r for r in t.metrics.records if r["kind"] == "train"]
    assert all(len(r["load_cv_layers"]) == len(moe) and r["load_cv"] > 0 for r in recs)
    # the logged CV is population std / mean of the step's per-expert slot counts (2 micro-batches)
    for s, r in enumerate(recs):
        for i in range(len(moe)):
            c = [int(a) + int(b) for a, b in zip(counts[i][2 * s][1], counts[i][2 * s + 1][1])]
            mean = sum(c) / len(c)
            cv = math.sqrt(sum((x - mean) ** 2 for x in c) / len(c)) / mean
            assert r["load_cv_layers"][i] == pytest.approx(cv, rel=1e-6)


def _load_cv_trajectory(mode: str, updates: int) -> list[list[float]]:
    """Load CV per MoE layer over repeated forwards of one batch, updating the bias in between."""
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("nano"))
    with torch.no_grad():  # a skewed selection bias, so the load starts far from even
        for m in model.moe_layers():
            m.gate.e_score_correction_bias.copy_(torch.linspace(0.2, -0.2, m.num_experts))
    bal = RouterBalancer(model, mode)
    x = torch.randint(0, model.config.vocab_size, (4, 64))
    cvs = []
    for _ in range(updates + 1):
        with torch.no_grad():
            out = model(x, stats=ForwardStats())
        bal.collect(out.stats)
        cvs.append(bal.update()["load_cv"])
    return cvs


def test_quantile_balancing_evens_the_load_of_a_repeated_batch():
    qb = _load_cv_trajectory("quantile", 4)
    assert all(c > 1.0 for c in qb[0])                       # the skewed start
    assert all(c < 0.1 * c0 for c, c0 in zip(qb[-1], qb[0]))  # QB: near-even within a few steps
    sign = _load_cv_trajectory("sign", 4)                    # the sign update moves by rate per step
    assert all(1.0 < c < c0 for c, c0 in zip(sign[-1], sign[0]))
    off = _load_cv_trajectory("off", 2)
    assert off[0] == off[-1]


def test_balancer_rejects_unknown_mode_and_missing_stats():
    model = K3ForCausalLM(get_preset("nano"))
    with pytest.raises(ValueError, match="balance mode"):
        RouterBalancer(model, "median")
    bal = RouterBalancer(model, "quantile")
    with pytest.raises(RuntimeError, match="router stats missing"):
        bal.collect(ForwardStats())               # no forward filled it
    with pytest.raises(TypeError, match="ForwardStats"):
        bal.collect(None)
