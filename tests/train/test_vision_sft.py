"""``k3 sft`` on image+text conversations (issue 34): batches carry each row's images in token
order, truncation never splits an image, a new tower trains (or stays frozen), resume is exact.

The order check reads each media block's owner from the text written before it ("grey K") and
compares the block's first patch with the grey level K the test drew; the expected pad counts
are ceil(W/28)·ceil(H/28), computed here.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import signal

import pytest
import torch
from PIL import Image

from k3.checkpoint import from_pretrained
from k3.cli.train import sft_main
from k3.config.vision import ImageProcConfig
from k3.data.sft import ChatData
from k3.errors import K3Error
from k3.model.multimodal import K3VLForConditionalGeneration, images_of_rows
from k3.tasks.vision_synth import write_jsonl
from k3.train.config import TrainConfig
from k3.train.loop import Trainer
from k3.train.metrics import read_metrics

TEXT = "grey 12 is an image of one colour. What grey is it? The answer is 40. image 28x56 " * 20
GREYS = [10, 60, 110, 160, 210, 250]
SIZES = [(28, 28), (56, 30), (20, 70), (90, 28), (28, 28), (40, 40)]


def _url(size, grey) -> str:
    buf = io.BytesIO()
    Image.new("L", size, grey).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _row(k: int, n_images: int = 1) -> dict:
    content = [{"type": "text", "text": f"grey {k}"}]
    content += [{"type": "image_url", "image_url": {"url": _url(SIZES[k], GREYS[k])}}] * n_images
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "reasoning_content": "", "content": f"{GREYS[k]}"}]}


@pytest.fixture(scope="module")
def base(tmp_path_factory, make_nano_checkpoint):
    d = tmp_path_factory.mktemp("vsft")
    ckpt, _, tok = make_nano_checkpoint(d / "nano", TEXT)
    return d, ckpt, tok


def test_batches_carry_each_rows_images_in_token_order(base):
    d, _, tok = base
    data = d / "greys.jsonl"
    data.write_text("".join(json.dumps(_row(k)) + "\n" for k in range(len(GREYS))))
    chats = ChatData(data, tok, seq_len=120, val_percent=0, image_proc=ImageProcConfig())
    x, y, docs, pixels, grids = chats.batches(batch_size=2, seed=0).next_batch()
    begin, end, pad = (tok.token_to_id(t) for t in ("<|media_begin|>", "<|media_end|>", "<|media_pad|>"))
    blocks = []                                            # (owner k, pad count), row-major
    for r in range(x.shape[0]):
        ids = x[r].tolist()
        for i, t in enumerate(ids):
            if t == begin:
                k = int(re.findall(r"grey (\d+)", tok.decode(ids[:i]))[-1])
                blocks.append((k, ids[i:ids.index(end, i)].count(pad)))
    assert len(blocks) >= 2 and grids.shape == (len(blocks), 3)
    first = 0
    for (k, n_pad), (_, gh, gw) in zip(blocks, grids.tolist()):
        w, h = SIZES[k]
        assert n_pad == math.ceil(w / 28) * math.ceil(h / 28) == (gh // 2) * (gw // 2)
        assert torch.allclose(pixels[first, :, 0, 0], torch.full((3,), 2 * GREYS[k] / 255 - 1))
        first += gh * gw
    assert first == pixels.shape[0]
    # labels: the answer is trained, no media token is
    assert not torch.isin(y[y >= 0], torch.tensor([begin, end, pad])).any()


def test_a_truncated_conversation_keeps_only_whole_images(base):
    d, _, tok = base
    data = d / "two.jsonl"
    first = _row(1)                                            # 56x30: 4 pads a block
    second = _row(2)["messages"]                               # 20x70: 3 pads
    data.write_text(json.dumps({"messages": first["messages"] + second}) + "\n")
    whole = ChatData(data, tok, seq_len=400, val_percent=0, image_proc=ImageProcConfig()).train[0]
    begin, end = tok.token_to_id("<|media_begin|>"), tok.token_to_id("<|media_end|>")
    starts = [i for i, t in enumerate(whole.ids) if t == begin]
    ends = [i for i, t in enumerate(whole.ids) if t == end]
    assert len(whole.images) == 2 and len(starts) == 2
    for limit in (starts[1] + 2, ends[1]):                     # inside the second block, or on its end token
        cut = ChatData(data, tok, seq_len=limit, val_percent=0, image_proc=ImageProcConfig())
        conv = cut.train[0]
        assert cut.truncated == 1 and cut.dropped == 0
        assert conv.ids == whole.ids[:starts[1]] and conv.images == whole.images[:1]
    fits = ChatData(data, tok, seq_len=ends[1] + 1, val_percent=0, image_proc=ImageProcConfig()).train[0]
    assert fits.images == whole.images and fits.ids == whole.ids[:ends[1] + 1]   # positive control


def test_a_text_model_refuses_image_rows_naming_the_line(base):
    d, _, tok = base
    data = d / "greys.jsonl"
    with pytest.raises(K3Error, match=r"greys.jsonl:1: messages\[0\]\.content\[1\] is an image, but this "
                                      r"model has no vision tower"):
        ChatData(data, tok, seq_len=120)
    assert ChatData(data, tok, seq_len=120, image_proc=ImageProcConfig()).train  # positive control


def _synth(d):
    path = d / "synth.jsonl"
    if not path.exists():
        write_jsonl(path, range(6), kinds=("color", "count"))
    return path


def _argv(ckpt, data, out, *extra, steps=3):
    return ["--from", str(ckpt), "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--batch-size", "2", "--seq-len", "160", "--threads", "1", "--no-plot", "--eval-interval", "0",
            "--val-percent", "0", *extra]


def _tower(model):
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith("vision_tower.")}


def test_sft_adds_a_tower_trains_it_and_freeze_keeps_it(base):
    d, ckpt, _ = base
    data = _synth(d)
    seen = {}

    def keep_initial(trainer):
        seen[trainer.tc.out] = (_tower(trainer.model), trainer.model.mm_projector.proj[0].weight.clone())

    for name, extra in (("free", ()), ("frozen", ("--freeze-vision",))):
        assert sft_main(_argv(ckpt, data, d / name, "--vision", "nano", *extra), trainer_hook=keep_initial) == 0
    for name in ("free", "frozen"):
        model = from_pretrained(d / name / "checkpoint" / "model", model_class=K3VLForConditionalGeneration)
        tower0, proj0 = seen[str(d / name)]
        same = [torch.equal(model.state_dict()[k], v) for k, v in tower0.items()]
        assert len(same) > 10
        assert all(same) == (name == "frozen")                       # the control moves, the frozen does not
        assert not torch.equal(model.mm_projector.proj[0].weight, proj0)  # the projector trains in both
    ckpt_cfg = json.loads((d / "free" / "checkpoint" / "model" / "config.json").read_text())
    assert ckpt_cfg["model_type"] == "kimi_k3" and "vision_config" in ckpt_cfg and "text_config" in ckpt_cfg


def test_vision_sft_resume_is_bit_exact(base):
    d, ckpt, _ = base
    data = _synth(d)

    def cfg(out):
        return TrainConfig.build(None, {"init_from": str(ckpt), "sft_data": str(data), "out": str(d / out),
                                        "vision": "nano", "steps": 4, "batch_size": 2, "curriculum": [[0, 160]],
                                        "threads": 1, "plot": False, "eval_interval": 0, "val_percent": 0,
                                        "ckpt_interval": 0})
    full = Trainer(cfg("vfull"))
    assert full.train().status == "done"
    part = Trainer(cfg("vpart"))
    part.on_step_end.append(lambda t, rec: setattr(t, "stop_signal", signal.SIGTERM) if t.step == 2 else None)
    assert part.train().status == "interrupted"
    del part
    assert sft_main(["--resume", str(d / "vpart"), "--threads", "1"]) == 0

    def losses(run):
        return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]
    assert len(losses(d / "vfull")) == 4 and losses(d / "vpart") == losses(d / "vfull")
    a = from_pretrained(d / "vfull" / "checkpoint" / "model", model_class=K3VLForConditionalGeneration)
    b = from_pretrained(d / "vpart" / "checkpoint" / "model", model_class=K3VLForConditionalGeneration)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_k3_train_with_a_run_toml_is_the_same_vision_sft_run(base):
    """``k3 train --config run.toml`` (init_from, sft_data, vision) trains what ``k3 sft``'s flags train:
    the same losses and the same weights, tower included."""
    from k3.cli.train import train_main

    d, ckpt, _ = base
    data = _synth(d)
    assert sft_main(_argv(ckpt, data, d / "by_flags", "--vision", "nano")) == 0
    toml = d / "vision_run.toml"
    toml.write_text(f'init_from = "{ckpt}"\nsft_data = "{data}"\nvision = "nano"\nsteps = 3\nbatch_size = 2\n'
                    'curriculum = [[0, 160]]\nthreads = 1\nplot = false\neval_interval = 0\nval_percent = 0\n')
    assert train_main(["--config", str(toml), "--out", str(d / "by_toml")]) == 0

    def losses(run):
        return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]
    assert len(losses(d / "by_toml")) == 3 and losses(d / "by_toml") == losses(d / "by_flags")
    a = from_pretrained(d / "by_flags" / "checkpoint" / "model", model_class=K3VLForConditionalGeneration)
    b = from_pretrained(d / "by_toml" / "checkpoint" / "model", model_class=K3VLForConditionalGeneration)
    sa, sb = a.state_dict(), b.state_dict()
    assert any(k.startswith("vision_tower.") for k in sb) and sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], v) for k, v in sb.items())


@pytest.mark.parametrize("extra,match", [
    (("--vision", "kimi-linear-48b"), "vision must name a preset with a vision tower"),
    (("--freeze-vision",), "is an image, but this model has no vision tower"),
])
def test_vision_flag_errors_are_one_line(base, capsys, extra, match):
    d, ckpt, _ = base
    data = _synth(d)
    assert sft_main(_argv(ckpt, data, d / "err", *extra, steps=1)) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


def test_images_of_rows_takes_whole_images_of_the_rows():
    """Three rows holding 2, 0 and 1 images (pads 1+4, 0, 2) of merge kernel 2×2; each image's
    patch rows carry its index, so the slice is checked by value."""
    pad = 9
    grids = torch.tensor([[1, 2, 2], [1, 4, 4], [1, 2, 4]])          # 1, 4, 2 merged tokens; 4, 16, 8 patches
    pixels = torch.cat([torch.full((n, 3, 2, 2), float(i)) for i, n in enumerate((4, 16, 8))])
    x = torch.tensor([[1, pad, 2, pad, pad, pad, pad, 3],
                      [1, 2, 3, 4, 5, 6, 7, 8],
                      [1, 2, pad, pad, 3, 4, 5, 6]])
    for rows, items in ((slice(0, 1), [0, 1]), (slice(1, 2), []), (slice(2, 3), [2]), (slice(1, 3), [2]),
                        (slice(0, 3), [0, 1, 2])):
        pv, g = images_of_rows(x, pixels, grids, rows, pad, [2, 2])
        assert g.tolist() == [grids[i].tolist() for i in items]
        assert pv[:, 0, 0, 0].tolist() == [float(i) for i in items for _ in range(int(grids[i].prod()))]
    short = x.clone()
    short[0, 6] = 0                                        # image 1 loses a pad: it would span rows
    with pytest.raises(K3Error, match="row 0 holds 4 <|media_pad|>"):
        images_of_rows(short, pixels, grids, slice(0, 1), pad, [2, 2])


@pytest.mark.slow
def test_vision_sft_on_two_processes_equals_one(base):
    """``k3 sft --vision --nproc 2 --dp 2``: each rank embeds the images of its own rows with its
    whole tower, the tower's gradients are averaged over the ranks, and the losses are the one-
    process run's (as tests/train/test_distributed.py compares text runs)."""
    import subprocess
    import sys
    d, ckpt, _ = base
    data = _synth(d)
    same = ("--vision", "nano", "--ckpt-interval", "0", "--ns-dtype", "fp32", "--balance", "sign")
    assert sft_main(_argv(ckpt, data, d / "v1", *same, steps=4)) == 0
    r = subprocess.run([sys.executable, "-m", "k3", "sft", "--nproc", "2", "--dp", "2",
                        *_argv(ckpt, data, d / "v2", *same, steps=4)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    def losses(run):
        return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]
    a, b = losses(d / "v1"), losses(d / "v2")
    assert len(b) == 4 and max(abs(p - q) / abs(p) for p, q in zip(a, b)) < 1e-4, (a, b)
    assert len(set(a)) == 4    # the runs learn (a loss that stood still would compare trivially)
