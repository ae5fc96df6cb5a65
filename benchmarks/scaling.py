"""What the architecture is worth (issue 36): a scaling sweep of the K3 design against a dense
baseline and one-feature-off variants, fitted loss-vs-compute curves, and compute multipliers.

Every run is a normal ``k3 train`` run directory (``--out``/VARIANT/d{width}_s{steps}[...]) made from
a run.toml this script writes; the sweep is resumable: a run whose ``scaling.json`` exists is read,
an interrupted one is resumed from its checkpoint (``k3 train --resume``), the rest are started.

    python benchmarks/scaling.py run [--variants k3,dense] [--widths 128,192,256] [--steps 30,90,270]
                                     [--parallel 2] [--out runs/scaling]
    python benchmarks/scaling.py fit [--out runs/scaling] [--save]

**Grid.** All variants share data (the Python stdlib corpus of ``k3 demo``), tokenizer (the tiny
preset's 4,096 tokens), batch (16 x 256 tokens), schedule (WSD, warmup 0.1, decay over the last 0.7)
and seed; widths scale the demo's 2-layer shape (``k3_shape``: heads of 64, every tiny-preset
width-linked size x width/256); steps set the token budget. Each run is scored on the whole
validation split (bits per byte).

**Variants.** ``k3``: the demo's design (KDA then Gated MLA, Block AttnRes, LatentMoE 16 experts top-4
+ 1 shared with Quantile Balancing, SiTU, Per-Head Muon). ``dense``: a dense Llama-style transformer
built from the same code with every K3 feature off: softmax attention (MLA, no output gate) at every
layer, dense SwiGLU MLPs whose width is chosen so the activated parameters match ``k3`` at the same
width (``matched_dense_intermediate``), standard residuals, AdamW. (It differs from nanoGPT in its
RMSNorm, RoPE and SwiGLU, the choices of every current dense baseline.) One-feature-off:
``standard_residual``, ``swiglu``, ``sign_balance``, ``adamw``, ``all_mla``. The learning rate of
``k3``, ``dense`` and ``adamw`` is chosen by a scan at the grid's middle point (``LR_SCAN``, widened
by factors of 2 while the best is at an end: ``scan_lrs``), so no variant is compared at an lr tuned
for another; the one-feature-off variants keep k3's.

**Compute.** C = training tokens x model FLOPs per token (benchmarks/train.py
``model_flops_per_token``: 6 x activated parameters + MLA scores and values + the KDA recurrence),
counted from the model, never from wall time.

**Fit** (``fit_curve``). Per variant, the compute-efficient frontier (each run whose loss is below
every run of smaller C) is fitted to L(C) = E + A C^-alpha by least squares on L: for each E on a
grid below the smallest loss, log(L - E) is linear in log C; the E with the least squared error wins
(E = 0: the frontier still bends down in log-log, no irreducible loss shows at this scale).
**Multiplier** (``matched``): at L*, the lowest loss both the variant's and dense's frontiers reach,
C_dense(L*) / C_variant(L*), each read off its frontier (linear in log C between the runs around L*:
no extrapolation, no functional form); the fitted curves' ratio at L* beside it. Intervals:
a parametric bootstrap, each run's loss redrawn from N(L, sigma), the frontier refitted each time;
2.5-97.5 %. sigma is measured at the middle point with extra seeds (``SEED_REPLICATES``): the spread
of the paired difference k3 - dense over seeds, over sqrt 2 (``seed_spread``: the data order a seed
sets is shared by all variants and cancels in a comparison).

``fit --save`` writes docs/data/scaling.json (every run, every fit, every multiplier, stamped) and
docs/scaling.png; docs/SCALING.md's tables are rendered from the JSON by benchmarks/docs_tables.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

WIDTHS = (128, 192, 256)
STEPS = (30, 90, 270)
BATCH, SEQ = 16, 256
MIDDLE = (192, 90)                  # the lr scans and seed replicates run here
SEED_REPLICATES = {"k3": (1, 2), "dense": (1, 2)}
LR_SCAN = {"k3": (2.5e-3, 5e-3, 1e-2), "dense": (1e-3, 2.5e-3, 5e-3), "adamw": (1e-3, 2.5e-3, 5e-3)}
MAX_WIDEN = 3                       # lr scan: at most this many points added past an end
BOOTSTRAP = 2000
DATA = ROOT / "docs" / "data" / "scaling.json"
PLOT = ROOT / "docs" / "scaling.png"


# ----------------------------------------------------------------------------------- the models
def k3_shape(width: int) -> dict:
    """model_overrides on the tiny preset: the k3 demo's 2-layer design at ``width``."""
    if width % 64:
        raise SystemExit(f"width {width} is not a multiple of 64 (heads of 64)")
    heads, r = width // 64, width / 256
    return {"hidden_size": width, "num_hidden_layers": 2, "attn_res_block_size": 1,
            "num_attention_heads": heads, "q_lora_rank": int(128 * r), "kv_lora_rank": int(64 * r),
            "intermediate_size": int(768 * r), "moe_intermediate_size": int(128 * r),
            "routed_expert_hidden_size": int(128 * r),
            "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": heads,
                                   "head_dim": 64, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                                   "use_full_rank_gate": True}}


def model_config(overrides: dict):
    from k3.config import get_preset
    return get_preset("tiny", **overrides)


def activated(overrides: dict) -> int:
    from k3.model.summary import build_meta_model, parameter_breakdown
    return parameter_breakdown(build_meta_model(model_config(overrides))).activated


def all_mla_shape(width: int) -> dict:
    """k3_shape with Gated MLA at both layers (no KDA)."""
    shape = k3_shape(width)
    return {**shape, "linear_attn_config": {**shape["linear_attn_config"], "kda_layers": [],
                                            "full_attn_layers": [1, 2]}}


def dense_shape(width: int, intermediate: int) -> dict:
    return {**all_mla_shape(width), "num_experts": 0, "first_k_dense_replace": 2, "intermediate_size": intermediate,
            "hidden_act": "silu", "mla_use_output_gate": False}


@functools.cache
def matched_dense_intermediate(width: int) -> int:
    """The dense MLP width (a multiple of 16) whose model's activated parameters are closest to k3's."""
    target = activated(k3_shape(width))
    def dense(i):  # as trained: attn_res = false in the run's TrainConfig removes the AttnRes queries
        return activated({**dense_shape(width, i), "attn_res_block_size": None})
    return min(range(16, 16 * width + 1, 16), key=lambda i: abs(dense(i) - target))


@dataclass
class Variant:
    doc: str
    model: callable                                 # width -> model_overrides
    train: dict = field(default_factory=dict)       # TrainConfig fields


VARIANTS: dict[str, Variant] = {
    "k3": Variant("the K3 design (the demo's)", k3_shape),
    "dense": Variant("dense baseline: MLA everywhere, dense SwiGLU, standard residual, AdamW",
                     lambda w: dense_shape(w, matched_dense_intermediate(w)),
                     {"optimizer": "adamw", "balance": "off", "attn_res": False}),
    "standard_residual": Variant("K3 with standard residuals (no Block AttnRes)", k3_shape, {"attn_res": False}),
    "swiglu": Variant("K3 with SwiGLU instead of SiTU", lambda w: {**k3_shape(w), "hidden_act": "silu"}),
    "sign_balance": Variant("K3 with DeepSeek-V3 sign-update balancing instead of QB", k3_shape,
                            {"balance": "sign"}),
    "adamw": Variant("K3 with AdamW instead of Per-Head Muon", k3_shape, {"optimizer": "adamw"}),
    "all_mla": Variant("K3 with Gated MLA at both layers (no KDA)", all_mla_shape),
}


# ------------------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Run:
    variant: str
    width: int
    steps: int
    seed: int = 0
    lr: float | None = None          # None: the variant's chosen lr

    def name(self) -> str:
        s = f"d{self.width}_s{self.steps}"
        if self.seed:
            s += f"_seed{self.seed}"
        if self.lr is not None:
            s += f"_lr{self.lr:g}"
        return s


def run_toml(run: Run, lr: float) -> str:
    v = VARIANTS[run.variant]
    fields = {"preset": "tiny", "batch_size": BATCH, "curriculum": [[0, SEQ]], "steps": run.steps, "lr": lr,
              "warmup_frac": 0.1, "decay_frac": 0.7, "seed": run.seed, "threads": 1, "eval_interval": 0,
              "final_eval_batches": 0, "ckpt_interval": max(run.steps // 3, 10), "log_interval": 10,
              "plot": False, **v.train}
    lines = [f"{k} = {_toml(val)}" for k, val in fields.items()]
    lines.append("[model_overrides]")
    lines += [f"{k} = {_toml(val)}" for k, val in v.model(run.width).items()]
    return "\n".join(lines) + "\n"


def _toml(v) -> str:
    if v is None:
        raise ValueError("TOML has no null")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def scan_lrs(out: Path, variant: str) -> list[float]:
    """The learning rates ``variant``'s scan needs: LR_SCAN's, widened by a factor of 2 past whichever
    end holds the lowest loss until the best is inside the scan (at most MAX_WIDEN times)."""
    lrs = list(LR_SCAN.get(variant, ()))
    for _ in range(MAX_WIDEN):
        got = [read_result(out, Run(variant, *MIDDLE, lr=lr)) for lr in lrs]
        if not lrs or any(g is None for g in got):
            break
        best = min(range(len(lrs)), key=lambda i: got[i]["val_bpb"])
        if best == len(lrs) - 1:
            lrs.append(lrs[-1] * 2)
        elif best == 0:
            lrs.insert(0, lrs[0] / 2)
        else:
            break
    return lrs


def chosen_lr(out: Path, variant: str) -> float | None:
    """The scanned lr with the lowest loss for ``variant`` (None while its scan is unfinished); a variant
    without a scan of its own takes k3's."""
    lrs = scan_lrs(out, lr_owner(variant))
    got = [read_result(out, Run(lr_owner(variant), *MIDDLE, lr=lr)) for lr in lrs]
    if any(g is None for g in got):
        return None
    return min(zip(lrs, got), key=lambda x: x[1]["val_bpb"])[0]


def lr_owner(variant: str) -> str:
    """Whose scan sets ``variant``'s lr: its own, or k3's for the one-feature-off variants."""
    return variant if variant in LR_SCAN else "k3"


def read_result(out: Path, run: Run) -> dict | None:
    p = out / run.variant / run.name() / "scaling.json"
    return json.loads(p.read_text()) if p.exists() else None


def start(out: Path, run: Run, lr: float) -> subprocess.Popen:
    d = out / run.variant / run.name()
    d.mkdir(parents=True, exist_ok=True)
    toml = d.parent / f"{run.name()}.toml"
    toml.write_text(run_toml(run, lr))
    if any(d.glob("checkpoint-*")):
        cmd = ["--resume", str(d)]
    else:
        cmd = ["--config", str(toml), "--out", str(d), "--overwrite"]
    log = open(d.parent / f"{run.name()}.log", "a")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, "-m", "k3.cli", "train", *cmd], stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def finish(out: Path, run: Run, lr: float, wall_s: float) -> dict:
    """Read the finished run's final validation record and count its compute; write scaling.json."""
    from train import model_flops_per_token
    from k3.model.summary import build_meta_model, parameter_breakdown

    d = out / run.variant / run.name()
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    val = [r for r in recs if r["kind"] == "val"]
    train = [r for r in recs if r["kind"] == "train"]
    if not val or train[-1]["step"] != run.steps:
        raise SystemExit(f"{d}: no final validation record (see {d.parent / (run.name() + '.log')})")
    from k3.config import K3Config
    ckpt = max(d.glob("checkpoint-*/model/config.json"))   # the model that trained, switches applied
    model = build_meta_model(K3Config.from_json(str(ckpt)))
    fpt = model_flops_per_token(model, SEQ)
    tokens = run.steps * BATCH * SEQ
    res = {"variant": run.variant, "width": run.width, "steps": run.steps, "seed": run.seed, "lr": lr,
           "scan": run.lr is not None, "tokens": tokens, "flops_per_token": fpt["total"],
           "flops": fpt["total"] * tokens, "activated_params": fpt["activated_params"],
           "total_params": parameter_breakdown(model).total, "val_bpb": val[-1]["val_bpb"],
           "val_loss": val[-1]["val_loss"], "val_tokens": val[-1]["val_tokens"], "wall_s": round(wall_s, 1)}
    (d / "scaling.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def plan(out: Path, variants: list[str], widths, steps) -> list[tuple[Run, float | None]]:
    """The runs still to do: lr scans first, then seed replicates and the grid (their lr known only
    once the scan is done: None)."""
    todo = []
    for v in dict.fromkeys(lr_owner(v) for v in variants):
        for lr in scan_lrs(out, v):
            todo.append((Run(v, *MIDDLE, lr=lr), lr))
    for v in variants:
        for seed in SEED_REPLICATES.get(v, ()):
            todo.append((Run(v, *MIDDLE, seed=seed), None))
        for w in widths:
            for s in steps:
                todo.append((Run(v, w, s), None))
    return [(r, lr) for r, lr in todo if read_result(out, r) is None]


def run_sweep(out: Path, variants: list[str], widths, steps, parallel: int) -> None:
    todo = plan(out, variants, widths, steps)
    print(f"{len(todo)} runs to do under {out} (more if an lr scan widens)", flush=True)
    active: list[tuple[Run, float, subprocess.Popen, float]] = []
    while todo or active:
        running = {a[0] for a in active}
        todo = [t for t in plan(out, variants, widths, steps) if t[0] not in running]
        for item in list(active):
            run, lr, proc, t0 = item
            if proc.poll() is None:
                continue
            active.remove(item)
            if proc.returncode:
                raise SystemExit(f"{run.variant}/{run.name()} failed (exit {proc.returncode}): see "
                                 f"{out / run.variant / (run.name() + '.log')}")
            res = finish(out, run, lr, time.time() - t0)
            print(f"  {run.variant}/{run.name()}: {res['val_bpb']:.4f} bpb, {res['flops']:.3g} FLOPs, "
                  f"{res['wall_s']:.0f} s", flush=True)
        ready = [(r, lr if lr is not None else chosen_lr(out, r.variant)) for r, lr in todo]
        ready = [(r, lr) for r, lr in ready if lr is not None]
        while ready and len(active) < parallel:
            run, lr = ready.pop(0)
            active.append((run, lr, start(out, run, lr), time.time()))
        if todo and not active and not ready:
            raise SystemExit(f"no run can start: {[r.name() for r, _ in todo]}")
        time.sleep(2)


# ------------------------------------------------------------------------------------- the fit
def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (C, L) whose L is below that of every point of smaller C, in order of C."""
    out, best = [], math.inf
    for c, loss in sorted(points):
        if loss < best:
            out.append((c, loss))
            best = loss
    return out


def fit_curve(points: list[tuple[float, float]], grid: int = 400) -> dict:
    """Least-squares fit of L = E + A C^-alpha to ``points`` [(C, L)], E on a grid in [0, min L)."""
    if len(points) < 3:
        raise ValueError(f"a 3-parameter fit needs at least 3 points, got {len(points)}")
    xs = [math.log(c) for c, _ in points]
    lmin = min(loss for _, loss in points)
    best = None
    for i in range(grid):
        e = lmin * i / grid
        ys = [math.log(loss - e) for _, loss in points]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        alpha, log_a = -slope, my - slope * mx
        if alpha <= 0:
            continue
        sse = sum((e + math.exp(log_a - alpha * x) - loss) ** 2 for x, (_, loss) in zip(xs, points))
        if best is None or sse < best["sse"]:
            best = {"E": e, "A": math.exp(log_a), "alpha": alpha, "sse": sse, "points": n}
    if best is None:
        raise ValueError("no decreasing power law fits these points (the loss does not fall with compute)")
    return best


def loss_at(fit: dict, c: float) -> float:
    return fit["E"] + fit["A"] * c ** -fit["alpha"]


def compute_at(fit: dict, loss: float) -> float:
    """The compute at which the fitted curve reaches ``loss`` (inf when it never does)."""
    if loss <= fit["E"]:
        return math.inf
    return (fit["A"] / (loss - fit["E"])) ** (1 / fit["alpha"])


def multiplier(base: dict, var: dict, loss: float) -> float:
    """How many times the compute ``base`` needs to reach ``loss`` that ``var`` needs."""
    return compute_at(base, loss) / compute_at(var, loss)


def interval95(xs: list[float]) -> list[float]:
    """The 2.5 % and 97.5 % points of ``xs`` (at least 2 values), linear between order statistics."""
    q = statistics.quantiles(xs, n=40, method="inclusive")
    return [q[0], q[-1]]


def seed_spread(results: list[dict]) -> dict:
    """Seed-to-seed noise at the middle point (seed 1, 2, ... reorder the training documents and draw a
    new init). ``per_variant``: each replicated variant's std of bits/byte. ``sigma``, the noise the
    bootstrap draws per run: the std over seeds of the paired difference k3 - dense, divided by sqrt 2.
    The seed's data order moves every variant alike (all share it), and that part cancels in a
    comparison; what is left is the per-variant noise (None without two paired seeds)."""
    at = {}
    for r in results:
        if (r["width"], r["steps"]) == MIDDLE and not r["scan"]:
            at.setdefault(r["variant"], {})[r["seed"]] = r["val_bpb"]
    per = {v: statistics.stdev(xs.values()) for v, xs in at.items() if len(xs) >= 2}
    paired = sorted(set(at.get("k3", {})) & set(at.get("dense", {})))
    diffs = [at["k3"][s] - at["dense"][s] for s in paired]
    sigma = statistics.stdev(diffs) / math.sqrt(2) if len(diffs) >= 2 else None
    return {"per_variant": per, "paired_seeds": paired, "sigma": sigma}


def frontier_compute(front: list[tuple[float, float]], loss: float) -> float | None:
    """The compute at which a frontier reaches ``loss``: linear in (log C, L) between the two frontier
    runs around it; None when ``loss`` is outside the frontier's losses (no extrapolation)."""
    for (c0, l0), (c1, l1) in zip(front, front[1:]):
        if l1 <= loss <= l0:
            t = (l0 - loss) / (l0 - l1)
            return math.exp(math.log(c0) + t * (math.log(c1) - math.log(c0)))
    return None


def matched(front_base: list, front_var: list, fit_base: dict | None = None, fit_var: dict | None = None) -> dict:
    """The multiplier of a variant against the baseline at the lowest loss both frontiers reach (L*):
    C_base(L*) / C_var(L*) read off the frontiers (``frontier_compute``), and the same ratio from the
    fitted curves when both are given."""
    target = max(min(x for _, x in front_base), min(x for _, x in front_var))
    cb, cv = frontier_compute(front_base, target), frontier_compute(front_var, target)
    out = {"target_bpb": target, "compute": cv, "compute_base": cb,
           "multiplier": cb / cv if cb is not None and cv is not None else None}
    if fit_base and fit_var and "error" not in fit_base and "error" not in fit_var:
        out["fit_multiplier"] = _finite(multiplier(fit_base, fit_var, target))
    return out


def analyse(results: list[dict], bootstrap: int = BOOTSTRAP, seed: int = 0) -> dict:
    """Per variant: its frontier and fitted curve, and its multiplier against ``dense`` at the lowest
    loss both reach (``matched``), with a bootstrap interval from the paired seed noise."""
    grid = {}
    for r in results:
        if not r["scan"] and r["seed"] == 0:
            grid.setdefault(r["variant"], []).append((r["flops"], r["val_bpb"]))
    fits = {}
    for v, pts in grid.items():
        front = frontier(pts)
        try:
            fit = fit_curve(front)
            fits[v] = {**fit, "frontier": front, "E_at_zero": fit["E"] == 0.0}
        except ValueError as e:
            fits[v] = {"error": str(e), "frontier": front}
    spread = seed_spread(results)
    out = {"fits": fits, "sigma": spread["sigma"], "seed_spread": spread, "multipliers": {}}
    if "dense" not in grid or len(fits["dense"]["frontier"]) < 2:
        return out
    variants = [v for v in grid if v != "dense" and len(fits[v]["frontier"]) >= 2]
    sigma = out["sigma"] or 0.0
    rng = random.Random(seed)
    draws = {v: [] for v in variants}
    alphas = {v: [] for v in ["dense", *variants] if "error" not in fits[v]}
    for _ in range(bootstrap if sigma else 0):
        noisy = {v: frontier([(c, x + rng.gauss(0.0, sigma)) for c, x in grid[v]]) for v in ["dense", *variants]}
        for v in variants:
            if len(noisy[v]) >= 2 and len(noisy["dense"]) >= 2:
                m = matched(noisy["dense"], noisy[v])["multiplier"]
                if m is not None:
                    draws[v].append(m)
        for v in alphas:
            try:
                alphas[v].append(fit_curve(noisy[v], grid=100)["alpha"])
            except ValueError:
                pass
    for v, xs in alphas.items():   # the fitted exponent's interval under the same noise
        if len(xs) >= 2:
            fits[v]["alpha_ci95"] = interval95(xs)
    for v in variants:
        row = matched(fits["dense"]["frontier"], fits[v]["frontier"], fits["dense"], fits[v])
        if len(draws[v]) >= 2:
            row["ci95"] = interval95(draws[v])
            row["draws"] = len(draws[v])
        out["multipliers"][v] = row
    return out


def _finite(x: float) -> float | None:
    """None for a curve that never reaches the loss (JSON has no infinity)."""
    return x if math.isfinite(x) else None


def collect(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/*/scaling.json"))]


def plot(results: list[dict], analysis: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, (v, fit) in enumerate(sorted(analysis["fits"].items())):
        color = f"C{i}"
        pts = [(r["flops"], r["val_bpb"]) for r in results if r["variant"] == v and not r["scan"] and not r["seed"]]
        ax.scatter([c for c, _ in pts], [x for _, x in pts], color=color, s=14, alpha=0.5)
        ax.plot([c for c, _ in fit["frontier"]], [x for _, x in fit["frontier"]], color=color, ls="--", lw=0.8,
                marker="o", ms=5)   # the frontier the multipliers are read off
        if "error" not in fit:
            cs = [c for c, _ in pts]
            lo, hi = min(cs), max(cs)
            xs = [lo * (hi / lo) ** (k / 60) for k in range(61)]
            ax.plot(xs, [loss_at(fit, x) for x in xs], color=color,
                    label=f"{v}: {fit['E']:.2f} + {fit['A']:.3g}·C^-{fit['alpha']:.3f}")
    m = analysis["multipliers"].get("k3")
    if m and m["multiplier"] is not None:
        ax.axhline(m["target_bpb"], color="grey", ls=":", lw=0.8)
        ax.annotate(f"L* = {m['target_bpb']:.3f}: dense needs {m['multiplier']:.2f}x k3's compute",
                    (m["compute"], m["target_bpb"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (model FLOPs)")
    ax.set_ylabel("validation bits per byte (whole split)")
    ax.set_title("K3 design vs dense baseline and one-feature-off variants\n"
                 "(dashed: each variant's compute-efficient frontier; solid: its fitted L(C))", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(results: list[dict], analysis: dict) -> None:
    print(f"{'variant':<18}{'width':>6}{'steps':>6}{'seed':>5}{'lr':>8}{'act. params':>12}{'FLOPs':>10}"
          f"{'bpb':>8}{'wall s':>8}")
    for r in sorted(results, key=lambda r: (r["variant"], r["scan"], r["seed"], r["width"], r["steps"])):
        print(f"{r['variant']:<18}{r['width']:>6}{r['steps']:>6}{r['seed']:>5}{r['lr']:>8.4g}"
              f"{r['activated_params']:>12,}{r['flops']:>10.3g}{r['val_bpb']:>8.4f}{r['wall_s']:>8.0f}")
    sp = analysis["seed_spread"]
    print(f"\nseed spread at {MIDDLE}: per variant {sp['per_variant']}; paired k3 - dense over seeds "
          f"{sp['paired_seeds']}: sigma {sp['sigma']}")
    for v, f in analysis["fits"].items():
        print(f"fit {v}: " + (f["error"] if "error" in f else
                              f"L = {f['E']:.4f} + {f['A']:.4g} C^-{f['alpha']:.4f} on {f['points']} frontier points"))
    if analysis["multipliers"]:
        print("\nmultipliers vs dense at L*, the lowest loss both frontiers reach (frontier interpolation; "
              "the fitted curves' ratio beside it)")
    for v, m in analysis["multipliers"].items():
        ci = m.get("ci95")
        print(f"  {v:<18} L* {m['target_bpb']:.4f}  {_fmt_x(m['multiplier']):>9}"
              + (f"  [{_fmt_x(ci[0])}, {_fmt_x(ci[1])}]" if ci else "")
              + (f"  fit {_fmt_x(m.get('fit_multiplier'))}" if "fit_multiplier" in m else ""))


def _fmt_x(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}x"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["run", "fit"])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "scaling")
    ap.add_argument("--variants", default="k3,dense")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--steps", default=",".join(map(str, STEPS)))
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--save", action="store_true", help="write docs/data/scaling.json and docs/scaling.png")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    widths = [int(x) for x in a.widths.split(",")]
    steps = [int(x) for x in a.steps.split(",")]
    if a.what == "run":
        run_sweep(a.out, variants, widths, steps, a.parallel)
    results = collect(a.out)
    analysis = analyse(results)
    print_table(results, analysis)
    if a.save:
        from _timing import measured_on
        grid = {"widths": sorted({r["width"] for r in results}), "steps": sorted({r["steps"] for r in results}),
                "batch": BATCH, "seq_len": SEQ, "middle": MIDDLE}
        DATA.write_text(json.dumps({**measured_on(), "grid": grid,
                                    "variants": {v: VARIANTS[v].doc for v in VARIANTS},
                                    "runs": results, **analysis}, indent=1) + "\n")
        plot(results, analysis, PLOT)
        print(f"wrote {DATA} and {PLOT}")


if __name__ == "__main__":
    main()
