"""``k3 vision-demo`` (``make vision-demo``): a tiny K3 learns to answer questions about images.

1. **Base**: a pretrained text checkpoint whose tokenizer has the media tokens (``--base``; when it
   holds no checkpoint, ``k3 train --preset tiny`` pretrains it for ``--base-steps`` steps on the
   default corpus).
2. **Data**: the synthetic image family (``k3.tasks.vision_synth``: count, colour, position, text)
   on training seeds; the control's rows are the same conversations with the image part removed.
3. **SFT**: ``k3 sft --vision tiny`` of the base on the image rows (a new tower and projector,
   trained with the text model), and ``k3 sft`` of the same base on the control rows: same steps,
   batch, sequence length, learning rate and seed.
4. **Held-out evaluation**: fresh seeds, greedy through the engine (``k3.rl.vqa``): the vision
   model sees each image, the control the question alone; exact-match accuracy per kind. The
   control shows what the question's wording and the answer prior give without pixels.

The report (a table, ``OUT/report.json`` with the machine and date, and the per-item rows in
``OUT/answers.jsonl``) is what ``benchmarks/docs_tables.py --save-vision`` records for the docs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3.rl.eval_rows import machine

__all__ = ["vision_demo_main", "VisionDemo", "control_rows"]

KINDS = ("count", "color", "position", "text")
HELDOUT_START = 100_000   # evaluation seeds start here; training seeds are 0..train_seeds-1


def control_rows(src: Path, dst: Path) -> int:
    """``dst``: the rows of ``src`` with every image part removed (the text-only control)."""
    n = 0
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as g:
        for line in f:
            row = json.loads(line)
            for m in row["messages"]:
                if isinstance(m.get("content"), list):
                    m["content"] = [p for p in m["content"] if p.get("type") != "image_url"]
            g.write(json.dumps(row) + "\n")
            n += 1
    return n


@dataclass
class VisionDemo:
    base: Path
    out: Path
    train_seeds: int = 600
    heldout: int = 50                 # items per kind
    kinds: tuple[str, ...] = KINDS
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    tower: str = "tiny"
    base_steps: int = 150
    threads: int | str = "auto"
    times: dict = field(default_factory=dict)

    def run(self, log=print) -> dict:
        t_all = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        if not _has_checkpoint(self.base):
            self._pretrain(log)
        data = self.out / "data"
        data.mkdir(exist_ok=True)
        t0 = time.monotonic()
        from k3.tasks.vision_synth import write_jsonl
        n = write_jsonl(data / "images.jsonl", range(self.train_seeds), self.kinds)
        control_rows(data / "images.jsonl", data / "control.jsonl")
        self.times["data_s"] = time.monotonic() - t0
        log(f"== data: {n} conversations ({self.train_seeds} seeds × {', '.join(self.kinds)}), "
            "and the same without their images")
        sft = {}
        for name, rows, vision in (("vision", "images.jsonl", self.tower), ("control", "control.jsonl", None)):
            log(f"== SFT {name}: {self.steps} steps of {self.batch_size} × {self.seq_len} tokens from {self.base}"
                + (f", a new {vision} tower" if vision else ", text only"))
            t0 = time.monotonic()
            sft[name] = self._sft(data / rows, self.out / name, vision, log)
            self.times[f"sft_{name}_s"] = time.monotonic() - t0
        log(f"== held-out evaluation: {self.heldout} items per kind (seeds {HELDOUT_START}..), greedy")
        from k3.infer.run_model import load_run_model
        from k3.rl.vqa import accuracy, answer_items
        from k3.tasks.vision_synth import make_image_item
        items = [make_image_item(HELDOUT_START + s, k) for s in range(self.heldout) for k in self.kinds]
        answers, acc = [], {}
        for name in ("vision", "control"):
            t0 = time.monotonic()
            model, tok = load_run_model(self.out / name)
            rows = answer_items(model, tok, items, with_image=name == "vision")
            answers += [{"model": name, **r} for r in rows]
            acc[name] = accuracy(rows)
            self.times[f"eval_{name}_s"] = time.monotonic() - t0
        (self.out / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers))
        self.times["total_s"] = time.monotonic() - t_all
        report = {"accuracy": acc, "sft": sft, "heldout_per_kind": self.heldout, "kinds": list(self.kinds),
                  "train_seeds": self.train_seeds, "tower": self.tower,
                  "times": {k: round(v, 1) for k, v in self.times.items()},
                  "machine": machine(), "date": time.strftime("%Y-%m-%d")}
        (self.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        log(format_table(report))
        return report

    def _pretrain(self, log) -> None:
        log(f"== no checkpoint in {self.base}: pretraining a tiny base ({self.base_steps} steps, default corpus)")
        t0 = time.monotonic()
        from k3.cli.train import train_main
        if train_main(["--preset", "tiny", "--steps", str(self.base_steps), "--seq-len", str(self.seq_len),
                       "--out", str(self.base), "--threads", str(self.threads), "--eval-interval", "0",
                       "--final-eval-batches", "4", "--no-plot", "--overwrite"]) != 0:
            raise RuntimeError("pretraining the base failed")
        self.times["pretrain_s"] = time.monotonic() - t0

    def _sft(self, data: Path, out: Path, vision: str | None, log) -> dict:
        from k3.train.config import TrainConfig
        from k3.train.loop import Trainer
        opts = {"init_from": str(self.base), "sft_data": str(data), "out": str(out), "steps": self.steps,
                "batch_size": self.batch_size, "curriculum": [[0, self.seq_len]], "lr": self.lr,
                "warmup_frac": 0.05, "decay_frac": 0.3, "eval_interval": 0, "val_percent": 0,
                "ckpt_interval": 0, "threads": self.threads, "log_interval": 50, "plot": False}
        if vision:
            opts["vision"] = vision
        trainer = Trainer(TrainConfig.build(None, opts), overwrite=True)
        log("   " + trainer.corpus.summary())
        trainer.train()
        losses = [r["loss"] for r in trainer.metrics.records if r.get("kind") == "train"]
        return {"steps": self.steps, "batch_size": self.batch_size, "seq_len": self.seq_len, "lr": self.lr,
                "final_loss": round(sum(losses[-10:]) / max(len(losses[-10:]), 1), 4),
                **{k: v for k, v in trainer.corpus.counts().items() if k in ("train_conversations", "train_images")}}


def _has_checkpoint(path: Path) -> bool:
    from k3.checkpoint.training import find_checkpoint
    return path.is_dir() and ((path / "config.json").is_file() or find_checkpoint(path) is not None)


def format_table(report: dict) -> str:
    acc = report["accuracy"]
    lines = [f"{'kind':<10} {'vision':>14} {'text-only control':>20}"]
    for k in [*report["kinds"], "all"]:
        v, c = acc["vision"][k], acc["control"][k]
        lines.append(f"{k:<10} {v['correct']:>4}/{v['n']:<4} {100 * v['accuracy']:>4.0f} % "
                     f"{c['correct']:>8}/{c['n']:<4} {100 * c['accuracy']:>4.0f} %")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3 vision-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="runs/vision-base", help="pretrained text run or checkpoint (pretrained when missing)")
    p.add_argument("--out", default="runs/vision-demo")
    d = VisionDemo(Path("."), Path("."))
    for flag, typ in (("train-seeds", int), ("heldout", int), ("steps", int), ("batch-size", int),
                      ("seq-len", int), ("lr", float), ("base-steps", int)):
        p.add_argument(f"--{flag}", type=typ, default=getattr(d, flag.replace("-", "_")))
    p.add_argument("--tower", default=d.tower, help="the vision tower preset (nano | tiny | small)")
    p.add_argument("--kinds", default=",".join(KINDS), help="question kinds, comma-separated")
    p.add_argument("--threads", default="auto")
    return p


def vision_demo_main(argv: list[str] | None = None) -> int:
    from k3.cliutil import guarded
    from k3.errors import ConfigError
    args = _parser().parse_args(argv)

    def run() -> int:
        kinds = tuple(k for k in args.kinds.split(",") if k)
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ConfigError(f"--kinds: {', '.join(bad) or 'none given'}; choose from {', '.join(KINDS)}")
        for name in ("train_seeds", "heldout", "steps", "batch_size", "seq_len", "base_steps"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        VisionDemo(Path(args.base), Path(args.out), args.train_seeds, args.heldout, kinds, args.steps,
                   args.batch_size, args.seq_len, args.lr, args.tower, args.base_steps, args.threads).run()
        return 0
    return guarded("vision-demo", run)
