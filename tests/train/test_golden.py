"""Golden losses of `nano`: the first 20 training losses on fixed data, seed 0, fp32, one thread.

Any change to the model math, the init, the optimizer, the router balancing or the lr schedule
moves these numbers; the test fails and says so. The data is a synthetic token stream from a
pure-Python LCG (identical on every machine; no corpus, no tokenizer), given to the real Trainer
as an in-memory batch source (``Trainer(tc, batches=...)``); each step is ``Trainer.train_step``
itself (CE loss, backward, grad-norm clip 1.0, Per-Head Muon + AdamW, Quantile Balancing, in the
trainer's order), built from a TrainConfig of the SETUP values.

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
import tempfile
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


class LCGBatches:
    """The golden data as a Trainer batch source: step s's batch holds rows s·B … s·B + B − 1 of the
    LCG stream cut into rows of T tokens; a row's targets are its next tokens, its last position
    trains nothing (``model(x, labels=x)``'s shift: B·(T − 1) labels per step)."""

    fingerprint = "golden LCG stream"

    def __init__(self, steps: int, batch_size: int, seq_len: int, vocab: int):
        self.rows = torch.tensor(token_stream(steps * batch_size * seq_len, vocab)).view(steps, batch_size, seq_len)
        self.step = 0

    def next_batch(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        from k3.data.packing import IGNORE_INDEX
        x = self.rows[self.step]
        assert seq_len == x.shape[1], (seq_len, x.shape)
        self.step += 1
        return x, torch.cat([x[:, 1:], torch.full_like(x[:, :1], IGNORE_INDEX)], 1)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def golden_config(out: str):
    """The TrainConfig of SETUP (WSD warmup / decay given as fractions of the steps; one thread,
    no evaluation, no checkpoint until the end)."""
    from k3.train.config import TrainConfig

    s = SETUP
    return TrainConfig.build(overrides=dict(
        preset=s["preset"], seed=s["seed"], steps=s["steps"], batch_size=s["batch_size"],
        curriculum=[[0, s["seq_len"]]], lr=s["lr"], warmup_frac=s["warmup"] / s["steps"],
        decay_frac=s["decay"] / s["steps"], min_lr_ratio=0.0, weight_decay=s["weight_decay"],
        grad_clip=s["grad_clip"], optimizer=s["optimizer"], balance=s["balance"], dtype=s["dtype"],
        threads=1, out=out, eval_interval=0, ckpt_interval=0, plot=False))


def golden_losses() -> list[float]:
    """The losses of SETUP's steps, each one ``Trainer.train_step`` (one thread)."""
    from k3.config import get_preset
    from k3.train.loop import Trainer

    s = SETUP
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(prefix="k3-golden-") as tmp:
            tc = golden_config(str(Path(tmp) / "run"))
            data = LCGBatches(s["steps"], s["batch_size"], s["seq_len"], get_preset(s["preset"]).vocab_size)
            trainer = Trainer(tc, print_fn=lambda *a: None, tty=False, batches=data)
            try:
                sched = trainer.schedule
                assert (sched.warmup_steps, sched.decay_steps) == (s["warmup"], s["decay"])
                losses = []
                for _ in range(s["steps"]):
                    rec = trainer.train_step()
                    assert rec["kind"] == "train", rec
                    losses.append(rec["loss"])
            finally:
                trainer.close()
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
