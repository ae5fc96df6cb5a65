"""The generated tables in README.md and docs/ are what ``benchmarks/docs_tables.py`` renders from
the committed data under docs/data/ (nobody edited a figure by hand, and no data changed without
its tables); an edited figure is caught (the control). The README's micro-benchmark, demo and
ablation tables render from small fixture rows as expected, and a row or report without its
machine and date is refused."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tables():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


T = _tables()


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _blocks():
    """(doc, block name, its data file, the rendered table) for every block whose data is committed."""
    return [(doc, name, data, render(reader(data))) for data, doc, name, render, reader in T.blocks() if data.exists()]


def _block(text: str, name: str) -> str | None:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    return None if m is None else m.group(1).rstrip("\n")


BLOCKS = _blocks()


@pytest.mark.parametrize("doc,name,data,rendered", BLOCKS,
                         ids=[f"{d.name}:{n}" for d, n, _, _ in BLOCKS])
def test_each_generated_table_is_what_its_data_renders(doc, name, data, rendered):
    got = _block(doc.read_text(), name)
    assert got is not None, f"{doc.name}: no <!-- {name}:begin/end --> block"
    assert got == rendered, (f"{doc.name}'s {name} table differs from {data.relative_to(ROOT)}: "
                             "run python benchmarks/docs_tables.py")


def test_every_marked_block_in_the_docs_is_one_the_script_renders():
    """Each ``<!-- NAME:begin -->`` in README.md and docs/*.md is a block ``docs_tables.blocks()``
    renders into that file (else its figures could go stale unchecked). Control: a marker the
    script does not know is found."""
    known = {(doc, name) for _, doc, name, _, _ in T.blocks()}
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    marked = {(d, m) for d in docs for m in re.findall(r"<!-- ([a-z0-9_]+):begin -->", d.read_text())}
    assert marked and marked <= known, sorted(str(d.name) + ":" + m for d, m in marked - known)
    stray = {(docs[0], "made_up_block")}
    assert not (marked | stray) <= known


def test_an_edited_figure_is_caught(tmp_path):
    """The control: one digit changed inside a generated table no longer matches its data."""
    assert BLOCKS, "no generated tables with committed data"
    doc, name, _, rendered = BLOCKS[0]
    text = doc.read_text()
    block = _block(text, name)
    i = next(i for i, c in enumerate(block) if c.isdigit())
    edited = block[:i] + str((int(block[i]) + 1) % 10) + block[i + 1:]
    assert _block(text.replace(block, edited), name) != rendered


def test_the_readme_and_docs_are_what_rerendering_gives(tmp_path):
    """Rendering every table again (``docs_tables.py`` with no --save, on a copy) changes no file."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copyfile(T.README, tmp_path / "README.md")
    none = T.parser().parse_args([])    # no --save of any kind
    T.render_all(none, tmp_path)
    for f in [tmp_path / "README.md", *(tmp_path / "docs").glob("*.md")]:
        assert f.read_text() == (ROOT / f.relative_to(tmp_path)).read_text(), \
            f"{f.relative_to(tmp_path)} is not what its data renders: run python benchmarks/docs_tables.py"


def test_the_readme_has_its_generated_blocks_and_none_of_their_figures_outside():
    text = T.README.read_text()
    for name in ("micro", "demo", "ablations", "speed_train", "speed_infer"):
        assert _block(text, name) is not None, name
    outside = re.sub(r"<!-- (\w+):begin -->\n.*?<!-- \1:end -->", "", text, flags=re.S)
    for unit in ("tok/s", "tokens/s", "MB/s", "elements/s", "bits per byte", "bits/byte", " ms |"):
        assert not re.search(rf"\d[\d,.]* ?{re.escape(unit)}", outside), f"a typed figure in {unit!r} outside the markers"


STAMP = {"machine": "Test CPU, 2 cores", "date": "2026-01-02", "commit": "abc1234", "run": "r1"}


def _kda(metric, T, value, baseline, base, **cfg):
    ratio = value / baseline if metric.endswith("_scaling") else baseline / value
    return {"bench": "kda", "metric": metric, "value": value, "baseline": baseline, "ratio": ratio,
            "baseline_name": base, "config": {"B": 1, "H": 4, "D": 64, "T": T, "threads": 2, **cfg}, **STAMP}


MICRO_ROWS = [
    _kda("chunk_fwd", 1024, 0.0149, 0.0149 * 6.9, "recurrent_kda fwd", extrapolated_from=256),
    _kda("chunk_fwd", 1024, 0.0149, 1.5, "naive loop fwd", extrapolated_from=256),
    _kda("chunk_fwd", 4096, 0.0423, 0.0423 * 9.7, "recurrent_kda fwd", extrapolated_from=256),
    _kda("chunk_fwd_bwd", 1024, 0.0407, 0.0407 * 27, "recurrent_kda fwd+bwd", extrapolated_from=256),
    _kda("chunk_fwd_bwd", 4096, 0.156, 0.156 * 28, "recurrent_kda fwd+bwd", extrapolated_from=256),
    _kda("chunk_fwd_scaling", 16384, 0.215, 0.0423, "chunk_fwd at T=4096", vs_T=4096),
    *[{"bench": "model", "config": f"small B=2 T=512 threads=2 case={case}", "metric": m, "value": v, "baseline": b,
       "ratio": v / b, "params": 103_000_000, **STAMP}
      for case, m, v, b in (("k3", "forward_tokens_per_s", 703.0, 186.0),
                            ("k3", "forward_backward_tokens_per_s", 250.0, 42.0),
                            ("k3", "peak_rss_mb", 4096.0, 5000.0),
                            ("k3-kl", "forward_tokens_per_s", 589.0, 186.0),
                            ("k3-kl", "forward_backward_tokens_per_s", 243.0, 42.0))],
    {"bench": "moe", "config": "small N=2048 t=2 sorted grouped_mm", "metric": "fwd_bwd_s", "value": 0.21,
     "baseline": 0.39, "ratio": 1.9, "threads": 2, **STAMP},
    {"bench": "moe", "config": "small N=2048 t=2 capacity 1.25", "metric": "fwd_bwd_s", "value": 0.2,
     "baseline": 0.39, "ratio": 1.95, "threads": 2, **STAMP},
    *[{"bench": "checkpoint", "config": "small/bf16", "metric": m, "value": v, "baseline": v / r, "ratio": r,
       "size_MB": 206.4, **STAMP, "date": "2026-01-03"}
      for m, v, r in (("save_MBps", 695.0, 1.12), ("load_MBps", 1416.0, 0.79), ("build_and_load_MBps", 947.0, 4.1))],
    *[{"bench": "mx", "config": f"quantize {f} fp32 block32", "metric": "elements_per_s", "value": 1.8e7,
       "baseline": 1.8e7 / r, "ratio": r, "fmt": f, "threads": 1, **STAMP} for f, r in (("MXFP4", 130), ("MXFP8", 497))],
    {"bench": "mx", "config": "small routed experts", "metric": "bytes packed_mxfp4 vs bf16", "value": 36.8e6,
     "baseline": 138.4e6, "ratio": 0.266, **STAMP},
    {"bench": "mx", "config": "small decode b1 16 tok fp32", "metric": "tokens_per_s packed vs unpacked", "value": 7.3,
     "baseline": 17.4, "ratio": 0.42, "threads": 1, **STAMP},
]


def test_micro_table_from_fixture_rows():
    on = "Test CPU, 2 cores, 2026-01-02, commit abc1234"
    assert T.micro_table(MICRO_ROWS).splitlines() == [
        "| benchmark | figure | baseline | ratio | measured on |",
        "|---|---|---|---|---|",
        "| `kda.py` chunk_kda fwd, B=1 H=4 D=64, 2 threads, T=1024 / 4096 | 14.9 / 42.3 ms | recurrent_kda (timed on "
        f"the first 256 tokens, × T/256) | 6.9× / 9.7× | {on} |",
        "| `kda.py` chunk_kda fwd+bwd, B=1 H=4 D=64, 2 threads, T=1024 / 4096 | 40.7 / 156 ms | recurrent_kda (timed "
        f"on the first 256 tokens, × T/256) | 27× / 28× | {on} |",
        f"| `kda.py` growth T=16384 vs 4096 | fwd 5.08× | linear = 4× |  | {on} |",
        "| `model.py` `small` (103M params), B=2 T=512, 2 threads | fwd 703 tok/s, fwd+bwd 250 tok/s, peak RSS 4.0 GiB "
        f"| — | — | {on} |",
        "| `model.py` Kimi-Linear mode of `small` vs transformers `kimi_linear` (same math) | fwd 589, fwd+bwd 243 tok/s "
        f"| 186 / 42 tok/s | 3.17× / 5.79× | {on} |",
        f"| `moe.py` `small` MoE fwd+bwd, N=2048, 2 threads | sort + `grouped_mm` 0.21 s | per-expert loop 0.39 s | 1.9× | {on} |",
        "| `checkpoint.py` `small` bf16 (206 MB): save / load into a model / build + load | 695 / 1,416 / 947 MB/s | "
        "`torch.save` / `torch.load` | 1.12× / 0.79× / 4.1× | Test CPU, 2 cores, 2026-01-03, commit abc1234 |",
        "| `mx.py` quantize MXFP4 / MXFP8, 1 thread | 1.8e7 / 1.8e7 elements/s | per-block Python loop | 130× / 497× | "
        f"{on} |",
        f"| `mx.py` `small` routed experts packed MXFP4 | 36.8 MB | bf16 138.4 MB | 0.266 (= 4.25/16) | {on} |",
        f"| `mx.py` `small` decode, batch 1, 1 thread | packed 7.3 tok/s | unpacked 17.4 tok/s | 0.42× | {on} |",
    ]


ABLATION_ROWS = [
    {"bench": "ablations", "group": g, "variant": v, "metric": m, "val_loss": loss, "val_bpb": bpb, "load_cv": cv,
     "settings": {"preset": "nano", "steps": 300, "seq_len": 128, "batch_size": 8, "lr": 3e-3}, **STAMP}
    for g, v, m, loss, bpb, cv in (("optimizer", "per_head", "val_bpb", 3.575, 2.48, 0.125),
                                   ("optimizer", "adamw", "val_bpb", 3.649, 2.531, None),
                                   ("balance", "quantile", "load_cv", 3.575, 2.48, 0.125),
                                   ("balance", "sign", "load_cv", 3.583, 2.485, 0.276))]


def test_ablations_table_from_fixture_rows():
    assert T.ablations_table(ABLATION_ROWS).splitlines() == [
        "`benchmarks/ablations.py`: `k3 train --preset nano`, 300 steps of 8×128 tokens, lr 0.003, same data and "
        "seed; whole-split validation. Measured 2026-01-02 on Test CPU, 2 cores, commit abc1234 "
        "(`docs/data/ablations.jsonl`):",
        "",
        "| switch | variant | val loss | val bits/byte | final load CV |",
        "|---|---|---|---|---|",
        "| optimizer | **Per-Head Muon** | **3.575** | **2.480** | 0.125 |",
        "|  | AdamW | 3.649 | 2.531 | — |",
        "| router balance | **Quantile Balancing** | 3.575 | 2.480 | **0.125** |",
        "|  | DeepSeek-V3 sign update (rate 1e-3) | 3.583 | 2.485 | 0.276 |",
    ]


def _fake_trainer():
    """What ``k3.cli.train.demo_report`` reads of a Trainer, without training one."""
    recs = [{"kind": "train", "step": s, "tokens_per_s": 5000.0 + s, "load_cv": cv, "threads": 2}
            for s, cv in ((30, 0.4), (50, 0.3), (70, 0.2), (310, 0.1), (400, 0.12))]
    corpus = SimpleNamespace(name="stdlib:/usr/lib/python3.11", train_bytes=30_800_000, val_bytes=724_034,
                             num_documents=lambda split: 1740 if split == "train" else 46)
    lac = SimpleNamespace(kda_layers=[1], full_attn_layers=[2])
    return SimpleNamespace(tc=SimpleNamespace(preset="tiny", steps=400, batch_size=16, curriculum=[[0, 256]],
                                              threads="auto"),
                           model_config=SimpleNamespace(num_hidden_layers=2, hidden_size=256, linear_attn_config=lac),
                           corpus=corpus, metrics=SimpleNamespace(records=recs + [{"kind": "val", "step": 400}]),
                           model=SimpleNamespace(parameters=lambda: [SimpleNamespace(numel=lambda: 4_170_116)]))


def test_demo_report_renders_the_demo_table(monkeypatch):
    """``k3 demo``'s report (``runs/demo/report.json``) carries every figure of the README's demo block,
    with its machine and date."""
    from k3.cli import train as commands

    report = commands.demo_report(
        _fake_trainer(), full={"val_bpb": 1.5211, "val_loss": 3.469, "val_tokens": 220_114, "val_bytes": 724_034},
        plotted={"val_bpb": 1.507, "val_tokens": 16_384},
        compressors={"gzip -9": 1.629, "bzip2 -9": 1.412, "xz -9e": 1.355},
        times={"setup_s": 12.3, "train_s": 438.0, "total_s": 453.0})
    assert report["machine"] and report["date"]
    assert [(w["first"], w["last"], round(w["mean"], 3)) for w in report["load_cv"]] == \
        [(21, 60, 0.35), (61, 120, 0.2), (301, 400, 0.11)]
    assert (report["threads"], report["threads_used"]) == ("auto", [2])
    report.update(machine="Test CPU, 2 cores", date="2026-01-02", python="3.11.7")
    text = T.demo_table(json.loads(json.dumps(report)))
    assert text.splitlines()[0] == (
        "Measured 2026-01-02 on Test CPU, 2 cores (`docs/data/demo.json`). Python 3.11.7's stdlib: 1,740 training "
        "files / 30.8 MB, 46 validation files / 724 KB; `tiny` cut to 2 layers of width 256 (1 KDA + 1 MLA), 4.2M "
        "parameters, "
        "400 steps of 16×256 tokens, `--threads auto` (2 threads used):")
    assert "| validation, whole split (220,114 tokens, 724,034 bytes) | **1.521 bits per byte** (3.469 nats/token) |" in text
    assert "| gzip -9 on the same text | 1.629 bits per byte |" in text
    assert "| xz -9e on the same text | 1.355 bits per byte |" in text
    assert ("| training time / throughput | 7.3 min at 5,172 training tokens/s; setup (corpus, tokenizer, token cache, "
            "model) 12 s; 7:33 for the whole `k3 demo` with the whole-split evaluation and samples |") in text
    assert ("| expert load | load CV (mean over steps) 0.35 over steps 21–60, 0.20 over steps 61–120, "
            "0.11 over steps 301–400 under Quantile Balancing |") in text
    assert "first 16,384 validation tokens each time (1.507 bits/byte at the end)" in text


@pytest.mark.parametrize("missing", ["machine", "date"])
def test_a_row_without_machine_or_date_is_refused(tmp_path, missing):
    rows = [dict(r) for r in MICRO_ROWS]
    rows[3][missing] = None
    with pytest.raises(T.Unstamped, match=rf"micro: row 4 \(kda chunk_fwd_bwd\) has no {missing}"):
        T.micro_table(rows)
    with pytest.raises(T.Unstamped, match=f"has no {missing}"):
        T.ablations_table([{k: v for k, v in r.items() if k != missing} for r in ABLATION_ROWS])
    # saving refuses it too: a results file whose last run lacks the stamp, a report without it
    res = tmp_path / "kda.jsonl"
    res.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(T.Unstamped, match=f"has no {missing}"):
        T.save_micro([res], tmp_path / "micro.jsonl")
    assert not (tmp_path / "micro.jsonl").exists()
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"machine": "m", "date": "d", "validation": {}} | {missing: ""}))
    with pytest.raises(T.Unstamped, match=f"has no {missing}"):
        T.save_report(report, tmp_path / "demo.json")
    assert not (tmp_path / "demo.json").exists()


def test_save_micro_keeps_the_last_run_of_each_file(tmp_path):
    old = [{**r, "run": "r0", "value": r["value"] * 2} for r in MICRO_ROWS if r["bench"] == "moe"]
    new = [r for r in MICRO_ROWS if r["bench"] == "moe"]
    f = tmp_path / "moe.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in old + new))
    assert T.save_micro([f], tmp_path / "micro.jsonl") == new
    assert _rows(tmp_path / "micro.jsonl") == new
    f.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "run"}) + "\n" for r in new))
    with pytest.raises(T.Unstamped, match="no run id"):
        T.save_micro([f], tmp_path / "micro.jsonl")
