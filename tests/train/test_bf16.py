"""bf16 autocast training (`--dtype bf16`): fp32 master weights, fp32 islands, loss tracks fp32."""

from __future__ import annotations

import time

import pytest
import torch

from k3.train.config import TrainConfig
from k3.train.loop import Trainer


def _trainer(base, data, name, dtype, steps, print_fn=lambda *a: None, **kw):
    opts = dict(preset="nano", data=str(data), out=str(base / name), steps=steps, batch_size=2,
                curriculum=[[0, 32]], threads=1, eval_interval=0, final_eval_batches=1,
                ckpt_interval=0, log_interval=1000, plot=False, dtype=dtype, seed=0)
    opts.update(kw)
    return Trainer(TrainConfig.build(overrides=opts), print_fn=print_fn, tty=False)


def test_bf16_runs_matmuls_in_bf16_and_keeps_fp32_master_weights(env):
    base, data = env
    t = _trainer(base, data, "dtypes", "bf16", 2)
    seen = {}

    def note(key):
        def hook(module, args, out):
            seen.setdefault(key, out.dtype)      # returns None: the output is left as it is
        return hook
    t.model.model.layers[0].self_attn.o_proj.register_forward_hook(note("o_proj"))
    t.model.lm_head.register_forward_hook(note("lm_head"))
    t.train()
    assert seen == {"o_proj": torch.bfloat16, "lm_head": torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert all(v.dtype == torch.float32 for st in t.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.is_floating_point())
    # control: the fp32 run has fp32 activations
    t32 = _trainer(base, data, "dtypes32", "fp32", 1)
    t32.model.lm_head.register_forward_hook(note("fp32"))
    t32.train()
    assert seen["fp32"] == torch.float32


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_bf16_kernels_says_so(env, monkeypatch, native):
    from k3.train import loop

    base, data = env
    monkeypatch.setattr(loop, "cpu_bf16_matmul_is_native", lambda: native)
    said = []
    _trainer(base, data, f"warn{native}", "bf16", 1, print_fn=said.append)
    warned = [s for s in said if s.startswith("dtype=bf16: this CPU has no oneDNN bf16 matmul kernels")]
    assert len(warned) == (0 if native else 1), said
    said.clear()   # control: fp32 never says it
    _trainer(base, data, f"warn32{native}", "fp32", 1, print_fn=said.append)
    assert not any(s.startswith("dtype=bf16") for s in said)


def test_dtype_flag_and_validation():
    from k3.cli.train import build_train_parser, train_config_from_args

    args = build_train_parser().parse_args(["--preset", "nano", "--dtype", "bf16", "--qk-clip", "30"])
    tc = train_config_from_args(args)
    assert (tc.dtype, tc.qk_clip) == ("bf16", 30.0)
    assert TrainConfig.build(overrides=dict(preset="nano")).dtype == "fp32"
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig.build(overrides=dict(preset="nano", dtype="fp16"))


@pytest.mark.slow
def test_bf16_loss_tracks_fp32_over_200_steps(env):
    """20-step mean losses of bf16 autocast against fp32 on the same data: within 1 % over the first
    100 steps, within 6 % over all 200.

    Measured: on an AVX-512 Intel machine every window within 0.6 %; on an AVX2 AMD machine the
    first five within 0.32 %, then a gap that opens to +1.6, 2.8, 3.0, 3.4 and 4.6 % (bf16 behind).
    That later gap is bf16's own rounding, not the chaos of a perturbed run: fp32 with its Newton-Schulz
    in fp32 instead of bf16 stays within 0.72 % of fp32 in every window on the same machine."""
    base, data = env
    t0 = time.perf_counter()
    runs = {}
    for dtype in ("fp32", "bf16"):
        runs[dtype] = _trainer(base, data, f"track_{dtype}", dtype, 200).train().losses
    wall = time.perf_counter() - t0
    a, b = runs["fp32"], runs["bf16"]
    assert len(a) == len(b) == 200 and None not in a and None not in b
    # Per-step losses differ by batch noise amplified through training; compare 20-step means.
    gaps = []
    for w in range(0, 200, 20):
        ma, mb = sum(a[w:w + 20]) / 20, sum(b[w:w + 20]) / 20
        gaps.append((mb - ma) / ma)
    assert all(abs(g) <= 0.01 for g in gaps[:5]), gaps
    assert all(abs(g) <= 0.06 for g in gaps), gaps
    assert a[-1] < a[0] - 0.5 and b[-1] < b[0] - 0.5  # both actually trained
    print(f"bf16 vs fp32, 2 x 200 nano steps: {wall:.1f} s, 20-step mean gaps "
          + " ".join(f"{g:+.2%}" for g in gaps))
