"""``k3 sft`` end to end: starts from the checkpoint, learns the conversations, resumes bit-exactly,
QAT exports exactly, refuses bad input in one line."""

import json
import signal

import pytest
import torch

from k3.checkpoint import from_pretrained
from k3.checkpoint.quantize import quantize
from k3.data.chat import ChatFormat
from k3.infer.run_model import load_run_model
from k3.cli.train import sft_main
from k3.rl.sft import SFTRows
from k3.train.loop import Trainer
from k3.train.metrics import read_metrics

TEXT = ("You are K3. What is 12 + 30? 2 + 0 = 2, 1 + 3 = 4, so the answer is 42. "
        "Count the lines: grep -c ERROR data.txt prints 3. def f(x): return x + 1\n")


def rows(n=24):
    out = []
    for i in range(n):
        a, b = 10 + i, 30 + 2 * i
        out.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                 {"role": "assistant", "reasoning_content": f"{a} + {b} = {a + b}",
                                  "content": f"The answer is {a + b}."}],
                    "reasoning_effort": ["low", "high", "max"][i % 3]})
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory, make_nano_checkpoint):
    d = tmp_path_factory.mktemp("sft")
    ckpt, _, tok = make_nano_checkpoint(d / "nano", TEXT)
    data = d / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return d, ckpt, data, tok


def argv(ckpt, data, out, *extra, steps=6):
    return ["--from", str(ckpt), "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--batch-size", "2", "--seq-len", "96", "--threads", "1", "--no-plot", "--eval-interval", "0",
            "--lr", "3e-3", "--val-percent", "25", *extra]


def losses(run):
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def test_sft_starts_from_the_checkpoint_and_learns(base):
    d, ckpt, data, tok = base
    assert sft_main(argv(ckpt, data, d / "run", steps=12)) == 0
    ls = losses(d / "run")
    assert len(ls) == 12 and sum(ls[-3:]) / 3 < sum(ls[:3]) / 3
    info = json.loads((d / "run" / "run.json").read_text())
    assert info["corpus"]["train_conversations"] + info["corpus"]["val_conversations"] == 24
    assert [r for r in read_metrics(d / "run") if r["kind"] == "val"]  # the final evaluation ran
    # the run's first loss is the loss of the checkpoint's own weights on its first batch
    t = Trainer(Trainer_config(ckpt, data, d / "probe"))
    x, y, docs = t.data.next_batch()
    ref = from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(x, doc_ids=docs).logits, -1)
    keep = y != -100
    want = -lp[keep].gather(-1, y[keep][:, None]).mean().item()
    assert abs(want - ls[0]) < 1e-4
    t.close()


def Trainer_config(ckpt, data, out, **kw):
    from k3.train.config import TrainConfig
    return TrainConfig.build(None, {"init_from": str(ckpt), "sft_data": str(data), "out": str(out),
                                    "steps": 6, "batch_size": 2, "curriculum": [[0, 96]], "threads": 1,
                                    "plot": False, "eval_interval": 0, "val_percent": 25, **kw})


def test_sft_resume_is_bit_exact(base):
    d, ckpt, data, _ = base
    full = Trainer(Trainer_config(ckpt, data, d / "full", ckpt_interval=0))
    assert full.train().status == "done"
    part = Trainer(Trainer_config(ckpt, data, d / "part", ckpt_interval=0))
    part.on_step_end.append(lambda t, rec: setattr(t, "stop_signal", signal.SIGTERM) if t.step == 3 else None)
    assert part.train().status == "interrupted"
    assert len(losses(d / "part")) == 3
    # resuming needs only the run's own checkpoint: the one it started from may be gone
    import shutil
    moved = ckpt.with_name("nano-moved")
    shutil.move(ckpt, moved)
    try:
        assert sft_main(["--resume", str(d / "part"), "--threads", "1"]) == 0
    finally:
        shutil.move(moved, ckpt)
    assert losses(d / "part") == losses(d / "full")
    # positive control of the comparison: a different seed gives other losses
    other = Trainer(Trainer_config(ckpt, data, d / "other", seed=1))
    other.train()
    assert losses(d / "other") != losses(d / "full")


def test_sft_qat_exports_to_mxfp4_with_the_same_logits(base):
    d, ckpt, data, _ = base
    assert sft_main(argv(ckpt, data, d / "qat", "--qat", steps=3)) == 0
    model, tok = load_run_model(d / "qat")           # served as trained: fake-quantized experts
    quantize(d / "qat", d / "qat-mx", dtype=None)
    packed = from_pretrained(d / "qat-mx", dtype=torch.float32).eval()
    ids = torch.tensor([ChatFormat(tok).render([{"role": "user", "content": "What is 12 + 30?"}])])
    with torch.no_grad():
        a, b = model(ids).logits, packed(ids).logits
    assert torch.equal(a, b)
    # the engine (what LocalEngine and k3 generate use) loads the run the same way
    from k3.infer.engine import Engine
    with Engine(d / "qat") as eng, torch.no_grad():
        assert torch.equal(eng.model(ids).logits, a)
    # control: the same weights without fake quantization give other logits
    plain = from_pretrained(d / "qat" / "checkpoint" / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.equal(plain(ids).logits, a)


def test_bad_rows_stop_the_run_in_one_line_unless_skipped(base, capsys):
    d, ckpt, data, _ = base
    bad = d / "bad.jsonl"
    bad.write_text(data.read_text() + '{"messages": [{"role": "assistant", "content": 5}]}\n')
    assert sft_main(argv(ckpt, bad, d / "bad-run", steps=1)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{bad}:25" in err and "content" in err
    assert sft_main(argv(ckpt, bad, d / "skip-run", "--skip-bad", steps=1)) == 0
    out = capsys.readouterr().out
    assert "1 bad rows" in out and f"{bad}:25" in out


@pytest.mark.parametrize("args, match", [
    (["--data", "x.jsonl"], "--from"),
    (["--from", "/nonexistent", "--data", "x.jsonl"], "init_from /nonexistent"),
    (["--from", "{ckpt}", "--data", "/nonexistent.jsonl"], "no such file"),
    (["--from", "{ckpt}", "--data", "{data}", "--curriculum", "0:64"], "unrecognized arguments"),
    (["--from", "{ckpt}", "--data", "{data}", "--preset", "tiny"], "unrecognized arguments"),
])
def test_cli_errors_are_one_line(base, capsys, args, match):
    d, ckpt, data, _ = base
    args = [a.format(ckpt=ckpt, data=data) for a in args]
    code = sft_main(args + ["--out", str(d / "err"), "--steps", "1"]) if "unrecognized" not in match else None
    if code is None:
        with pytest.raises(SystemExit) as e:
            sft_main(args + ["--out", str(d / "err")])
        code = e.value.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert match in err[-1]


def test_trajectories_train_only_when_passed(tmp_path, sandboxes):
    """Trajectories of real episodes (a family task, its scripted solution and its off-by-one hack,
    through the harness and the clean-room verifier): the passing one becomes the conversation its
    model saw; the failing one is left out and reported (positive control: --include-failed keeps it)."""
    from k3.agent.providers import Scripted
    from k3.rl.rollout import run_episode
    from k3.rl.trajectory import TrajectoryWriter, read_trajectory, to_chat
    from k3.tasks.families import get_family
    from k3.tasks.format import load_transcript

    fam = get_family("arith")
    task = fam.generate(7, tmp_path / "tasks")
    trajs = tmp_path / "trajs"
    for name, turns in (("pass", fam.solve(task, "high")),
                        ("fail", load_transcript(task / "hacks" / "off-by-one.json").turns)):
        w = TrajectoryWriter(trajs / f"{name}.jsonl")
        s = run_episode(task, Scripted(turns), w, effort="high", sandboxes=sandboxes)
        w.close()
        assert s["score"] == (1.0 if name == "pass" else 0.0)
    reader = SFTRows()
    got = list(reader(trajs))
    assert reader.failed == [str(trajs / "fail.jsonl")]
    assert got == [(str(trajs / "pass.jsonl"), to_chat(read_trajectory(trajs / "pass.jsonl")))]
    assert got[0][1]["messages"][-1]["content"] == str(read_json(task / "family.json")["spec"]["answer"])
    assert [w for w, _ in SFTRows()(trajs, include_failed=True)] == [str(trajs / "fail.jsonl"),
                                                                    str(trajs / "pass.jsonl")]


def read_json(path):
    return json.loads(path.read_text())


def test_every_trained_token_weighs_the_same_across_micro_batches(base):
    """grad_accum 2 × batch 1 trains as batch 2: the loss is Σ CE over the step's labels ÷ their
    count, not a mean of per-row means (rows of packed conversations carry different counts)."""
    d, ckpt, data, _ = base
    one = Trainer(Trainer_config(ckpt, data, d / "b2", steps=4, ns_dtype="fp32"))
    x, y, _ = one.data.next_batch()
    counts = (y != -100).sum(1).tolist()
    assert counts[0] != counts[1]  # a mean of row means would weigh these rows' tokens differently
    one.data.load_state_dict({**one.data.state_dict(), "epoch": 0, "row": 0, "batches": 0})
    one.train()
    two = Trainer(Trainer_config(ckpt, data, d / "b1x2", steps=4, batch_size=1, grad_accum=2, ns_dtype="fp32"))
    two.train()
    a, b = losses(d / "b2"), losses(d / "b1x2")
    assert max(abs(p - q) / abs(p) for p, q in zip(a, b)) < 1e-5, (a, b)


@pytest.mark.slow
def test_sft_on_two_processes_equals_one(base):
    import subprocess
    import sys
    d, ckpt, data, _ = base
    same = ("--ckpt-interval", "0", "--ns-dtype", "fp32", "--balance", "sign")  # as tests/train/test_distributed.py
    assert sft_main(argv(ckpt, data, d / "one", *same, steps=4)) == 0
    r = subprocess.run([sys.executable, "-m", "k3", "sft", "--nproc", "2", "--dp", "2",
                        *argv(ckpt, data, d / "two", *same, steps=4)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(d / "one"), losses(d / "two")
    assert len(b) == 4 and max(abs(p - q) / abs(p) for p, q in zip(a, b)) < 1e-4, (a, b)
    # a distributed resume needs only the run's own checkpoint too
    import shutil
    moved = ckpt.with_name("nano-moved-dist")
    shutil.move(ckpt, moved)
    try:
        r = subprocess.run([sys.executable, "-m", "k3", "sft", "--nproc", "2", "--resume", str(d / "two"),
                            "--threads", "1"], capture_output=True, text=True, timeout=300)
    finally:
        shutil.move(moved, ckpt)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(d / "two") == b
