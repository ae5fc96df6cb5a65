"""Pieces of distributed training: all-to-all expert dispatch, pooled QB, layout errors, DCP resume
in one process, ``k3 convert`` of a DCP checkpoint (SPEC §5)."""

import json
import math
import socket

import pytest
import torch

from dist_worker import BINS, N_TOKENS, _moe_and_tokens, qb_moe_and_tokens
from test_distributed import _ok, torchrun
from k3.errors import ConfigError
from k3.train.distributed import resolve_layout


def _outputs(tmp_path, nproc):
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


# ---------------------------------------------------------------------------- dispatch
@pytest.mark.slow
def test_all_to_all_dispatch_equals_the_single_process_moe(tmp_path):
    """No capacity limit (C = N): outputs, input grads and expert grads equal the dropless MoE on
    the whole batch; nothing dropped; bytes sent = 4 exchanges x E·C·ℓ·4 B x (P−1)/P."""
    P = 2
    _ok(torchrun(P, "dispatch", str(tmp_path), "none", timeout=120))
    moe, x = _moe_and_tokens()
    x = x.clone().requires_grad_(True)
    y = moe(x)
    torch.manual_seed(1)
    (y * torch.randn(N_TOKENS, y.shape[-1])).sum().backward()
    el, n = moe.num_experts // P, N_TOKENS // P
    for r, got in enumerate(_outputs(tmp_path, P)):
        rows = slice(r * n, (r + 1) * n)
        torch.testing.assert_close(got["y"], y[rows].detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got["x_grad"], x.grad[rows], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got["w1_grad"], moe.experts.w1.grad[r * el:(r + 1) * el],
                                   atol=1e-6, rtol=1e-5)
        assert got["dropped"] == 0
        assert got["calls"] == 4
        assert got["bytes"] == 4 * moe.num_experts * n * moe.expert_dim * 4 * (P - 1) // P


@pytest.mark.slow
def test_all_to_all_dispatch_counts_overflow(tmp_path):
    """capacity_factor 0.5: C = ceil(0.5·32·2/8) = 4 slots per (rank, expert); the dropped count is
    Σ_e max(0, count_e − C) of each rank's own routing, and the output equals the one-process
    capacity path on that rank's tokens (same drop rule: lower token index wins)."""
    P, cf = 2, 0.5
    _ok(torchrun(P, "dispatch", str(tmp_path), str(cf), timeout=120))
    moe, x = _moe_and_tokens()
    n = N_TOKENS // P
    cap = math.ceil(cf * n * moe.top_k / moe.num_experts)
    total = 0
    for r, got in enumerate(_outputs(tmp_path, P)):
        xs = x[r * n:(r + 1) * n]
        with torch.no_grad():
            _, idx, _ = moe.gate(xs)
        counts = torch.bincount(idx.reshape(-1), minlength=moe.num_experts)
        want = int((counts - cap).clamp_min(0).sum())
        assert got["dropped"] == want
        total += want
        moe.capacity_factor = cf
        with torch.no_grad():
            torch.testing.assert_close(got["y"], moe(xs), atol=1e-6, rtol=1e-5)
        moe.capacity_factor = None
    assert total > 0  # the limit did bite: the counts above are not trivially zero


# ---------------------------------------------------------------------------------- QB
@pytest.mark.slow
def test_pooled_histogram_bias_equals_single_process_bias(tmp_path):
    """4 ranks, 16 tokens each, one all-reduce: every rank installs the same bias, which equals
    the exact QB bias of the concatenated 64 tokens within the histogram's bin error. Bin error:
    the interpolated cut lies within one bin width w = (hi − lo)/bins of the exact (q+1)-th margin;
    centring b̂ − mean(b̂) at most doubles it: |b_dist − b_exact| ≤ 2w."""
    from k3.ops.routing import quantile_balance_update
    from k3.train.balance import qb_grid
    P = 4
    _ok(torchrun(P, "qb", str(tmp_path), timeout=120))
    moe, x = qb_moe_and_tokens()
    bias = moe.gate.e_score_correction_bias.clone()
    with torch.no_grad():
        _, _, scores = moe.gate(x)
    exact = quantile_balance_update(scores, bias, moe.top_k)
    lo, hi = qb_grid(bias)
    w = (hi - lo) / BINS
    got = [o["bias"] for o in _outputs(tmp_path, P)]
    for b in got[1:]:
        assert torch.equal(b, got[0])
    err = (got[0] - exact).abs().max().item()
    print(f"pooled QB bias vs exact: max |diff| {err:.2e}, bin width {w:.2e}")
    assert err <= 2 * w, (err, w)
    assert exact.abs().max() > 4 * w  # the bias moved: the comparison is not between zeros


# -------------------------------------------------------------------------------- Muon
@pytest.mark.slow
def test_sharded_muon_equals_the_single_process_update(tmp_path):
    """4 ranks, 3 steps: gathered full matrix, in-place per-head shards, gathered split heads and
    AdamW all land within 1e-6 of Muon on the full tensors; 2 matrices gathered per step."""
    P = 4
    _ok(torchrun(P, "muon", str(tmp_path), timeout=120))
    for got in _outputs(tmp_path, P):
        assert got["moved"] > 1e-3  # every tensor was updated
        assert got["dev"] < 1e-6, got
        assert got["gathers"] == 2 * 3  # a and k, not the whole-head shards of q


# ------------------------------------------------------------------------------ layout
def test_layout_errors_and_valid_layouts():
    assert resolve_layout(4, 2, 2, 8, 4) == (2, 2)
    assert resolve_layout(4, None, 4, 8, 8) == (1, 4)
    assert resolve_layout(2, None, 1, 8, 4) == (2, 1)
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by ep=2"):
        resolve_layout(3, None, 2, 8, 4)
    with pytest.raises(ConfigError, match=r"world size 4 does not match dp × ep = 3 × 1"):
        resolve_layout(4, 3, 1, 8, 4)
    with pytest.raises(ConfigError, match=r"num_experts=8 is not divisible by ep=3"):
        resolve_layout(3, None, 3, 8, 3)
    with pytest.raises(ConfigError, match=r"batch_size=3 .* not divisible by the world size 2"):
        resolve_layout(2, None, 1, 8, 3)


@pytest.mark.slow
def test_torchrun_with_a_bad_layout_fails_before_the_first_step(env, tmp_path):
    """2 processes with ep=3: each rank prints the ConfigError and exits 2; no step was logged."""
    from test_distributed import _argv
    base, data = env
    out = tmp_path / "bad"
    r = torchrun(2, "train", str(out), *_argv(data, out, ep=3), timeout=120)
    assert r.returncode != 0
    assert "world size 2 is not divisible by ep=3" in r.stdout
    assert not (out / "metrics.jsonl").exists()


def test_dp_ep_without_torchrun_is_refused(env, tmp_path, capsys):
    from k3.cli.train import train_main
    from test_distributed import _argv
    base, data = env
    assert train_main(_argv(data, tmp_path / "r", ep=2, steps=1)) == 2
    assert "launch with k3 train --nproc 2" in capsys.readouterr().err
    assert train_main(_argv(data, tmp_path / "r1", ep=1, steps=1)) == 0  # positive control


# ------------------------------------------------------------ DCP in one process + convert
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dcp_run(env, tmp_path, monkeypatch):
    """A 3-step run of the distributed Trainer as a 1-rank torchrun job (env://, free port) -> its run dir."""
    from k3.cli.train import train_main
    from test_distributed import _argv
    base, data = env
    out = tmp_path / "dcp1"
    with monkeypatch.context() as mp:
        for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(_free_port())}.items():
            mp.setenv(k, v)
        assert train_main(_argv(data, out, steps=3, ckpt_interval=0)) == 0
    assert torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)["format"] == "dcp"
    return data, out


def test_dcp_checkpoint_of_another_model_config_is_refused(dcp_run, capsys):
    """Resuming with --preset tiny fails before any step, naming the differing fields; the same
    resume with the run's own config (positive control) continues in one process from step 3."""
    from k3.cli.train import train_main
    from test_distributed import losses
    data, out = dcp_run
    assert train_main(["--resume", str(out), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "different model config" in err and "hidden_size" in err
    assert len(losses(out)) == 3
    assert train_main(["--resume", str(out), "--steps", "4"]) == 0
    assert len(losses(out)) == 4


def test_convert_dcp_to_hf_and_back(dcp_run, tmp_path):
    from k3.checkpoint import from_pretrained
    from k3.cli.checkpoint import convert_main
    from k3.checkpoint.dcp import read_dcp
    data, out = dcp_run
    want = read_dcp(out)["model"]
    assert convert_main([str(out / "checkpoint"), str(tmp_path / "hf")]) == 0
    model = from_pretrained(tmp_path / "hf")
    got = model.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k].float(), want[k].float()), k
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "back"), "--to-dcp"]) == 0
    back = read_dcp(tmp_path / "back")["model"]
    assert all(torch.equal(back[k], want[k]) for k in want)


def test_capacity_overflow_is_logged_per_step(env, tmp_path):
    """--capacity-factor 0.25 on nano (C = ceil(0.25·N·2/8)): every step logs dropped_slots > 0,
    at most the slots routed beyond C; dropless runs (positive control) log no such field."""
    from k3.cli.train import train_main
    from test_distributed import _argv, losses
    base, data = env
    assert train_main(_argv(data, tmp_path / "cap", steps=2, capacity_factor=0.25)) == 0
    recs = [json.loads(x) for x in (tmp_path / "cap" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    n_slots = 4 * 32 * 2 * 3  # B·T tokens x k x 3 MoE layers
    assert len(train) == 2 and all(0 < r["dropped_slots"] < n_slots for r in train)
    assert train_main(_argv(data, tmp_path / "free", steps=2)) == 0
    assert len(losses(tmp_path / "free")) == 2
    recs = [json.loads(x) for x in (tmp_path / "free" / "metrics.jsonl").read_text().splitlines()]
    assert all("dropped_slots" not in r for r in recs)


def test_distributed_config_fields_are_validated():
    from k3.train.config import TrainConfig
    ok = TrainConfig.build(overrides=dict(preset="nano", dp=2, ep=2, capacity_factor=1.25, qb_bins=512))
    assert (ok.dp, ok.ep, ok.capacity_factor, ok.qb_bins) == (2, 2, 1.25, 512)
    for bad, msg in [(dict(ep=0), "ep must be > 0"), (dict(dp=0), "dp must be > 0"),
                     (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
                     (dict(capacity_factor=float("inf")), "capacity_factor must be finite"),
                     (dict(qb_bins=1), "qb_bins must be >= 2"), (dict(ep=True), "ep must be an int"),
                     (dict(qb_bins=64, balance="sign"), "qb_bins applies to balance='quantile'")]:
        with pytest.raises(ConfigError, match=msg):
            TrainConfig.build(overrides=dict(preset="nano", **bad))
