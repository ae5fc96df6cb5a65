"""``k3 distill`` end to end (SPEC §10): a student that answers "A" or "B" at random, distilled on
its own samples from a teacher that answers "A", comes to answer "A" (its pass rate on the letter
task rises) and its KL to the teacher falls; with the student as its own teacher (the control) the
KL and the loss are 0 and nothing is learned. Each row reaches only its own tag's teacher (checked
against the effort the prompt renders); a missing tag, a teacher with another vocabulary, bad
options: one line before the first step."""

import json
import threading

import pytest
import torch

from k3.cli.rl import distill_main
from k3.cli.train import sft_main
from k3.rl.distill import RemoteTeacher
from k3.train.metrics import read_metrics
from taskdirs import make_letter_task

pytestmark = pytest.mark.slow

TEXT = "Pick a letter. A or B. The answer is A. The answer is B.\n"


def _sft(ckpt, d, name, letters):
    rows = [{"messages": [{"role": "user", "content": "Pick a letter."},
                          {"role": "assistant", "reasoning_content": "", "content": letters[i % len(letters)]}]}
            for i in range(40)]
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sft_main(["--from", str(ckpt), "--data", str(d / f"{name}.jsonl"), "--out", str(d / name),
                     "--steps", "40", "--batch-size", "8", "--seq-len", "64", "--threads", "1", "--no-plot",
                     "--val-percent", "0", "--lr", "3e-3"]) == 0
    return d / name


@pytest.fixture(scope="module")
def models(tmp_path_factory, make_nano_checkpoint, env_root):
    """Student: answers "A" or "B", half each; teachers from the same base: always "A", always "B"."""
    d = tmp_path_factory.mktemp("distill")
    ckpt = make_nano_checkpoint(d / "nano", TEXT)[0]
    task = make_letter_task(d / "tasks", domain="general")
    return d, _sft(ckpt, d, "student", "AB"), _sft(ckpt, d, "teach-a", "A"), _sft(ckpt, d, "teach-b", "B"), task


def teachers_toml(path, **tags):
    path.write_text("".join(f'["{tag}"]\ncheckpoint = "{ckpt}"\n' for tag, ckpt in tags.items()))
    return path


def argv(student, teachers, task, out, *extra, steps=8, group=4, effort="low"):
    return ["--student", str(student), "--teachers", str(teachers), "--tasks", str(task), "--out", str(out),
            "--group", str(group), "--tasks-per-step", "1", "--effort", effort, "--steps", str(steps),
            "--max-tokens", "16", "--threads", "1", "--lr", "6e-4", "--no-plot", "--ckpt-interval", "0", *extra]


def records(run):
    return [r for r in read_metrics(run) if r["kind"] == "rl"]


@pytest.mark.parametrize("estimator,loss", [("exact", ()), ("sampled", ()), ("exact", ("--forward-weight", "1"))],
                         ids=["exact", "sampled", "forward"])
def test_the_student_learns_its_teachers_answer_and_the_self_teacher_control_does_not(models, tmp_path, estimator,
                                                                                    loss, sandboxes):
    """(``forward``: the forward KL alone, ``--forward-weight 1``; the logged KL is the reverse one. It
    is mass-covering: the student's entropy first rises on its off-teacher samples, and it takes
    10-14 steps where the reverse KL takes 10.)"""
    d, student, teach_a, _, task = models
    run = tmp_path / "a"
    # the sampled estimator's gradient is a noisy score-function one: smaller steps
    opt = {"exact": ("--lr", "6e-4"), "sampled": ("--lr", "1e-4", "--optimizer", "adamw")}[estimator] + loss
    assert distill_main(argv(student, teachers_toml(tmp_path / "t.toml", **{"general/low": teach_a}), task, run,
                             "--estimator", estimator, *opt, steps=14 if loss else 10)) == 0
    recs = records(run)
    passes = [r["pass_by_tag"]["general/low"] for r in recs]
    kls = [r["kl_by_tag"]["general/low"] for r in recs]
    print(estimator, "pass:", passes, "kl:", [round(k, 3) for k in kls])
    assert passes[0] < 0.9 and sum(passes[-3:]) / 3 >= 0.9, passes
    assert sum(kls[-3:]) / 3 < 0.5 * kls[0], kls
    assert all(r["sampler_max_abs_diff"] <= 1e-4 for r in recs)
    # control: the student as its own teacher: KL, loss and gradient 0 up to float rounding (the
    # learner's training forward and the teacher's eval forward round differently), against the
    # gradient the real teacher gave at step 1; nothing to learn
    ctl = tmp_path / "self"
    assert distill_main(argv(student, teachers_toml(tmp_path / "s.toml", **{"general/low": student}), task, ctl,
                             "--estimator", estimator, *loss, steps=1)) == 0
    c = records(ctl)[0]
    grad = next(r["grad_norm"] for r in read_metrics(ctl) if r["kind"] == "train")
    taught = next(r["grad_norm"] for r in read_metrics(run) if r["kind"] == "train")
    assert abs(c["kl_by_tag"]["general/low"]) < 1e-5 and abs(c["loss"]) < 1e-5, c
    assert grad < 1e-3 * taught, (grad, taught)
    assert c["trained_tokens"] > 0


def test_each_row_reaches_only_its_own_tags_teacher(models, tmp_path, monkeypatch, sandboxes):
    """Two tags, one task, efforts low and high cycled over two groups a step: every row a teacher
    scores renders its own tag's effort in the system turn, and both teachers score rows."""
    from k3.rl import distill

    d, student, teach_a, teach_b, task = models
    seen: dict[str, list[str]] = {"general/low": [], "general/high": []}
    box = {}

    class Recorder(torch.nn.Module):
        def __init__(self, tag, model):
            super().__init__()
            self.tag, self.model = tag, model

        def forward(self, x):
            for row in x.tolist():
                seen[self.tag].append(box["tok"].decode(row))
            return self.model(x)

    real = distill.DistillObjective._load_teacher

    def load(self, trainer, tag):
        box["tok"] = trainer.tokenizer
        return Recorder(tag, real(self, trainer, tag))

    monkeypatch.setattr(distill.DistillObjective, "_load_teacher", load)
    t = teachers_toml(tmp_path / "t.toml", **{"general/low": teach_a, "general/high": teach_b})
    a = argv(student, t, task, tmp_path / "run", steps=1, effort="low")
    a[a.index("--tasks-per-step") + 1] = "2"
    assert distill_main(a + ["--effort", "high"]) == 0
    assert seen["general/low"] and seen["general/high"]
    assert all("# Reasoning effort: low" in s and "# Reasoning effort: high" not in s for s in seen["general/low"])
    assert all("# Reasoning effort: high" in s and "# Reasoning effort: low" not in s for s in seen["general/high"])
    rec = records(tmp_path / "run")[0]
    assert set(rec["kl_by_tag"]) == {"general/low", "general/high"} and rec["episodes_by_tag"] == \
        {"general/low": 4, "general/high": 4}


def test_bad_input_is_one_line_before_the_first_step(models, tmp_path, capsys, make_nano_checkpoint):
    d, student, teach_a, _, task = models
    ok = teachers_toml(tmp_path / "ok.toml", **{"general/low": teach_a})

    def fails(a, message):
        assert distill_main(a) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err

    fails(argv(student, ok, task, tmp_path / "r1", effort="high"), "no teacher for tag 'general/high'")
    fails(argv(student, teachers_toml(tmp_path / "b.toml", **{"nope/low": teach_a}), task, tmp_path / "r2"),
          "'nope/low' is not DOMAIN/EFFORT")
    remote = tmp_path / "remote.toml"
    remote.write_text('["general/low"]\nurl = "http://127.0.0.1:1/v1"\nmodel = "k3"\n')
    fails(argv(student, remote, task, tmp_path / "r3"), "is remote: it gives the logprobs of given tokens only")
    for bad in ("0", "true", '"4"', "1000"):
        remote.write_text(f'["general/low"]\nurl = "http://127.0.0.1:1/v1"\nmodel = "k3"\nconcurrency = {bad}\n')
        fails(argv(student, remote, task, tmp_path / "r3c", "--estimator", "sampled"),
              "concurrency must be an int in 1..256")
    fails(argv(student, ok, task, tmp_path / "r4", "--estimator", "forward"), "--estimator must be one of")
    fails(argv(student, ok, task, tmp_path / "r5", "--estimator", "sampled", "--top-k", "4"), "--top-k applies")
    fails(argv(student, ok, task, tmp_path / "r6", "--beta", "0.1"), "--beta")
    for bad in ("1.5", "-0.1", "nan"):
        fails(argv(student, ok, task, tmp_path / "r6f", "--forward-weight", bad), "--forward-weight must be a number")
    fails(argv(student, ok, task, tmp_path / "r6s", "--estimator", "sampled", "--forward-weight", "0.5"),
          "--forward-weight needs the teacher's whole row")
    fails(argv(student, ok, task, tmp_path / "r7", "--reward-weight", "1", group=1), "--group must be an int >= 2")
    nodomain = make_letter_task(tmp_path / "tasks", "plain")
    fails(argv(student, ok, nodomain, tmp_path / "r8"), "has no domain")
    # a teacher with another vocabulary (a base trained on other text gets another tokenizer)
    other = make_nano_checkpoint(tmp_path / "other", "Zebra quartz jumps; vexing fog. " * 3)[0]
    fails(argv(student, teachers_toml(tmp_path / "o.toml", **{"general/low": other}), task, tmp_path / "r9"),
          "another tokenizer or vocabulary")
    # positive control: the same options with its teacher run (one step)
    assert distill_main(argv(student, ok, task, tmp_path / "fine", steps=1)) == 0
    capsys.readouterr()
    # a distillation run is not an RL run; it resumes as what it is
    from k3.cli.rl import rl_main
    assert rl_main(["--resume", str(tmp_path / "fine"), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not of an RL run" in err, err
    assert distill_main(["--resume", str(tmp_path / "fine"), "--steps", "2", "--threads", "1"]) == 0
    assert [r["step"] for r in records(tmp_path / "fine")] == [1, 2]


def test_a_remote_teacher_scores_as_the_same_checkpoint_in_process(models, tmp_path, capsys, make_nano_checkpoint,
                                                                   monkeypatch, sandboxes):
    """``k3 serve`` of the teacher as a remote teacher (sampled estimator): the step's KL per tag
    and loss equal those of the same checkpoint loaded in process, with requests 4 at a time (more
    than one in flight) and one at a time; a server of a model with another tokenizer is refused
    by the probe, a dead endpoint fails naming the teacher."""
    from k3.serve.launch import launch

    d, student, teach_a, _, task = models
    local = tmp_path / "local"
    assert distill_main(argv(student, teachers_toml(tmp_path / "l.toml", **{"general/low": teach_a}), task, local,
                             "--estimator", "sampled", steps=1)) == 0
    # requests in flight, counted around the real client's call (the server answers them)
    lock, flight = threading.Lock(), {"now": 0, "max": 0}
    score = RemoteTeacher._score

    def counted(self, ids):
        with lock:
            flight["now"] += 1
            flight["max"] = max(flight["max"], flight["now"])
        try:
            return score(self, ids)
        finally:
            with lock:
                flight["now"] -= 1

    monkeypatch.setattr(RemoteTeacher, "_score", counted)
    peaks = {}
    with launch(teach_a, "--model-name", "teacher", threads=1) as srv:
        remote = tmp_path / "r.toml"
        for conc in (4, 1):   # 4: the default; 1: one request at a time (the control)
            remote.write_text(f'["general/low"]\nurl = "{srv.url}/v1"\nmodel = "teacher"\n'
                              + (f"concurrency = {conc}\n" if conc != 4 else ""))
            flight["max"] = 0
            run = tmp_path / f"remote{conc}"
            assert distill_main(argv(student, remote, task, run, "--estimator", "sampled", steps=1)) == 0
            peaks[conc] = flight["max"]
    assert peaks[4] > 1 and peaks[1] == 1, peaks
    a = records(local)[0]
    for conc in (4, 1):
        b = records(tmp_path / f"remote{conc}")[0]
        assert a["sampled_tokens"] == b["sampled_tokens"] > 0
        assert abs(a["kl_by_tag"]["general/low"] - b["kl_by_tag"]["general/low"]) <= 1e-4, (conc, a, b)
        assert abs(a["loss"] - b["loss"]) <= 1e-4, conc
    capsys.readouterr()
    other = make_nano_checkpoint(tmp_path / "other", "Zebra quartz jumps; vexing fog. " * 3)[0]
    with launch(other, "--model-name", "other", threads=1) as srv:
        remote.write_text(f'["general/low"]\nurl = "{srv.url}/v1"\nmodel = "other"\n')
        assert distill_main(argv(student, remote, task, tmp_path / "r2", "--estimator", "sampled", steps=1)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another tokenizer" in err, err
    remote.write_text('["general/low"]\nurl = "http://127.0.0.1:9/v1"\nmodel = "gone"\ntimeout = 2\n')
    assert distill_main(argv(student, remote, task, tmp_path / "r3", "--estimator", "sampled", steps=1)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "teacher 'general/low'" in err and "failed 3 times" in err, err


def test_distillation_under_torchrun_takes_the_one_process_step(models, tmp_path, sandboxes):
    """--nproc 2 (each rank samples and trains its share, one rank's last micro-batch a padding
    one): the same episodes, KL per tag and loss as one process."""
    d, student, teach_a, _, task = models
    t = teachers_toml(tmp_path / "t.toml", **{"general/low": teach_a})
    same = ("--balance", "sign", "--ns-dtype", "fp32")
    assert distill_main(argv(student, t, task, tmp_path / "one", *same, steps=1)) == 0
    assert distill_main(argv(student, t, task, tmp_path / "two", *same, "--nproc", "2", steps=1)) == 0
    a, b = records(tmp_path / "one")[0], records(tmp_path / "two")[0]
    for k in ("sampled_tokens", "trained_tokens", "episodes_by_tag", "pass_by_tag"):
        assert a[k] == b[k], k
    assert abs(a["kl_by_tag"]["general/low"] - b["kl_by_tag"]["general/low"]) <= 1e-5
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))
