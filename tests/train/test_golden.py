"""Golden losses of `nano`: the first 20 training losses on fixed data, seed 0, fp32, one thread.

Any change to the model math, the init, the optimizer, the router balancing or the lr schedule
moves these numbers; the test fails and says so. The data is a synthetic token stream from a
pure-Python LCG (identical on every machine; no corpus, no tokenizer). The loop mirrors one
Trainer step: CE loss, backward, grad-norm clip 1.0, Per-Head Muon + AdamW, Quantile Balancing.

The last bits of a float32 step depend on the machine's vector unit: torch's CPU kernels, MKL and
k3's C kernels (built with -march=native) each pick a code path by ISA, and the Per-Head Muon's
bf16 Newton-Schulz turns a last-bit difference of a gradient into a 1e-4-level difference of the
next loss (seen: an AVX2 AMD machine agrees with the AVX-512 Intel golden for steps 0-2 within
7.7e-6, then moves 1.2e-4 at step 3 and 1.1e-2 by step 7). So the file keeps one list per
numerics key (architecture, CPU vendor, torch's CPU capability): all 20 losses are compared with
this machine's list; the first ``CROSS_STEPS`` with every list, whatever machine recorded it.

A deliberate change regenerates the file (and the diff shows in review); ``--update`` keeps only
this machine's list (the others are stale after a change of the math), ``--add`` adds this
machine's list to a file recorded by the same code elsewhere::

    PYTHONPATH=src python tests/train/test_golden.py --update
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).with_name("golden_nano.json")
SETUP = dict(preset="nano", seed=0, steps=20, batch_size=4, seq_len=64, lr=2e-2, warmup=2, decay=6,
             weight_decay=0.1, grad_clip=1.0, optimizer="per_head", balance="quantile", dtype="fp32")
RTOL = 1e-5
CROSS_STEPS, CROSS_RTOL = 3, 1e-4  # the first losses, before a rounding difference is amplified


def numerics_key() -> str:
    """What picks the float code paths here: e.g. ``x86_64/GenuineIntel/AVX512``."""
    vendor = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("vendor_id", "CPU implementer")):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}/{vendor}/{torch.backends.cpu.get_cpu_capability()}"


def token_stream(n: int, vocab: int, seed: int = 12345) -> list[int]:
    """A learnable Markov stream: each token picks one of 4 successors of the previous one by an LCG."""
    state, prev, out = seed, 1, []
    for _ in range(n):
        state = (1103515245 * state + 12345) % 2**31
        prev = (prev * 5 + 7 * ((state >> 16) % 4) + 1) % vocab
        out.append(prev)
    return out


def golden_losses_with(**changes) -> list[float]:
    """The golden run with some of SETUP changed (the envelope test's control)."""
    global SETUP
    saved = SETUP
    SETUP = {**SETUP, **changes}
    try:
        return golden_losses()
    finally:
        SETUP = saved


def golden_losses() -> list[float]:
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM
    from k3.train.balance import RouterBalancer
    from k3.train.optim import build_optimizer
    from k3.train.schedule import WSDSchedule

    s = SETUP
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)                 # as the trainer does
    try:
        torch.manual_seed(s["seed"])
        cfg = get_preset(s["preset"])
        model = K3ForCausalLM(cfg)
        opt = build_optimizer(model, cfg, s["lr"], s["weight_decay"], muon=s["optimizer"])
        sched = WSDSchedule(s["steps"], s["warmup"], s["decay"], min_lr_ratio=0.0, peak_lr=s["lr"])
        bal = RouterBalancer(model, s["balance"])
        B, T = s["batch_size"], s["seq_len"]
        data = torch.tensor(token_stream(s["steps"] * B * T, cfg.vocab_size)).view(s["steps"], B, T)
        losses = []
        bal.recording(True)
        for step in range(s["steps"]):
            for g in opt.param_groups:
                g["lr"] = sched.lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss = model(data[step], labels=data[step]).loss
            loss.backward()
            bal.collect()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
            opt.step()
            bal.update()
            losses.append(loss.item())
        return losses
    finally:
        torch.set_num_threads(threads)


def _close(got, want, rtol) -> list:
    return [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if not math.isclose(g, w, rel_tol=rtol)]


@pytest.fixture(scope="module")
def golden():
    want = json.loads(GOLDEN.read_text())
    assert want["setup"] == SETUP, "the golden setup changed: regenerate deliberately (--update)"
    assert want["losses"] and all(len(v) == 20 for v in want["losses"].values())
    return want["losses"], golden_losses()


def test_first_losses_match_every_machines_golden(golden):
    lists, got = golden
    assert len(got) == 20
    for key, want in lists.items():
        bad = _close(got[:CROSS_STEPS], want[:CROSS_STEPS], CROSS_RTOL)
        assert not bad, f"losses moved against {key}'s golden (step, now, golden): {bad}; if intended: " \
                        f"{__doc__.split('::')[-1].strip()}"
    assert got[-1] < got[0] - 0.5                  # the golden run does learn


def envelope(lists: dict[str, list[float]]) -> list[tuple[float, float]]:
    """Per step, the band every machine's losses fall in: the recorded lists' range, widened on
    each side by twice that range (the measured spread between vector units) and by CROSS_RTOL."""
    band = []
    for vals in zip(*lists.values()):
        lo, hi = min(vals), max(vals)
        pad = 2 * (hi - lo) + CROSS_RTOL * abs(hi)
        band.append((lo - pad, hi + pad))
    return band


def test_nano_losses_match_this_machines_golden(golden):
    """This machine's own list to RTOL when it is recorded; otherwise every step inside the band of
    the recorded machines (``envelope``), so no CPU runs this test as a skip."""
    lists, got = golden
    key = numerics_key()
    if key in lists:
        bad = _close(got, lists[key], RTOL)
    else:
        bad = [(i, g, b) for i, (g, b) in enumerate(zip(got, envelope(lists))) if not b[0] <= g <= b[1]]
    assert not bad, (f"losses moved (step, now, golden{'' if key in lists else ' band of ' + str(sorted(lists))}): "
                     f"{bad}; if intended: {__doc__.split('::')[-1].strip()}")


def test_envelope_separates_a_changed_run(golden):
    """The band is narrow enough to catch a change of the math: the recorded losses of a run with
    the lr 10 % lower fall outside it (positive control: every recorded list falls inside)."""
    lists, _ = golden
    band = envelope(lists)
    for want in lists.values():
        assert all(lo <= w <= hi for w, (lo, hi) in zip(want, band))
    lower = golden_losses_with(lr=SETUP["lr"] * 0.9)
    assert any(not lo <= w <= hi for w, (lo, hi) in zip(lower, band))


def test_token_stream_is_fixed():
    # Independent of torch and of the machine. By hand: LCG states 1406932606, 654583775,
    # 1449466924, 229283573, 1109335178 give (state >> 16) % 4 = 0, 0, 1, 2, 3, so from prev = 1:
    # 5·1+1 = 6, 5·6+1 = 31, 5·31+7+1 = 163, (5·163+14+1) % 512 = 318, (5·318+21+1) % 512 = 76.
    assert token_stream(5, 512) == [6, 31, 163, 318, 76]
    assert len(set(token_stream(4096, 512))) > 100


if __name__ == "__main__":
    if sys.argv[1:] not in (["--update"], ["--add"]):
        sys.exit("usage: PYTHONPATH=src python tests/train/test_golden.py --update | --add")
    lists = {}
    if sys.argv[1] == "--add":
        old = json.loads(GOLDEN.read_text())
        if old["setup"] != SETUP or old["torch"] != torch.__version__:
            sys.exit(f"{GOLDEN}: recorded with another setup or torch; regenerate it with --update")
        lists = old["losses"]
    losses = golden_losses()
    if lists:
        bad = [k for k, v in lists.items() if _close(losses[:CROSS_STEPS], v[:CROSS_STEPS], CROSS_RTOL)]
        if bad:
            sys.exit(f"{GOLDEN}: the first {CROSS_STEPS} losses here differ from {bad}'s: not the same code?")
    lists[numerics_key()] = losses
    GOLDEN.write_text(json.dumps({"setup": SETUP, "torch": torch.__version__, "losses": lists},
                                 indent=1) + "\n")
    print(f"wrote {GOLDEN} [{numerics_key()}]: {losses[0]:.6f} -> {losses[-1]:.6f}")
