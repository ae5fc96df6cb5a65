"""``k3 eval``: statistics against exact enumeration, rows that must carry their conditions, the
comparison that refuses differing conditions (with the positive control that equal conditions
compare), the bpb suite against an independent count, the agent and harness suites end to end
through real sandboxes, and the report page in headless Chromium."""

from __future__ import annotations

import copy
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k3.cli import main as k3_main
from k3.errors import ConfigError, K3Error
from k3.rl.eval_rows import CONDITIONS, EvalRun, check_row, read_rows
from k3.rl.eval_stats import bootstrap_ci, pass_at_k
from k3.rl.eval_tables import compare, harness_spread, summarize

TEXT = "def f(x):\n    return x + 1\nWhat is 12 + 30? Count the lines of names.txt.\n"


# ------------------------------------------------------------------------------------ statistics
@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 5, 2), (7, 3, 7), (8, 1, 4)])
def test_pass_at_k_equals_enumeration_of_subsets(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    exact = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_refuses_too_few_samples():
    with pytest.raises(ValueError, match="at least 3 samples"):
        pass_at_k(2, 1, 3)
    assert pass_at_k(3, 1, 3) == 1.0  # positive control: k = n is defined


def test_bootstrap_interval_covers_the_true_mean_at_its_level():
    """Over 300 independent evaluations of 60 tasks with pass probability 0.3, the 95% interval
    holds 0.3 in about 95% of them (binomial spread of 300 trials: 0.88..0.99 at > 4 sigma)."""
    rng = np.random.default_rng(1)
    hits = 0
    for t in range(300):
        groups = [[float(x)] for x in rng.random(60) < 0.3]
        lo, hi = bootstrap_ci(groups, 0.95, resamples=1000, seed=t)
        hits += lo <= 0.3 <= hi
    assert 0.88 <= hits / 300 <= 0.99, hits


def test_bootstrap_resamples_tasks_not_samples():
    """Two tasks, one always passed and one never, sampled 50 times each: the item-level interval
    is wide (0 .. 1); treating the 100 samples as independent would give a narrow one."""
    lo, hi = bootstrap_ci([[1.0] * 50, [0.0] * 50])
    assert lo == 0.0 and hi == 1.0
    lo, hi = bootstrap_ci([[x] for x in [1.0] * 50 + [0.0] * 50])  # control: 100 independent tasks
    assert 0.35 < lo < 0.5 < hi < 0.65


# ------------------------------------------------------------------------------------------ rows
def _row(model="a", effort="max", item="t1", value=1.0, sample=0, harness=None, **setup):
    return {"suite": "agent", "item": item, "sample": sample, "metric": "score", "value": value,
            "labels": {"family": "f", "effort": effort, "harness": harness},
            "conditions": {"model": {"kind": "checkpoint", "name": model, "fingerprint": model * 4},
                           "harness": {"seed": harness}, "tools": {"names": ["shell"]}, "prompt": {"template": 0},
                           "budget": {"steps": 4}, "effort": effort, "temperature": 1.0,
                           "seeds": {"sampling": sample, "harness": harness}, "setup": {"max_tokens": 8, **setup}},
            "k3_version": "0", "machine": "m", "date": "d", "wall_s": 0.1, "tokens": 3}


@pytest.mark.parametrize("key", CONDITIONS)
def test_a_row_without_a_condition_is_refused(key):
    check_row(_row())  # positive control: the full row passes
    r = _row()
    del r["conditions"][key]
    with pytest.raises(K3Error, match=f"conditions lack {key}"):
        check_row(r, "x.jsonl:3")


def test_a_row_without_conditions_is_refused_naming_file_and_line(tmp_path):
    p = tmp_path / "rows.jsonl"
    bad = _row()
    del bad["conditions"]
    p.write_text(json.dumps(_row()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(K3Error, match=r"rows.jsonl:2: the row has no conditions"):
        read_rows(tmp_path)
    p.write_text(json.dumps(_row()) + "\n")
    assert len(read_rows(tmp_path)) == 1


# ----------------------------------------------------------------------------------- comparison
def _run(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return EvalRun.load(d)


def test_compare_side_by_side_when_only_the_model_differs(tmp_path):
    a = _run(tmp_path, "A", [_row("a", item=f"t{i}", value=float(i % 2)) for i in range(4)])
    b = _run(tmp_path, "B", [_row("b", item=f"t{i}", value=1.0) for i in range(4)])
    res = compare([a, b])
    assert res["ignored"] == [] and [m["name"] for m in res["models"]] == ["a", "b"]
    (entry,) = res["table"]
    assert [r["mean"] for r in entry["runs"]] == [0.5, 1.0]


def test_compare_refuses_differing_conditions_unless_named(tmp_path):
    a = _run(tmp_path, "A", [_row("a", effort="max", item=f"t{i}") for i in range(3)])
    b = _run(tmp_path, "B", [_row("b", effort="low", item=f"t{i}") for i in range(3)])
    with pytest.raises(ConfigError, match=r"differ in effort \(values A: \"max\", B: \"low\"\).*--ignore effort"):
        compare([a, b])
    res = compare([a, b], {"effort"})
    assert res["ignored"] == ["effort"] and res["differences"]["effort"] == ["max", "low"]
    from k3.rl.eval_tables import format_compare
    assert 'ignored difference: effort (A: "max", B: "low")' in format_compare(res)


def test_compare_names_setup_fields_and_item_sets(tmp_path):
    a = _run(tmp_path, "A", [_row("a", item="t1", max_tokens=8), _row("a", item="t2")])
    b = _run(tmp_path, "B", [_row("b", item="t1", max_tokens=16)])
    with pytest.raises(ConfigError, match=r"differ in items \(rows per run A: 2, B: 1\)"):
        compare([a, b])
    with pytest.raises(ConfigError, match=r"differ in setup.max_tokens"):
        compare([a, b], {"items"})
    assert compare([a, b], {"items", "setup.max_tokens"})["table"][0]["runs"][1]["items"] == 1


def test_summary_and_harness_spread_by_hand():
    rows = [_row(item="t1", value=1.0, sample=0), _row(item="t1", value=0.0, sample=1),
            _row(item="t2", value=0.0, sample=0), _row(item="t2", value=0.0, sample=1)]
    (s,) = summarize(rows)
    assert s["mean"] == 0.25 and s["items"] == 2 and s["samples"] == 4
    assert s["pass@1"] == 0.25 and s["k"] == 2 and s["pass@2"] == 0.5  # t1 passes in 1 of 2 draws; t2 never
    rows = [_row(item="t1", value=1.0, harness=0), _row(item="t2", value=1.0, harness=0),
            _row(item="t1", value=0.0, harness=1), _row(item="t2", value=1.0, harness=1)]
    (h,) = harness_spread(rows)
    assert h["by_harness"] == {0: 1.0, 1: 0.5} and h["mean"] == 0.75 and h["spread"] == pytest.approx(0.25)
    # an episode that failed before scoring (value null) is counted missing, never a 0
    (s,) = summarize([_row(item="t1", value=1.0), _row(item="t2", value=None)])
    assert s["mean"] == 1.0 and s["items"] == 1 and s["missing"] == 1
    (s,) = summarize([_row(item="t1", value=None)])
    assert s["items"] == 0 and s["missing"] == 1 and math.isnan(s["mean"])


# ------------------------------------------------------------------------------------------ bpb
@pytest.fixture(scope="module")
def nano(tmp_path_factory, make_nano_checkpoint):
    d = tmp_path_factory.mktemp("eval")
    ckpt, model, tok = make_nano_checkpoint(d / "nano", TEXT)
    data = d / "data"
    data.mkdir()
    for i in range(12):
        (data / f"doc{i}.txt").write_text(TEXT * (i + 2))
    return d, ckpt, model, tok, data


def test_bpb_suite_equals_an_independent_count(nano, tmp_path):
    """Bits per byte from the CLI equal a count made here: the validation documents' text, encoded,
    scored by full forwards window by window with log_softmax, over the UTF-8 bytes of the scored
    tokens' text (every token of this ASCII text decodes to its own bytes)."""
    from k3.data.corpus import load_corpus
    from k3.data.tokenizer import EOS_TOKEN

    d, ckpt, model, tok, data = nano
    assert k3_main(["eval", "bpb", "--model", str(ckpt), "--data", str(data), "--val-percent", "30",
                    "--seq-len", "64", "--out", str(tmp_path / "r")]) == 0
    rows = {r["metric"]: r for r in read_rows(tmp_path / "r")}
    ids = []
    for doc in load_corpus(data, 30).documents("validation"):
        ids += tok.encode(doc) + [tok.token_to_id(EOS_TOKEN)]
    nats, nbytes = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 64):
            x = torch.tensor([ids[s:s + 64]])
            y = ids[s + 1:s + 65]
            logp = torch.log_softmax(model(x).logits[0, :len(y)].double(), -1)
            nats -= sum(logp[i, t].item() for i, t in enumerate(y))
            nbytes += sum(len(tok.decode([t]).encode()) for t in y if t != tok.token_to_id(EOS_TOKEN))
    assert rows["bits_per_byte"]["value"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-5)
    assert rows["bits_per_byte"]["conditions"]["setup"]["seq_len"] == 64
    assert rows["bits_per_byte"]["tokens"] == len(ids) - 1


def test_eval_cli_errors_are_one_line(nano, tmp_path, capsys):
    d, ckpt, _, _, data = nano
    out = tmp_path / "r"
    assert k3_main(["eval", "bpb", "--model", str(ckpt), "--data", str(data), "--seq-len", "32",
                    "--max-batches", "1", "--out", str(out)]) == 0
    before = (out / "rows.jsonl").read_text()
    capsys.readouterr()
    cases = [
        (["eval", "bpb", "--model", str(ckpt), "--data", str(data), "--out", str(out)], "already holds evaluation rows"),
        (["eval", "bpb", "--data", str(data)], "--model CKPT is required"),
        (["eval", "agent", "--model", str(ckpt), "--base-url", "http://127.0.0.1:9"], "exactly one of --model"),
        (["eval", "agent", "--model", str(ckpt), "--tasks", "arith:0:2", "--out", str(tmp_path / "a")],
         "held-out seeds"),
        (["eval", "agent", "--model", str(ckpt), "--effort", "huge", "--out", str(tmp_path / "b")], "--effort"),
        (["eval", "retrieve", "--model", str(ckpt), "--depths", "0,2", "--out", str(tmp_path / "c")], "--depths"),
        (["eval", "compare", str(out)], "at least two runs"),
        (["eval", "report", str(tmp_path / "nothing")], "no evaluation rows here"),
    ]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            sys.exit(k3_main(argv))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and msg in err and len(err.splitlines()) == 1, (argv, err)
    assert (out / "rows.jsonl").read_text() == before  # the refused run left the earlier rows alone
    assert k3_main(["eval", "bpb", "--model", str(ckpt), "--data", str(data), "--seq-len", "32",
                    "--max-batches", "1", "--out", str(out), "--overwrite"]) == 0
    assert (out / "rows.jsonl").read_text().count("\n") == before.count("\n")


# ------------------------------------------------------------------------------ agent, harness
@pytest.mark.slow
def test_agent_and_harness_suites_end_to_end(nano, tmp_path, env_root):
    """A starter task with hacks and two held-out family tasks through the nano model: rows carry
    the conditions the trajectories recorded; the hack column is 0 while the reference solutions
    score 1 through the same path; the harness suite's seeds are recorded and give a spread."""
    d, ckpt, *_ = nano
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "agent"
    assert k3_main(["eval", "agent", "--model", str(ckpt), "--tasks", str(repo / "tasks" / "fix-calc"),
                    "--tasks", "arith:1000000:1000002", "--effort", "low,max", "--max-tokens", "12",
                    "--samples", "2", "--out", str(out)]) == 0
    rows = read_rows(out)
    scores = [r for r in rows if r["metric"] == "score"]
    assert len(scores) == 3 * 2 * 2  # tasks × efforts × samples
    for r in scores:
        c = r["conditions"]
        traj = out / "trajectories" / f"{r['item']}.{r['labels']['effort']}.hc.s{r['sample']}.jsonl"
        head = json.loads(traj.read_text().splitlines()[0])["conditions"]
        assert c["effort"] == head["effort"] == r["labels"]["effort"] and c["temperature"] == 1.0
        assert c["seeds"] == {"sampling": r["sample"], "harness": None} and c["budget"] == head["budget"]
        assert c["tools"]["names"] == sorted(t["function"]["name"] for t in head["tools"])
        assert c["model"]["fingerprint"] == rows[0]["conditions"]["model"]["fingerprint"]
    hacks = [r for r in rows if r["metric"] == "hack_score"]
    sols = [r for r in rows if r["metric"] == "solution_score"]
    assert len(hacks) >= 2 and all(r["value"] == 0.0 for r in hacks)
    assert len(sols) == 3 and all(r["value"] == 1.0 for r in sols)

    hout = tmp_path / "harness"
    assert k3_main(["eval", "harness", "--model", str(ckpt), "--tasks", "arith:1000000:1000002",
                    "--effort", "low", "--temperature", "0", "--max-tokens", "12", "--harness-seeds", "3,4",
                    "--no-hacks", "--out", str(hout)]) == 0
    hrows = read_rows(hout)
    assert sorted({r["conditions"]["harness"]["seed"] for r in hrows}) == [3, 4]
    (spread,) = harness_spread(hrows)
    assert set(spread["by_harness"]) == {3, 4}
    # the two runs differ in temperature, effort, harness and samples: compare refuses, then names them
    with pytest.raises(ConfigError, match="differ in"):
        compare([EvalRun.load(out), EvalRun.load(hout)])
    _report_in_chromium([EvalRun.load(out), EvalRun.load(hout)], tmp_path)


def _report_in_chromium(runs, tmp_path):
    from k3.rl.eval_report import write_report

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from browser import START_S, Browser, chromium

    page = write_report(runs, tmp_path / "report" / "index.html")
    text = page.read_text()
    assert "http://" not in text and "https://" not in text  # self-contained: nothing to fetch
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    assert pngs == ["index-score_by_condition.png", "index-score_by_effort.png", "index-score_by_harness.png"]
    browser = Browser(chromium(), tmp_path / "profile")
    try:
        browser.call("Page.navigate", url=page.as_uri())
        browser.wait_for('document.readyState === "complete"', START_S)
        seen = browser.eval("""(() => ({
            images: [...document.images].map(i => [i.id, i.complete && i.naturalWidth > 0]),
            tables: document.querySelectorAll("table.summary").length,
            spread: document.querySelectorAll("table.spread").length,
            runs: [...document.querySelectorAll("h2")].map(h => h.textContent)}))()""")
    finally:
        browser.close()
    assert seen["images"] == [["fig-score_by_condition", True], ["fig-score_by_effort", True],
                              ["fig-score_by_harness", True]]
    assert seen["tables"] == 2 and seen["spread"] == 1 and seen["runs"][:2] == ["agent", "harness"]


def test_report_refuses_nothing_and_draws_long_context(tmp_path):
    """Accept and retrieve rows give their figures (the agent figures are absent: no agent rows)."""
    from k3.rl.eval_report import write_report

    def lrow(suite, metric, value, labels):
        r = copy.deepcopy(_row())
        r.update(suite=suite, metric=metric, value=value, labels=labels, item=json.dumps(labels))
        return r
    rows = [lrow("accept", m, v * t, {"T": t}) for t in (64, 128) for m, v in
            (("prefill_s_per_token", 1e-4), ("decode_s_per_token", 1e-3), ("cache_bytes", 10),
             ("peak_rss_bytes", 1e3))]
    rows += [lrow("retrieve", "correct", float(t == 64), {"kind": "needle", "T": t, "depth": 0.5}) for t in (64, 128)]
    run = _run(tmp_path, "L", rows)
    page = write_report([run], tmp_path / "p.html")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["p-accept.png", "p-retrieve.png"]
    assert page.read_text().count("data:image/png;base64,") == 2


def test_compare_pairs_rows_of_one_task_under_several_efforts(tmp_path):
    """One task at two efforts in each run: paired in order, so efforts (low, max) against (high,
    max) is a named difference, and equal effort lists compare (positive control)."""
    a = _run(tmp_path, "A", [_row("a", effort=e) for e in ("low", "max")])
    b = _run(tmp_path, "B", [_row("b", effort=e) for e in ("high", "max")])
    c = _run(tmp_path, "C", [_row("c", effort=e, value=0.0) for e in ("low", "max")])
    with pytest.raises(ConfigError, match=r'differ in effort \(values A: "low", B: "high"\)'):
        compare([a, b])
    res = compare([a, c])
    assert [[r["mean"] for r in e["runs"]] for e in res["table"]] == [[1.0, 0.0], [1.0, 0.0]]


def test_accept_and_retrieve_suites_write_rows_with_their_conditions(nano, tmp_path):
    """accept: T=64 and 256 run, T=4096 (over the nano's 2,048 positions) is a row with ok 0 and its
    error, and the cache grows by exactly the MLA latent tokens added: (256 - 64) × (kv_lora_rank +
    qk_rope_head_dim) × 4 bytes per MLA layer (the KDA state does not grow). retrieve: one row per
    kind × length × depth × seed, its output kept, graded as the item's exact answer."""
    from k3.rl.longctx import score_answer

    d, ckpt, model, *_ = nano
    assert k3_main(["eval", "accept", "--model", str(ckpt), "--lengths", "64,4096,256", "--decode-tokens", "2",
                    "--out", str(tmp_path / "acc")]) == 0
    rows = read_rows(tmp_path / "acc")
    by = {(r["labels"]["T"], r["metric"]): r for r in rows}
    assert [by[(t, "ok")]["value"] for t in (64, 4096, 256)] == [1.0, 0.0, 1.0]
    assert "max_position_embeddings" in by[(4096, "ok")]["detail"]["error"]
    assert by[(4096, "cache_bytes")]["value"] is None and by[(64, "prefill_s_per_token")]["value"] > 0
    cfg = model.config
    mla_layers = len(cfg.linear_attn_config.full_attn_layers)
    grow = (256 - 64) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 * mla_layers
    assert by[(256, "cache_bytes")]["value"] - by[(64, "cache_bytes")]["value"] == grow
    assert {r["conditions"]["setup"]["decode_tokens"] for r in rows} == {2}

    assert k3_main(["eval", "retrieve", "--model", str(ckpt), "--lengths", "512", "--depths", "0,1",
                    "--n-keys", "3", "--seeds", "2", "--out", str(tmp_path / "ret")]) == 0
    rows = read_rows(tmp_path / "ret")
    assert len(rows) == 2 * 1 * 2 * 2
    for r in rows:
        assert r["value"] == float(score_answer(r["detail"]["output"], r["detail"]["answer"]))
        assert r["conditions"]["setup"]["length"] == 512 and r["conditions"]["temperature"] == 0.0
        assert r["tokens"] <= 512
    assert k3_main(["eval", "report", str(tmp_path / "acc"), str(tmp_path / "ret")]) == 0
    assert (tmp_path / "acc" / "report-accept.png").is_file() and (tmp_path / "acc" / "report-retrieve.png").is_file()


# ------------------------------------------------------------------------------------- sustain
def test_progress_curve_by_hand():
    """Writes in order: step 1 wrong, step 2 right, an unrelated file, step 1 corrected, a failed
    write of step 3: progress 0, 1/3, 1/3, 2/3, 2/3 after each call; the context is the turn's."""
    from k3.rl.eval_suites import progress_curve

    def tool(path, content, error=False):
        return {"type": "tool", "name": "write", "arguments": {"path": path, "content": content},
                "result": {"error": error}}
    recs = [{"type": "turn", "metadata": {"sent_tokens": 10}}, tool("results/step_001.txt", "5\n"),
            tool("results/step_002.txt", "9"), {"type": "turn", "metadata": {"sent_tokens": 30}},
            tool("notes.txt", "7"), tool("/workspace/results/step_001.txt", " 4 "),
            tool("results/step_003.txt", "12", error=True)]
    assert progress_curve(recs, [4, 9, 12]) == [[1, 10, 0.0], [2, 10, 1 / 3], [3, 30, 1 / 3], [4, 30, 2 / 3],
                                                [5, 30, 2 / 3]]


def test_chain_workload_hacks_score_zero_and_its_solution_one(tmp_path, sandboxes):
    from k3.rl.grpo import replay_hacks
    from k3.tasks.families.chain import Chain, chain_values
    from k3.tasks.format import load_task

    fam = Chain(5)
    task = load_task(fam.generate(3, tmp_path), transcripts=True)
    spec = json.loads((task.root / "family.json").read_text())["spec"]
    assert chain_values(spec) == list(itertools.accumulate([spec["start"], *spec["adds"]]))[1:]
    assert "shell" not in task.allowed_tools and "edit" not in task.allowed_tools  # every change is a write
    hacks = replay_hacks([task], sandboxes)
    assert sorted(Path(h[1]).stem for h in hacks) == ["start-everywhere", "zeros"]
    assert all(score == 0.0 for _, _, score, _ in hacks)
    assert [s for _, _, s, _ in replay_hacks([task], sandboxes, solutions=True)] == [1.0]


@pytest.mark.slow
def test_sustain_suite_reference_and_model(nano, tmp_path, env_root):
    """The reference solution (a read and a write per step): progress at each tenth of the 2·N
    calls is the steps written by then (N=8: after 8 of 16 calls, 4 steps = 0.5) and reaches 1,
    with compaction on and off; compaction only ever shortens what is sent and keeps it under the
    limit, or flags the turn when even the goal and the last turns do not fit. A model run records
    its fingerprint and a curve of its own."""
    out = tmp_path / "ref"
    assert k3_main(["eval", "sustain", "--reference", "--steps", "8", "--context-tokens", "600",
                    "--out", str(out)]) == 0
    rows = read_rows(out)
    for mode in ("on", "off"):
        score = [r for r in rows if r["metric"] == "score" and r["labels"]["compaction"] == mode]
        assert [r["value"] for r in score] == [1.0]
        prog = {r["labels"]["share"]: r["value"] for r in rows
                if r["metric"] == "progress" and r["labels"]["compaction"] == mode}
        assert prog == {t / 10: (-(-16 * t // 10) // 2) / 8 for t in range(1, 11)}
        assert score[0]["conditions"]["setup"]["context_tokens"] == (600 if mode == "on" else 10 ** 9)
        assert len(score[0]["detail"]["curve"]) == 17  # 16 calls + submit
    sent = {m: [r["value"] for r in rows if r["metric"] == "sent_tokens" and r["labels"]["compaction"] == m]
            for m in ("on", "off")}
    assert all(a <= b for a, b in zip(sent["on"], sent["off"])) and sent["on"][-1] < sent["off"][-1]
    assert sent["on"][0] == sent["off"][0]  # below the limit nothing is compacted
    curves = {r["labels"]["compaction"]: r["detail"] for r in rows if r["metric"] == "score"}
    assert max(c[1] for c in curves["on"]["curve"]) <= 600 < max(c[1] for c in curves["off"]["curve"])
    assert curves["on"]["over_context_turns"] == curves["off"]["over_context_turns"] == 0
    # a limit below the goal and the last two turns: every such turn is flagged, and still solved
    assert k3_main(["eval", "sustain", "--reference", "--steps", "3", "--context-tokens", "200",
                    "--out", str(tmp_path / "tight")]) == 0
    tight = {r["labels"]["compaction"]: r for r in read_rows(tmp_path / "tight") if r["metric"] == "score"}
    assert tight["on"]["value"] == 1.0 and tight["off"]["detail"]["over_context_turns"] == 0
    assert tight["on"]["detail"]["over_context_turns"] == sum(c[1] > 200 for c in tight["on"]["detail"]["curve"]) + 1  # + the closing turn, no call

    d, ckpt, *_ = nano
    assert k3_main(["eval", "sustain", "--model", str(ckpt), "--steps", "2", "--max-tokens", "8",
                    "--context-tokens", "300", "--out", str(tmp_path / "m")]) == 0
    mrows = read_rows(tmp_path / "m")
    score = [r for r in mrows if r["metric"] == "score"]
    assert len(score) == 2 and all(r["conditions"]["model"]["kind"] == "checkpoint" for r in score)
    assert all(r["detail"]["curve"] == [] or r["detail"]["curve"][-1][0] >= 1 for r in score)
    assert k3_main(["eval", "report", str(out), str(tmp_path / "m")]) == 0
    assert (out / "report-sustain.png").is_file()
