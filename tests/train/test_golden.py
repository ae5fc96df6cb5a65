"""Golden losses of `nano`: the first 20 training losses on fixed data, seed 0, fp32, one thread.

Any change to the model math, the init, the optimizer, the router balancing or the lr schedule
moves these numbers; the test fails and says so. The data is a synthetic token stream from a
pure-Python LCG (identical on every machine; no corpus, no tokenizer). The loop mirrors one
Trainer step: CE loss, backward, grad-norm clip 1.0, Per-Head Muon + AdamW, Quantile Balancing.

A deliberate change regenerates the file (and the diff shows in review):

    PYTHONPATH=src python tests/train/test_golden.py --update
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("golden_nano.json")
SETUP = dict(preset="nano", seed=0, steps=20, batch_size=4, seq_len=64, lr=2e-2, warmup=2, decay=6,
             weight_decay=0.1, grad_clip=1.0, optimizer="per_head", balance="quantile", dtype="fp32")
RTOL = 1e-5


def token_stream(n: int, vocab: int, seed: int = 12345) -> list[int]:
    """A learnable Markov stream: each token picks one of 4 successors of the previous one by an LCG."""
    state, prev, out = seed, 1, []
    for _ in range(n):
        state = (1103515245 * state + 12345) % 2**31
        prev = (prev * 5 + 7 * ((state >> 16) % 4) + 1) % vocab
        out.append(prev)
    return out


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


def test_nano_losses_match_the_golden_file():
    want = json.loads(GOLDEN.read_text())
    assert want["setup"] == SETUP, "the golden setup changed: regenerate deliberately (--update)"
    got = golden_losses()
    assert len(got) == len(want["losses"]) == 20
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want["losses"]))
           if not math.isclose(g, w, rel_tol=RTOL)]
    assert not bad, f"losses moved (step, now, golden): {bad}; if intended: {__doc__.split('::')[-1].strip()}"
    assert got[-1] < got[0] - 0.5                  # the golden run does learn


def test_token_stream_is_fixed():
    # Independent of torch and of the machine. By hand: LCG states 1406932606, 654583775,
    # 1449466924, 229283573, 1109335178 give (state >> 16) % 4 = 0, 0, 1, 2, 3, so from prev = 1:
    # 5·1+1 = 6, 5·6+1 = 31, 5·31+7+1 = 163, (5·163+14+1) % 512 = 318, (5·318+21+1) % 512 = 76.
    assert token_stream(5, 512) == [6, 31, 163, 318, 76]
    assert len(set(token_stream(4096, 512))) > 100


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: PYTHONPATH=src python tests/train/test_golden.py --update")
    losses = golden_losses()
    GOLDEN.write_text(json.dumps({"setup": SETUP, "torch": torch.__version__, "losses": losses},
                                 indent=1) + "\n")
    print(f"wrote {GOLDEN}: {losses[0]:.6f} -> {losses[-1]:.6f}")
