"""GPU check: the CUDA correctness checks and GPU benchmarks for a session lent one GPU (docs/GPU.md).

One run, at most ~8 minutes on an H200 (``--budget``, default 450 s, shared by all parts in order;
each part also has its own time limit), nothing downloaded. It prints a header line (torch, CUDA,
device and memory, fla), then one line per result, ``PASS|FAIL|SKIP name: detail``:

checks (each guarded: an exception or a blown time limit is that check's FAIL, the next one runs)

* ``kda_fla``: ``k3.ops.kda.chunk_kda`` on CUDA (fla's kernel) against the torch chunked form
  (``k3.ops.kda._chunked_kda``) on the CPU on the same fp32 inputs: output, final state and the
  gradients of q, k, v, g, beta (and the initial state) from random upstream gradients of both
  outputs (B2 T1000 H4 K64 V64: a padded tail chunk, an initial state). Max relative error
  ``max|got − ref| / max|ref|`` per tensor, bound ``KDA_FP32_BOUND``; fla's fp32 ``tl.dot`` runs in
  IEEE fp32 (``TRITON_F32_DEFAULT=ieee``, set unless given). SKIP when fla is not importable (why).
* ``kda_cuda_torch``: the same comparison for ``_chunked_kda`` itself on CUDA (the path the model
  takes on CUDA without fla), same bound.
* ``kda_bf16``: ``chunk_kda`` on CUDA with q, k, v in bf16 (g, beta and the state fp32, as the
  model under bf16 autocast gives them) against the fp32 CPU reference: output and final state, bound
  ``KDA_BF16_BOUND`` (the gradients' errors are reported, not bounded).
* ``kda_recurrent``: ``recurrent_kda`` (the decode path; fla's fused recurrent kernel when fla is
  importable) on CUDA against itself on the CPU, fp32 forward, bound ``KDA_FP32_BOUND``.
* ``model_step_bf16``: ``K3ForCausalLM(tiny)`` built on the CPU, a deep copy on CUDA: forward with
  labels under bf16 autocast, backward, one AdamW step; loss, gradients and updated weights finite,
  and the bf16 loss within ``LOSS_BOUND`` (relative) of the fp32 CPU loss on the same batch.
* ``engine_greedy``: ``k3.infer.engine.Engine`` on an fp32 CUDA copy of a ``nano`` model whose
  lm_head is ×20 (no float ties in greedy), 4 prompts of different lengths, 24 tokens each: the
  same tokens as the same engine on the CPU.
* ``nccl_step``: ``k3 train --nproc 1 --device cuda`` (the project's launcher:
  ``k3.cli.train.launch_torchrun`` runs torchrun; ``k3.train.distributed.init_distributed`` picks
  NCCL on CUDA) for 2 steps of ``nano`` on a few stdlib files; PASS when it exits 0 and the run
  directory holds a verified checkpoint. Subprocess time limit ``NCCL_TIMEOUT_S``.

benchmarks (PASS = measured, no targets; FAIL = it raised, overran or measured nonsense)

* ``train_mfu``: full training steps of ``small`` (B8 × T2048, bf16 autocast, Per-Head Muon +
  AdamW, Quantile Balancing: ``benchmarks/train.py``'s ``step_times``), MFU = tokens/s × model
  FLOPs per token (``benchmarks/train.py``'s ``model_flops_per_token``) ÷ ``H200_BF16_PEAK``
  (989 TFLOP/s, the H200's dense bf16 tensor-core peak from NVIDIA's data sheet, not measured).
* ``decode_tps_b1`` / ``decode_tps_b64``: Engine decode tokens/s (``small``, fp32 weights, 32-token
  prompts, 128 new tokens), as ``benchmarks/infer.py`` measures them: B·(N−1) / (t(N) − t(1)).
* ``prefill_tps_64k``: one 65,536-token sequence through ``model(ids, cache=model.new_cache(1))``
  (``small`` with ``max_position_embeddings`` raised to 65,536: its MLA is NoPE, the limit is only a
  check), no_grad, bf16 autocast.

Every timing follows a warm-up (the same call) and brackets the call with
``torch.cuda.synchronize``. Every result is also one JSON line ``{"bench": "gpu_check", "metric",
"value", "unit", "status", "detail", "machine", "date", ...}`` appended (as it is produced, so a
killed run keeps what it did) to ``--out DIR/gpu_check.jsonl`` (default ``benchmarks/results``).
Without CUDA every check and benchmark is one SKIP line. Exit status 1 when any line FAILed, else 0.

``python benchmarks/gpu_check.py [--out DIR] [--quick] [--budget S] [--only PARTS]``
(``make gpu-check``). ``--device cpu`` runs every part on the CPU against the CPU: a self-test of
this script's plumbing (with ``--quick``: small presets and sizes), no GPU result.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

if importlib.util.find_spec("k3") is None:   # a checkout without ``pip install -e .`` (the device machine):
    _SRC = str(Path(__file__).resolve().parent.parent / "src")
    sys.path.insert(0, _SRC)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")]))  # children
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
KDA_FP32_BOUND = 1e-4      # max relative error, fp32 CUDA vs fp32 CPU (forward, state, gradients)
KDA_BF16_BOUND = 3e-2      # max relative error, bf16-input CUDA vs fp32 CPU (output, final state)
LOSS_BOUND = 0.02          # |bf16 CUDA loss − fp32 CPU loss| / fp32 CPU loss
H200_BF16_PEAK = 989e12    # FLOP/s: H200 (SXM) dense bf16 tensor-core peak, NVIDIA data sheet
NCCL_TIMEOUT_S = 240
DEFAULT_BUDGET_S = 450     # the whole run; the device session allows ~8 minutes of run time
MIN_PART_S = 15            # a part is skipped when less than this is left of the budget
STDLIB_FILES = ("textwrap.py", "string.py", "abc.py", "bisect.py", "heapq.py", "glob.py", "fnmatch.py",
                "shlex.py")


# ------------------------------------------------------------------------------------ results
class Report:
    """Prints ``STATUS name: detail`` and appends the JSON line to ``path`` at once."""

    def __init__(self, path: Path, machine: str, device: str):
        self.path, self.machine, self.device = path, machine, device
        self.rows: list[dict] = []
        now = datetime.datetime.now()
        self.date, self.time = now.date().isoformat(), now.isoformat(timespec="seconds")
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, metric: str, status: str, detail: str, value=None, unit: str | None = None, **extra) -> None:
        assert status in ("PASS", "FAIL", "SKIP"), status
        row = {"bench": "gpu_check", "metric": metric, "value": value, "unit": unit, "status": status,
               "detail": detail, "machine": self.machine, "date": self.date, "time": self.time,
               "device": self.device, **extra}
        self.rows.append(row)
        print(f"{status} {metric}: {detail}", flush=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")

    def reported(self, metric: str) -> bool:
        return any(r["metric"] == metric for r in self.rows)

    @property
    def failed(self) -> list[str]:
        return [r["metric"] for r in self.rows if r["status"] == "FAIL"]


def _json_safe(x):
    """Strict JSON: a non-finite float becomes its name ("inf", "nan"), anything unknown its str."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def rel_err(got: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """max |got − ref| / max |ref| in float64 on the CPU; inf when a tensor is missing, the shapes
    differ or ``got`` is not finite (a NaN never passes)."""
    if got is None or ref is None or tuple(got.shape) != tuple(ref.shape):
        return math.inf
    g, r = got.detach().double().cpu(), ref.detach().double().cpu()
    if not bool(torch.isfinite(g).all()):
        return math.inf
    scale = r.abs().max().item() if r.numel() else 0.0
    diff = (g - r).abs().max().item() if r.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare(pairs: dict, bound: float) -> tuple[str, float, str]:
    """(PASS | FAIL, worst error, detail) for ``{name: (got, ref)}``: PASS when every max relative
    error (``rel_err``) is ≤ ``bound``."""
    errs = {name: rel_err(got, ref) for name, (got, ref) in pairs.items()}
    worst = max(errs.values()) if errs else math.inf
    ok = math.isfinite(worst) and worst <= bound
    parts = ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
    return ("PASS" if ok else "FAIL"), worst, f"max rel err {worst:.2e} {'<=' if ok else '>'} {bound:g} ({parts})"


# ----------------------------------------------------------------------------- environment
def fla_status() -> tuple[bool, str]:
    """(importable, "version x" or why not): the same import ``k3.ops.kda`` dispatches on."""
    try:
        importlib.import_module("fla.ops.kda")
    except Exception as e:  # noqa: BLE001 - any failure means k3 runs its torch path
        return False, f"not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    import fla   # fla-core alone holds fla.ops (and fla.__version__); flash-linear-attention adds the layers
    return True, f"{getattr(fla, '__version__', '(no __version__)')}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB), {os.cpu_count()} CPUs"
    return f"{cpu_model()}, {os.cpu_count()} CPUs, no GPU"


def header(fla_line: str) -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        cuda = (f"CUDA available: yes (CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)), "
                f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
    else:
        cuda = f"CUDA available: no (torch.version.cuda={torch.version.cuda}), device: CPU {cpu_model()}"
    return (f"gpu_check: torch {torch.__version__}, {cuda}, fla: {fla_line}, "
            f"TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT')}, K3_KERNELS={os.environ.get('K3_KERNELS')}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _load_bench(name: str):
    """A sibling benchmark module by path (``benchmarks`` is no package)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise PartTimeout in the main thread after ``seconds`` (SIGALRM; a no-op elsewhere). A CUDA
    call that blocks is interrupted when it returns to Python."""
    if not hasattr(signal, "setitimer") or seconds <= 0:
        yield
        return

    def fire(signum, frame):
        raise PartTimeout(f"exceeded its time limit of {seconds:.3g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Ctx:
    dev: torch.device
    quick: bool
    out: Path
    rep: Report
    fla_ok: bool
    fla_line: str
    deadline: float        # time.monotonic() by which the run ends

    def left(self) -> float:
        return self.deadline - time.monotonic()


# ------------------------------------------------------------------------------------ checks
def _kda_inputs(quick: bool, seed: int = 0):
    # T not a multiple of 64 (the padded tail); K = V = 64, the KDA head of tiny and small, so fla's kernels
    # compiled (and autotuned) here serve the model parts too
    B, T, H, K, V = (1, 100, 2, 32, 32) if quick else (2, 1000, 4, 64, 64)
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, K, generator=g) + 1.0)     # log-decay < 0, mean ≈ −0.4
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    h0 = torch.randn(B, H, K, V, generator=g)
    do = torch.randn(B, T, H, V, generator=g)
    dS = torch.randn(B, H, K, V, generator=g)
    return dict(q=q, k=k, v=v, g=gate, beta=beta, h0=h0), do, dS


_GRAD_NAMES = ("q", "k", "v", "g", "beta", "h0")


def _kda_run(fn, xs: dict, do, dS, dev: torch.device, dtypes: dict | None = None, grad: bool = True):
    """fn(q, k, v, g, beta, initial_state=, output_final_state=True) on ``dev``: (o, S, {grads})."""
    dtypes = dtypes or {}
    leaves = {n: t.to(dev, dtypes.get(n, torch.float32)).detach().requires_grad_(grad) for n, t in xs.items()}
    o, S = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
              initial_state=leaves["h0"], output_final_state=True)
    grads = {}
    if grad:
        loss = (o.float() * do.to(dev)).sum() + (S.float() * dS.to(dev)).sum()
        loss.backward()
        grads = {n: leaves[n].grad for n in _GRAD_NAMES}
    _sync(dev)
    return o, S, grads


def check_kda(ctx: Ctx) -> None:
    from k3.ops.kda import _chunked_kda, chunk_kda, recurrent_kda

    xs, do, dS = _kda_inputs(ctx.quick)
    cpu = torch.device("cpu")
    ref_o, ref_S, ref_g = _kda_run(_chunked_kda, xs, do, dS, cpu)
    shape = "B{} T{} H{} K{} V{}".format(*xs["q"].shape, xs["v"].shape[-1])

    def pairs(o, S, grads):
        return {"o": (o, ref_o), "state": (S, ref_S), **{f"d{n}": (grads.get(n), ref_g[n]) for n in _GRAD_NAMES}}

    if not ctx.fla_ok and ctx.dev.type == "cuda":
        ctx.rep.add("kda_fla", "SKIP", f"fla {ctx.fla_line}: chunk_kda runs the torch chunked form on CUDA "
                    "(kda_cuda_torch checks that)")
    else:
        o, S, grads = _kda_run(chunk_kda, xs, do, dS, ctx.dev)
        status, worst, detail = compare(pairs(o, S, grads), KDA_FP32_BOUND)
        path = f"fla {ctx.fla_line}" if ctx.dev.type == "cuda" else f"chunk_kda on {ctx.dev.type}"
        ctx.rep.add("kda_fla", status, f"{path} fp32 vs torch chunked form on the CPU, {shape}: {detail}",
                    worst, "max relative error", bound=KDA_FP32_BOUND)

    o, S, grads = _kda_run(_chunked_kda, xs, do, dS, ctx.dev)
    status, worst, detail = compare(pairs(o, S, grads), KDA_FP32_BOUND)
    ctx.rep.add("kda_cuda_torch", status, f"_chunked_kda fp32 on {ctx.dev.type} vs the CPU, {shape}: {detail}",
                worst, "max relative error", bound=KDA_FP32_BOUND)

    bf16 = {n: torch.bfloat16 for n in ("q", "k", "v")}   # as the model under autocast: g, beta fp32
    o, S, grads = _kda_run(chunk_kda, xs, do, dS, ctx.dev, bf16)
    status, worst, detail = compare({"o": (o, ref_o), "state": (S, ref_S)}, KDA_BF16_BOUND)
    gerr = {f"d{n}": rel_err(grads.get(n), ref_g[n]) for n in _GRAD_NAMES}
    path = ("fla" if ctx.fla_ok else "torch chunked form") if ctx.dev.type == "cuda" else f"{ctx.dev.type} path"
    ctx.rep.add("kda_bf16", status, f"chunk_kda ({path}) with q, k, v bf16 (g, beta, state fp32) vs the fp32 "
                f"CPU result, {shape}: {detail}; gradients (not bounded): "
                + ", ".join(f"{n} {e:.1e}" for n, e in gerr.items()),
                worst, "max relative error", bound=KDA_BF16_BOUND, grad_rel_err=gerr)

    short = {n: t[:, :64] if t.dim() == 4 and n != "h0" else t for n, t in xs.items()}
    short["beta"] = xs["beta"][:, :64]
    with torch.no_grad():
        r_o, r_S, _ = _kda_run(recurrent_kda, short, None, None, cpu, grad=False)
        o, S, _ = _kda_run(recurrent_kda, short, None, None, ctx.dev, grad=False)
    status, worst, detail = compare({"o": (o, r_o), "state": (S, r_S)}, KDA_FP32_BOUND)
    path = ("fla fused_recurrent_kda" if ctx.fla_ok else "torch loop") if ctx.dev.type == "cuda" else ctx.dev.type
    ctx.rep.add("kda_recurrent", status, f"recurrent_kda ({path}) fp32 vs the CPU, 64 tokens: {detail}",
                worst, "max relative error", bound=KDA_FP32_BOUND)


def check_model_step(ctx: Ctx) -> None:
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny"))
    B, T = (2, 64) if ctx.quick else (4, 512)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, labels=ids).loss.item()
    gm = copy.deepcopy(model).to(ctx.dev)
    del model
    before = [p.detach().clone() for p in gm.parameters()]
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    x = ids.to(ctx.dev)
    with torch.autocast(ctx.dev.type, dtype=torch.bfloat16):
        loss = gm(x, labels=x).loss
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(gm.parameters(), float("inf")).item()
    opt.step()
    _sync(ctx.dev)
    got = loss.item()
    moved = sum(not torch.equal(p.detach(), b) for p, b in zip(gm.parameters(), before))
    finite_w = all(bool(torch.isfinite(p).all()) for p in gm.parameters())
    rel = abs(got - ref) / abs(ref)
    problems = []
    if not math.isfinite(got):
        problems.append("loss not finite")
    if not math.isfinite(gnorm):
        problems.append("gradient norm not finite")
    if not finite_w:
        problems.append("weights not finite after the step")
    if moved == 0:
        problems.append("no weight changed")
    if not rel <= LOSS_BOUND:
        problems.append(f"loss off by {rel:.2%} > {LOSS_BOUND:.0%}")
    detail = (f"tiny B{B} T{T}, bf16 autocast on {ctx.dev.type}: loss {got:.4f} vs fp32 CPU {ref:.4f} "
              f"(rel {rel:.2e}, bound {LOSS_BOUND:g}), grad norm {gnorm:.3g}, AdamW moved "
              f"{moved}/{len(before)} tensors" + (f"; {'; '.join(problems)}" if problems else ""))
    ctx.rep.add("model_step_bf16", "FAIL" if problems else "PASS", detail, rel, "relative loss difference",
                loss=got, ref_loss=ref, bound=LOSS_BOUND)


def _prompts(lengths, V: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


def check_engine(ctx: Ctx) -> None:
    from k3.config import get_preset
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("nano")).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)   # sharper logits: greedy choices are no float ties
    gm = copy.deepcopy(model).to(ctx.dev)
    lengths, N = (3, 11, 29, 64), 24
    prompts = _prompts(lengths, model.config.vocab_size)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    with Engine(model, max_batch=4) as eng:
        ref = [o.token_ids for o in eng.generate(prompts, params)]
    with Engine(gm, max_batch=4) as eng:
        got = [o.token_ids for o in eng.generate(prompts, params)]
    same = sum(a == b for a, b in zip(got, ref))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
             for a, b in zip(got, ref)]
    ok = got == ref and all(len(t) == N for t in got)
    detail = (f"nano (lm_head x20) fp32, prompts of {list(lengths)} tokens, {N} greedy tokens each: "
              f"{same}/{len(prompts)} sequences identical to the CPU engine"
              + ("" if ok else f"; first differing position per prompt {first}"))
    ctx.rep.add("engine_greedy", "PASS" if ok else "FAIL", detail, same, "identical sequences of 4")


def check_nccl(ctx: Ctx) -> None:
    import torch.distributed as dist

    from k3.checkpoint.training import find_checkpoint

    if ctx.dev.type == "cuda" and not dist.is_nccl_available():
        ctx.rep.add("nccl_step", "SKIP", "this torch is built without NCCL (torch.distributed.is_nccl_available() "
                    "is False)")
        return
    backend = "nccl" if ctx.dev.type == "cuda" else "gloo"
    tmp = Path(tempfile.mkdtemp(prefix="k3-gpu-check-"))
    try:
        data = tmp / "data"
        data.mkdir()
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for name in STDLIB_FILES:
            if (stdlib / name).is_file():
                shutil.copy(stdlib / name, data / name)
        run = tmp / "run"
        cmd = [sys.executable, "-m", "k3", "train", "--nproc", "1", "--preset", "nano", "--steps", "2",
               "--device", ctx.dev.type, "--data", str(data), "--out", str(run), "--seq-len", "64",
               "--batch-size", "8", "--eval-batches", "1", "--final-eval-batches", "1", "--no-plot"]
        if ctx.dev.type == "cpu":
            cmd += ["--threads", "2"]
        env = {**os.environ, "K3_CACHE_DIR": str(tmp / "cache")}   # the tokenizer cache stays in tmp
        timeout = max(10.0, min(NCCL_TIMEOUT_S, ctx.left() - 5))
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except BaseException:   # the time limit, or PartTimeout: end the whole process group we started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            (ctx.out / "gpu_check_nccl.log").write_text(log or "")
            raise
        dt = time.monotonic() - t0
        (ctx.out / "gpu_check_nccl.log").write_text(log)
        ckpt = find_checkpoint(run) if proc.returncode == 0 else None
        ok = proc.returncode == 0 and ckpt is not None
        tail = " | ".join(line.strip() for line in log.strip().splitlines()[-3:])
        detail = (f"k3 train --nproc 1 (torchrun, backend {backend}) nano 2 steps: exit {proc.returncode} in "
                  f"{dt:.0f} s, checkpoint {ckpt.name if ckpt else 'missing'}"
                  + ("" if ok else f"; last lines: {tail[-400:]} (log: {ctx.out / 'gpu_check_nccl.log'})"))
        ctx.rep.add("nccl_step", "PASS" if ok else "FAIL", detail, dt, "s", exit_status=proc.returncode,
                    backend=backend)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -------------------------------------------------------------------------------- benchmarks
def bench_train(ctx: Ctx) -> None:
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM
    from k3.train.balance import RouterBalancer
    from k3.train.optim import build_optimizer

    tb = _load_bench("train")
    preset, B, T, steps, warmup = ("nano", 2, 64, 1, 1) if ctx.quick else ("small", 8, 2048, 5, 2)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(preset)).to(ctx.dev)
    opt = build_optimizer(model, model.config, 3e-3, 0.0)
    bal = RouterBalancer(model, "quantile")
    fl = tb.model_flops_per_token(model, T)
    times = tb.step_times(model, opt, bal, B, T, steps, warmup, ctx.dev, torch.bfloat16)
    step = sorted(times)[len(times) // 2]
    tps = B * T / step
    mfu = tps * fl["total"] / H200_BF16_PEAK
    ctx.rep.add("train_mfu", "PASS", f"{preset} B{B} T{T} bf16 autocast, Per-Head Muon + AdamW + QB: "
                f"{tps:,.0f} tokens/s, {tps * fl['total'] / 1e12:.2f} model TFLOP/s = MFU {mfu:.2%} of "
                f"989 TFLOP/s (H200 dense bf16 peak, data sheet; not measured); median step {step * 1e3:.1f} ms "
                f"over {len(times)}", mfu, "fraction of 989 TFLOP/s", tokens_per_s=tps,
                model_flops_per_token=fl["total"], activated_params=fl["activated_params"], median_step_s=step,
                config=f"{preset} B{B} T{T} bf16")


def bench_decode(ctx: Ctx) -> None:
    from k3.config import get_preset
    from k3.infer.engine import Engine
    from k3.model.decoder import K3ForCausalLM

    ib = _load_bench("infer")
    # one timing each: a decode step of small over the modules dispatches ~9k (batch 1) to ~20k (batch 64)
    # operations (CPU profile), so a 128-token run takes seconds to tens of seconds on a GPU
    preset, n, repeats = ("nano", 16, 1) if ctx.quick else ("small", 128, 1)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(preset)).to(ctx.dev).eval()
    with Engine(model, max_batch=64) as eng:
        ib.engine_time(eng, ib._prompts(64, 32, model.config.vocab_size, seed=5), 4)   # warm-up, both shapes
        ib.engine_time(eng, ib._prompts(1, 32, model.config.vocab_size, seed=6), 4)
        for B in (1, 64):
            _sync(ctx.dev)
            tps = ib.decode_tps(eng, B, 32, n, repeats)
            ok = math.isfinite(tps) and tps > 0
            # on the CPU self-test the machine is shared: an invalid timing is noise, not a failure
            bad = "SKIP" if ctx.dev.type == "cpu" else "FAIL"
            ctx.rep.add(f"decode_tps_b{B}", "PASS" if ok else bad,
                        f"Engine, {preset} fp32 weights, batch {B}, 32-token prompts, {n} new tokens: "
                        f"{tps:,.1f} tokens/s (B·(N−1) / (t(N) − t(1)), {repeats} timing(s) each)"
                        + ("" if ok else "; not a valid measurement: t(N) <= t(1)"), tps, "tokens/s",
                        config=f"{preset} B{B} N{n} fp32")


def bench_prefill(ctx: Ctx) -> None:
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM

    preset, T = ("nano", 2112) if ctx.quick else ("small", 65536)   # quick: past nano's 2048 as well
    torch.manual_seed(0)
    cfg = get_preset(preset, max_position_embeddings=max(T, get_preset(preset).max_position_embeddings))
    model = K3ForCausalLM(cfg).to(ctx.dev).eval()
    if ctx.dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.dev)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(2)).to(ctx.dev)

    def once() -> float:
        _sync(ctx.dev)
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast(ctx.dev.type, dtype=torch.bfloat16):
            model(ids, cache=model.new_cache(1), logits_to_keep=1)
        _sync(ctx.dev)
        return time.perf_counter() - t0

    once()   # warm-up (kernel autotuning, allocator)
    dt = once()
    peak = torch.cuda.max_memory_allocated(ctx.dev) / 2**30 if ctx.dev.type == "cuda" else None
    ctx.rep.add("prefill_tps_64k", "PASS", f"{preset} (max_position_embeddings {cfg.max_position_embeddings}), one "
                f"{T}-token sequence, model(ids, cache=new_cache(1)), no_grad, bf16 autocast: {T / dt:,.0f} tokens/s "
                f"({dt:.2f} s)" + (f", peak memory {peak:.1f} GiB" if peak is not None else ""),
                T / dt, "tokens/s", seconds=dt, tokens=T, peak_gib=peak)


# (part name, metrics it reports, function, time limit in seconds). The first calls of fla's kernels
# compile and autotune them (tens of seconds per dtype and head size), hence the generous limits; the
# run as a whole stops at --budget, and a part that would start with under MIN_PART_S left is skipped.
PARTS = [
    ("kda", ("kda_fla", "kda_cuda_torch", "kda_bf16", "kda_recurrent"), check_kda, 150),
    ("model_step", ("model_step_bf16",), check_model_step, 120),
    ("engine", ("engine_greedy",), check_engine, 90),
    ("nccl", ("nccl_step",), check_nccl, NCCL_TIMEOUT_S + 10),
    ("train", ("train_mfu",), bench_train, 120),
    ("decode", ("decode_tps_b1", "decode_tps_b64"), bench_decode, 120),
    ("prefill", ("prefill_tps_64k",), bench_prefill, 120),
]


def run_part(ctx: Ctx, metrics: tuple[str, ...], fn, limit: float, no_cuda: str | None) -> None:
    """Run one part; whatever it did not report becomes one SKIP (no CUDA, no time) or FAIL line each."""
    def rest(status: str, detail: str) -> None:
        for m in metrics:
            if not ctx.rep.reported(m):
                ctx.rep.add(m, status, detail)

    if no_cuda:
        return rest("SKIP", no_cuda)
    left = ctx.left()
    if left < MIN_PART_S:
        return rest("SKIP", f"time budget: {max(left, 0):.0f} s left of --budget (a part needs >= {MIN_PART_S} s)")
    t0 = time.monotonic()
    try:
        with time_limit(min(limit, left)):
            fn(ctx)
    except Exception as e:  # noqa: BLE001 - one part's failure never stops the others
        traceback.print_exc(file=sys.stderr)
        msg = " ".join(str(e).split())[:300]
        rest("FAIL", f"{type(e).__name__}: {msg} (after {time.monotonic() - t0:.0f} s)")
    finally:
        if ctx.dev.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    rest("FAIL", "the part ended without reporting this result")


def set_environment() -> None:
    """Process settings of a run (``main`` only, so importing this module changes nothing)."""
    # Before fla imports triton: fp32 ``tl.dot`` in fla's kernels in IEEE fp32, not TF32 (TF32's 10-bit
    # mantissa alone is ~1e-3 relative, above the fp32 bound); fla's own tests set it likewise.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    # The CPU references run the torch formulation of every op (the reference the C kernels are tested
    # against), so a fresh machine compiles nothing; CUDA tensors never take a C kernel either way.
    os.environ.setdefault("K3_KERNELS", "torch")
    torch.set_flush_denormal(True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(RESULTS), help="folder of gpu_check.jsonl (default benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU self-test)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    p.add_argument("--only", help=f"comma-separated parts: {','.join(n for n, *_ in PARTS)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: run every part on the CPU against the CPU (a self-test of this script)")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if only and only - {n for n, *_ in PARTS}:
        p.error(f"--only: unknown {sorted(only - {n for n, *_ in PARTS})}")
    set_environment()
    out = Path(args.out)
    fla_ok, fla_line = fla_status()
    print(header(fla_line), flush=True)
    dev = torch.device(args.device)
    rep = Report(out / "gpu_check.jsonl", machine_description(), dev.type)
    ctx = Ctx(dev, args.quick, out, rep, fla_ok, fla_line, time.monotonic() + args.budget)
    no_cuda = None
    if dev.type == "cuda" and not torch.cuda.is_available():
        no_cuda = f"no CUDA (torch.cuda.is_available() is False; torch {torch.__version__})"
    for name, metrics, fn, limit in PARTS:
        if only is None or name in only:
            run_part(ctx, metrics, fn, limit, no_cuda)
    n = {s: sum(r["status"] == s for r in rep.rows) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu_check: {n['PASS']} PASS, {n['FAIL']} FAIL, {n['SKIP']} SKIP"
          + (f" (failed: {', '.join(rep.failed)})" if rep.failed else "") + f"; results: {rep.path}", flush=True)
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
