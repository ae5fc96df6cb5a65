"""benchmarks/scaling.py (issue 36): the power-law fit recovers a known curve, the compute multiplier
of a curve shifted by a known factor is that factor, the frontier keeps exactly the undominated
runs, a loss that does not fall is refused (beside the curve that does), and every variant's
run.toml is a config ``k3 train`` accepts, with the dense baseline at k3's activated parameters."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_scaling", ROOT / "benchmarks" / "scaling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


S = _load()
TRUE = {"E": 0.9, "A": 40.0, "alpha": 0.12}


def law(c: float, shift: float = 1.0) -> float:
    """The true curve, reached at ``shift`` times less compute when shift > 1."""
    return TRUE["E"] + TRUE["A"] * (c * shift) ** -TRUE["alpha"]


CS = [1e11 * 10 ** (k / 4) for k in range(9)]


def test_fit_recovers_a_known_power_law():
    fit = S.fit_curve([(c, law(c)) for c in CS], grid=2000)
    assert fit["E"] == pytest.approx(TRUE["E"], abs=2e-3)
    assert fit["alpha"] == pytest.approx(TRUE["alpha"], rel=0.02)
    assert fit["A"] == pytest.approx(TRUE["A"], rel=0.15)   # A trades off with alpha over a finite range
    for c in CS:
        assert S.loss_at(fit, c) == pytest.approx(law(c), abs=1e-3)


def test_multiplier_of_a_curve_shifted_in_compute_is_the_shift():
    base = S.fit_curve([(c, law(c)) for c in CS], grid=2000)
    var = S.fit_curve([(c, law(c, shift=2.5)) for c in CS], grid=2000)
    target = law(CS[-1], shift=2.5)
    assert S.multiplier(base, var, target) == pytest.approx(2.5, rel=0.03)
    assert S.multiplier(var, base, target) == pytest.approx(1 / 2.5, rel=0.03)
    assert S.multiplier(base, base, target) == pytest.approx(1.0)
    assert S.compute_at(base, base["E"] - 0.01) == math.inf   # below the asymptote: never reached


def test_frontier_keeps_the_runs_no_cheaper_run_beats():
    pts = [(1.0, 3.0), (2.0, 2.5), (3.0, 2.7), (4.0, 2.4), (5.0, 2.4), (6.0, 2.0)]
    assert S.frontier(pts) == [(1.0, 3.0), (2.0, 2.5), (4.0, 2.4), (6.0, 2.0)]
    assert S.frontier(list(reversed(pts))) == S.frontier(pts)


def test_frontier_compute_interpolates_in_log_compute_and_never_extrapolates():
    front = [(1e10, 3.0), (1e12, 2.0), (1e13, 1.5)]
    assert S.frontier_compute(front, 2.5) == pytest.approx(1e11)            # halfway in L, halfway in log C
    assert S.frontier_compute(front, 1.75) == pytest.approx(10 ** 12.5)
    assert S.frontier_compute(front, 3.0) == pytest.approx(1e10)
    assert S.frontier_compute(front, 1.5) == pytest.approx(1e13)
    assert S.frontier_compute(front, 3.1) is None and S.frontier_compute(front, 1.4) is None


def test_a_loss_that_does_not_fall_with_compute_is_refused():
    rising = [(c, 2.0 + 0.01 * k) for k, c in enumerate(CS)]
    with pytest.raises(ValueError, match="does not fall"):
        S.fit_curve(rising)
    with pytest.raises(ValueError, match="at least 3 points"):
        S.fit_curve([(c, law(c)) for c in CS[:2]])
    S.fit_curve([(c, law(c)) for c in CS[:3]])   # the control: three falling points fit


def _results(shocks: dict[str, tuple[float, float]]) -> list[dict]:
    """k3 at half dense's compute for the same loss (multiplier 2), both on five grid points, and at the
    middle point seeds 1 and 2 shifted by ``shocks[variant]``."""
    results = []
    for v, shift in (("k3", 2.0), ("dense", 1.0)):
        for c in CS[::2]:
            results.append({"variant": v, "flops": c, "val_bpb": law(c, shift), "scan": False, "seed": 0,
                            "width": 0, "steps": 0})
        results.append({"variant": v, "flops": CS[4], "val_bpb": law(CS[4], shift), "scan": False, "seed": 0,
                        "width": S.MIDDLE[0], "steps": S.MIDDLE[1]})
        for seed, eps in zip((1, 2), shocks[v]):
            results.append({"variant": v, "flops": CS[4], "val_bpb": law(CS[4], shift) + eps, "scan": False,
                            "seed": seed, "width": S.MIDDLE[0], "steps": S.MIDDLE[1]})
    return results


def test_analyse_brackets_the_multiplier_with_the_paired_seed_noise():
    results = _results({"k3": (0.01, -0.01), "dense": (-0.01, 0.01)})
    out = S.analyse(results, bootstrap=200)
    # paired differences k3 - dense over seeds 0, 1, 2: 0, +0.02, -0.02 (the curves meet at CS[4] + shift);
    # their sample std is 0.02, and sigma is that over sqrt 2
    d0 = law(CS[4], 2.0) - law(CS[4])
    diffs = [d0, d0 + 0.02, d0 - 0.02]
    m = sum(diffs) / 3
    assert out["sigma"] == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in diffs) / 2) / math.sqrt(2), rel=1e-6)
    assert out["seed_spread"]["per_variant"]["k3"] == pytest.approx(0.01, rel=1e-6)
    mult = out["multipliers"]["k3"]
    assert mult["target_bpb"] == pytest.approx(law(CS[8]))   # the lowest loss both reach: dense's best
    assert mult["multiplier"] == pytest.approx(2.0, rel=0.05)
    assert mult["fit_multiplier"] == pytest.approx(2.0, rel=0.05)
    lo, hi = mult["ci95"]
    assert lo < mult["multiplier"] < hi
    assert "dense" not in out["multipliers"]
    a_lo, a_hi = out["fits"]["k3"]["alpha_ci95"]
    assert a_lo < TRUE["alpha"] < a_hi   # the noise-free curve's exponent lies inside its interval


def test_a_seed_shock_shared_by_both_variants_cancels_in_the_noise():
    out = S.analyse(_results({"k3": (0.03, -0.03), "dense": (0.03, -0.03)}), bootstrap=50)
    assert out["seed_spread"]["per_variant"]["dense"] == pytest.approx(0.03, rel=1e-6)   # each variant moves
    assert out["sigma"] == pytest.approx(0.0, abs=1e-12)                                # their difference not
    assert "ci95" not in out["multipliers"]["k3"]
    alone = S.analyse([r for r in _results({"k3": (0.0, 0.0), "dense": (0.0, 0.0)})
                       if r["variant"] == "k3" or r["seed"] == 0])   # no paired seeds: no sigma
    assert alone["sigma"] is None and "ci95" not in alone["multipliers"]["k3"]


@pytest.mark.parametrize("variant", list(S.VARIANTS))
def test_every_variant_writes_a_config_k3_train_accepts(variant, tmp_path):
    from k3.train.config import TrainConfig, resolve_model_config

    run = S.Run(variant, 128, 30)
    path = tmp_path / "run.toml"
    path.write_text(S.run_toml(run, 1e-3))
    tc = TrainConfig.build(str(path), overrides={"out": str(tmp_path / "out")})
    cfg = resolve_model_config(tc)
    assert (cfg.hidden_size, tc.steps, tc.lr) == (128, 30, 1e-3)
    if variant == "dense":
        assert cfg.num_experts == 0 and cfg.kda_layer_ids == [] and cfg.attn_res_block_size is None
        assert tc.optimizer == "adamw"
    if variant == "all_mla":
        assert cfg.kda_layer_ids == [] and cfg.num_experts > 0


def test_dense_baseline_matches_k3_activated_parameters():
    from k3.model.summary import build_meta_model, parameter_breakdown

    for width in (128, 256):
        k3 = parameter_breakdown(build_meta_model(S.model_config(S.k3_shape(width)))).activated
        dense_cfg = S.model_config({**S.dense_shape(width, S.matched_dense_intermediate(width)),
                                    "attn_res_block_size": None})
        dense = parameter_breakdown(build_meta_model(dense_cfg)).activated
        assert abs(dense - k3) / k3 < 0.01


def test_the_demo_model_is_the_width_128_point_of_the_k3_family():
    """k3 demo's model, spelled out in src (which cannot import benchmarks), is the scaling study's
    k3 shape at width 128: a change to either shows here; another width is another shape (control)."""
    from k3.cli.train import DEMO_CONFIG

    assert S.k3_shape(128) == DEMO_CONFIG["model_overrides"]
    assert S.k3_shape(192) != DEMO_CONFIG["model_overrides"]
