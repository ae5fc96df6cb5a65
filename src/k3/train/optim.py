"""Per-Head Muon + AdamW in one optimizer, the name-based parameter split, and QK-Clip (SPEC §5).

Muon, for a matrix parameter W [A, B] with gradient G (Moonlight form):

    M ← μ·M + G                              (momentum buffer, μ = 0.95)
    U = G + μ·M  (Nesterov)  or  M
    O = NS5(U) ≈ U_svd · V_svdᵀ              (5 Newton–Schulz steps, below)
    W ← W·(1 − lr·wd) − lr · 0.2·sqrt(max(A, B)) · O

NS5: X₀ = U/‖U‖_F (transposed so rows ≤ cols), X ← a·X + (b·XXᵀ + c·(XXᵀ)²)·X with
(a, b, c) = (3.4445, −4.7750, 2.0315). The quintic pushes every singular value into roughly
[0.7, 1.2] rather than exactly 1 — fast, and good enough for an update direction. It runs in bf16
by default (``ns_dtype``), as Muon was designed; on a CPU without bf16 matmul kernels its bf16
values are computed with fp32 matmuls (:func:`zeropower_via_newtonschulz5`).

Why 0.2·sqrt(max(A, B)): an orthogonalized [A, B] matrix has min(A, B) unit singular values, so
its RMS is 1/sqrt(max(A, B)); the factor sets the update RMS to 0.2, the typical AdamW update RMS,
so AdamW's lr and weight decay carry over and one lr serves both kinds of parameter.

Per-Head Muon: for Q/K/V projections U is cut into its head blocks (rows), each block is
orthogonalized on its own (one batched NS call) and the blocks are put back. The Moonlight scale
uses the **block's** shape [rows, B]: the point of the scale is an update RMS of 0.2, and the
concatenation of orthogonalized blocks has the RMS of one block, 1/sqrt(max(rows, B)); scaling with
the full shape would shrink (or inflate) per-head updates relative to every other matrix. Expert
stacks [E, out, in] are orthogonalized per expert the same way, scaled with [out, in].

AdamW (groups with ``use_muon=False``): decoupled weight decay, bias-corrected moments, same ``lr``.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor, nn

from k3.errors import ConfigError
from k3.model.mla import GatedMLA
from k3.model.stats import ForwardStats

__all__ = ["NS_COEFFS", "cpu_bf16_matmul_is_native", "zeropower_via_newtonschulz5", "orthogonalize", "Muon",
           "classify_param", "build_param_groups", "build_optimizer", "describe_param_groups",
           "qk_clip_", "QKClip"]

NS_COEFFS = (3.4445, -4.7750, 2.0315)


@functools.lru_cache(maxsize=None)
def cpu_bf16_matmul_is_native() -> bool:
    """Whether torch sends a CPU bf16 matmul to oneDNN's bf16 kernels (AVX-512 and newer, AMX).

    Elsewhere (an AVX2 machine) it runs a generic loop: 25-70x slower than the fp32 matmul of
    the same shape (measured on NS5's blocks, AMD EPYC AVX2, 2 threads)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _round_bf16(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16).float()


def _newton_schulz(G: Tensor, steps: int, dtype: torch.dtype, bf16_on_fp32: bool) -> Tensor:
    """NS5 in ``dtype``; with ``bf16_on_fp32`` the bf16 iteration's values through fp32 matmuls: every
    intermediate is rounded to bf16 where the bf16 iteration rounds it, and each product of bf16 values
    is exact in fp32 and summed in fp32, as a bf16 matmul with fp32 accumulation does (only the
    summation order can differ)."""
    a, b, c = NS_COEFFS
    r = _round_bf16 if bf16_on_fp32 else (lambda t: t)
    X = r(G.float()) if bf16_on_fp32 else G.to(dtype)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    X = r(X / r(r(X.norm(dim=(-2, -1), keepdim=True)) + 1e-7))
    fma = torch.addmm if X.dim() == 2 else torch.baddbmm       # beta·C + alpha·(A @ B) in one op
    for _ in range(steps):
        A = r(X @ X.mT)
        X = r(fma(X, r(fma(A, A, A, beta=b, alpha=c)), X, beta=a))   # a·X + (b·A + c·A²) X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def zeropower_via_newtonschulz5(G: Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> Tensor:
    """Approximate U Vᵀ of each matrix in G [..., m, n] (batched over leading dims).

    The iteration runs in bf16 by default on every device, as Muon's reference implementations do
    (the quintic only has to push the singular values into ~[0.7, 1.2]): on a CPU with oneDNN's
    bf16 kernels (AMX-bf16) a `small` optimizer step is 2.8× faster than in fp32, with the same
    training curve (docs/TRAINING_SPEED.md §6). On a CPU without them (AVX2) the same bf16 values
    are computed with fp32 matmuls (docs/TRAINING_SPEED.md §10). ``dtype`` overrides it (fp32 for
    an exact comparison)."""
    dtype = torch.bfloat16 if dtype is None else dtype
    emulate = dtype == torch.bfloat16 and G.device.type == "cpu" and not cpu_bf16_matmul_is_native()
    return _newton_schulz(G, steps, dtype, emulate)


def orthogonalize(U: Tensor, block_rows: int | None = None, steps: int = 5,
                  dtype: torch.dtype | None = None) -> tuple[Tensor, tuple[int, int]]:
    """NS5 of U per block; returns (O shaped like U, the [rows, cols] shape of one block).

    U [A, B] whole (block_rows None) or cut into A/block_rows head blocks; U [E, out, in] per expert.
    """
    if U.ndim == 3:
        blocks = U
    elif U.ndim == 2 and block_rows is not None:
        if U.size(0) % block_rows:
            raise ValueError(f"{U.size(0)} rows do not split into blocks of {block_rows}")
        blocks = U.reshape(U.size(0) // block_rows, block_rows, U.size(1))
    elif U.ndim == 2:
        blocks = U
    else:
        raise ValueError(f"Muon needs a 2-D matrix or a 3-D expert stack, got shape {tuple(U.shape)}")
    O = zeropower_via_newtonschulz5(blocks, steps, dtype).reshape(U.shape)
    return O, (blocks.size(-2), blocks.size(-1))


class Muon(torch.optim.Optimizer):
    """One optimizer for the whole model: Muon groups (``use_muon=True``) and AdamW groups.

    Group keys: ``lr``, ``weight_decay``, ``use_muon``, ``block_rows`` (per-head block height or
    None), ``momentum``, ``nesterov``, ``ns_steps``, ``betas``, ``eps``, and informative ``name`` /
    ``param_names``. State per parameter: ``momentum_buffer`` (Muon) or ``step``, ``exp_avg``,
    ``exp_avg_sq`` (AdamW) — all in ``state_dict()``, so a resumed run continues bit-exactly.
    """

    def __init__(self, params: Iterable, lr: float = 2e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 ns_dtype: torch.dtype | None = None):
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(f"bad Muon hyper-parameters lr={lr}, wd={weight_decay}, "
                             f"momentum={momentum}")
        defaults = dict(lr=lr, weight_decay=weight_decay, use_muon=True, block_rows=None,
                        momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, betas=betas,
                        eps=eps)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(g)
            u = g.add(buf, alpha=mu) if group["nesterov"] else buf
            o, (rows, cols) = self._orthogonalize(u, group)
            p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * 0.2 * math.sqrt(max(rows, cols)))

    def _orthogonalize(self, u: Tensor, group: dict[str, Any]) -> tuple[Tensor, tuple[int, int]]:
        """NS5 of one momentum update (per head block / per expert); the seam a sharded optimizer
        overrides (k3.train.distributed gathers a sharded matrix here)."""
        return orthogonalize(u, group["block_rows"], group["ns_steps"], self.ns_dtype)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
            p.mul_(1 - lr * wd)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))


# ------------------------------------------------------------------------ parameter split
_LAYER_ATTN = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|q_b_proj|"
                         r"kv_b_proj)\.weight$")
_EXPERTS = re.compile(r"(?:^|\.)experts\.w[123]$")
_ADAMW_DECAY = re.compile(r"(embed_tokens|lm_head|shared_head\.head|_conv1d)\.weight$|"
                          r"(?:^|\.)gate\.weight$")
_ADAMW_NO_DECAY = re.compile(r"norm[^.]*\.weight$|\.bias$|_res_proj\.weight$|"
                             r"(?:^|\.)(A_log|dt_bias)$")
_MODES = {"per_head": "per_head", True: "full", "full": "full", False: "adamw", "adamw": "adamw"}


def _head_rows(name: str, config) -> int | None:
    """Rows per head of a Q/K/V projection named ``name``; None if it is not one."""
    m = _LAYER_ATTN.search(name)
    if m is None:
        return None
    layer, proj = int(m.group(1)), m.group(2)
    is_kda = layer < config.num_hidden_layers and config.is_kda_layer(layer)
    if is_kda:
        return config.linear_attn_config.head_dim if proj in ("q_proj", "k_proj", "v_proj") else None
    if proj in ("q_b_proj", "q_proj"):
        return config.qk_nope_head_dim + config.qk_rope_head_dim
    if proj == "kv_b_proj":
        return config.qk_nope_head_dim + config.v_head_dim
    return None


def classify_param(name: str, p: Tensor, config=None, muon: bool | str = "per_head"
                   ) -> tuple[str, int | None]:
    """Which group ``name`` belongs to: (kind, block_rows).

    kinds: ``muon`` (2-D hidden matrix), ``muon_per_head`` (Q/K/V in per-head mode),
    ``muon_experts`` (3-D ``experts.w1/w2/w3``), ``adamw`` (embeddings, lm_head, conv weights,
    router ``gate.weight``: with weight decay), ``adamw_no_decay`` (norms, biases, AttnRes
    pseudo-queries, A_log, dt_bias, any other 0/1-D tensor).

    The router stays on AdamW: its rows are per-expert scoring directions whose norms set the
    sigmoid scores; orthogonalizing the update would equalize how fast experts' scores move,
    and a [E, H] matrix is small, so Muon buys nothing there.
    """
    mode = _MODES.get(muon)
    if mode is None:
        raise ValueError(f"muon must be 'per_head', True/'full' or False/'adamw', got {muon!r}")
    if _ADAMW_NO_DECAY.search(name) or p.ndim < 2:
        return "adamw_no_decay", None
    if _ADAMW_DECAY.search(name):
        return "adamw", None
    if mode == "adamw":
        return "adamw", None
    if p.ndim == 3 and _EXPERTS.search(name):
        return "muon_experts", None
    if p.ndim != 2:
        return "adamw", None
    if mode == "per_head":
        if config is None:
            raise ValueError("per-head Muon needs the model config (head sizes)")
        rows = _head_rows(name, config)
        if rows is not None:
            if p.size(0) % rows:
                raise ValueError(f"{name}: {p.size(0)} rows do not split into heads of {rows}")
            return "muon_per_head", rows
    return "muon", None


def build_param_groups(model: nn.Module, config=None, lr: float = 2e-3, weight_decay: float = 0.1,
                       muon: bool | str = "per_head") -> list[dict[str, Any]]:
    """Param groups for ``Muon``: one per (kind, block_rows), in a fixed order.

    ``muon``: ``'per_head'`` (Per-Head Muon, the K3 recipe), ``True``/``'full'`` (full-matrix
    Muon) or ``False``/``'adamw'`` (AdamW only) — the three ablation modes. ``config`` defaults
    to ``model.config``.
    """
    config = config if config is not None else getattr(model, "config", None)
    buckets: dict[tuple[str, int | None], list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            buckets.setdefault(classify_param(name, p, config, muon), []).append((name, p))
    order = {"muon": 0, "muon_per_head": 1, "muon_experts": 2, "adamw": 3, "adamw_no_decay": 4}
    groups = []
    for (kind, rows), items in sorted(buckets.items(), key=lambda kv: (order[kv[0][0]],
                                                                        kv[0][1] or 0)):
        groups.append(dict(
            params=[p for _, p in items], param_names=[n for n, _ in items],
            name=f"{kind}[rows={rows}]" if rows else kind, use_muon=kind.startswith("muon"),
            block_rows=rows, lr=lr, weight_decay=0.0 if kind == "adamw_no_decay" else weight_decay))
    return groups


def build_optimizer(model: nn.Module, config=None, lr: float = 2e-3, weight_decay: float = 0.1,
                    muon: bool | str = "per_head", **kwargs) -> Muon:
    """``Muon(build_param_groups(...), **kwargs)``."""
    return Muon(build_param_groups(model, config, lr, weight_decay, muon), lr=lr,
                weight_decay=weight_decay, **kwargs)


def describe_param_groups(groups: Iterable[Mapping[str, Any]] | torch.optim.Optimizer) -> str:
    """A table of the groups: optimizer, tensor count, numel, weight decay, first names."""
    if isinstance(groups, torch.optim.Optimizer):
        groups = groups.param_groups
    lines = [f"{'group':<26} {'opt':<6} {'tensors':>7} {'numel':>14} {'wd':>6}  examples"]
    total = 0
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        total += n
        names = g.get("param_names", [])
        ex = ", ".join(names[:2]) + (f", ... (+{len(names) - 2})" if len(names) > 2 else "")
        lines.append(f"{g.get('name', '?'):<26} {'muon' if g.get('use_muon') else 'adamw':<6} "
                     f"{len(g['params']):>7} {n:>14,} {g.get('weight_decay', 0):>6g}  {ex}")
    lines.append(f"{'total':<26} {'':<6} {'':>7} {total:>14,}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- QK-Clip
@torch.no_grad()
def qk_clip_(model: nn.Module, tau: float, max_logits_per_layer: Mapping[int, Any],
             config=None) -> dict[int, Tensor]:
    """Rescale MLA query/key weights in place so that no head's max attention logit exceeds τ.

    ``max_logits_per_layer``: {layer index: max pre-softmax score (softmax scale included)
    observed this step}, a scalar or one value per head [nh]. Per head, η = min(1, τ / S_max).
    The score is q_nope·k_nope + q_pe·k_pe, with k_pe shared by all heads (from
    ``kv_a_proj_with_mqa``), so η is split as: q_nope rows (``q_b_proj``) and k_nope rows
    (``kv_b_proj``) × sqrt(η), q_pe rows × η, shared k_pe untouched; both terms, hence every
    logit of the head, scale by exactly η. v rows are untouched. Returns {layer: η [nh]}.
    """
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("qk_clip_ needs the model config")
    nh, nope, rope, vd = (config.num_attention_heads, config.qk_nope_head_dim,
                          config.qk_rope_head_dim, config.v_head_dim)
    params = dict(model.named_parameters())
    out = {}
    for layer, smax in max_logits_per_layer.items():
        smax = torch.as_tensor(smax, dtype=torch.float32).reshape(-1).expand(nh)
        eta = (tau / smax.clamp_min(1e-30)).clamp(max=1.0)
        out[layer] = eta
        if bool((eta >= 1).all()):
            continue
        q_name = kv_name = None
        for name in params:
            m = _LAYER_ATTN.search(name)
            if m and int(m.group(1)) == layer:
                if m.group(2) in ("q_b_proj", "q_proj"):
                    q_name = name
                elif m.group(2) == "kv_b_proj":
                    kv_name = name
        if q_name is None or kv_name is None:
            raise ValueError(f"qk_clip_: layer {layer} has no MLA q/kv_b projections")
        q = params[q_name].view(nh, nope + rope, -1)
        kv = params[kv_name].view(nh, nope + vd, -1)
        s = eta.sqrt().to(q.dtype)[:, None, None]
        q[:, :nope].mul_(s)
        q[:, nope:].mul_(eta.to(q.dtype)[:, None, None])
        kv[:, :nope].mul_(s.to(kv.dtype))
    return out


class QKClip:
    """QK-Clip in the training loop (SPEC §5): cap every MLA head's max logit at τ.

    Per optimizer step: ``begin_step()``; after each micro-batch forward ``collect(stats)`` takes
    each MLA layer's max logits [nh] from the ForwardStats that forward filled (asked with
    ``ForwardStats(max_logits=True)``; max over the micro-batches); after ``optimizer.step()``
    ``apply()`` rescales the q/k weights with :func:`qk_clip_` (η = min(1, τ / S_max) per head,
    measured in this step's forward, applied to the updated weights as MuonClip does) and returns
    {"max_logit": largest S_max before the clip, "clipped_heads": heads with η < 1}.
    """

    def __init__(self, model: nn.Module, tau: float, config=None):
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
            raise ConfigError(f"qk_clip must be a threshold > 0, got {tau!r}")
        self.model, self.tau = model, float(tau)
        self.config = config if config is not None else getattr(model, "config", None)
        self.layers = [m for m in model.modules() if isinstance(m, GatedMLA)]
        if not self.layers:
            raise ConfigError("qk_clip: the model has no MLA layers to clip")
        self._max: dict[int, Tensor] = {}

    def begin_step(self) -> None:
        self._max = {}

    def collect(self, stats: ForwardStats) -> None:
        """Take the per-head max logits of one micro-batch's forward (its ForwardStats)."""
        for m in self.layers:
            s = stats.max_logits.get(m)
            if s is None:
                raise RuntimeError(f"QKClip: max logits of MLA layer {m.layer_idx} missing; run the forward "
                                   "with stats=ForwardStats(max_logits=True)")
            old = self._max.get(m.layer_idx)
            self._max[m.layer_idx] = s if old is None else torch.maximum(old, s)

    def apply(self) -> dict[str, float]:
        etas = qk_clip_(self.model, self.tau, self._max, self.config)
        smax = max(float(s.max()) for s in self._max.values()) if self._max else float("nan")
        clipped = sum(int((e < 1).sum()) for e in etas.values())
        self.begin_step()
        return {"max_logit": smax, "clipped_heads": clipped}
