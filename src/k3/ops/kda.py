"""Kimi Delta Attention math (SPEC §3.1): gate, L2 norm, and the gated delta rule two ways.

Per head, with state S ∈ R^{K×V} (fp32) and per-token q_t, k_t ∈ R^K, v_t ∈ R^V, log-decay
g_t ∈ R^K (g_t ≤ 0) and write strength β_t:

    S ← diag(exp g_t) S
    S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ
    o_t = Sᵀ (scale · q_t)                     (o_t reads the updated S)

`recurrent_kda` runs that loop token by token (decode). `chunk_kda` runs it over a sequence
(training, prefill): on the CPU as the per-token rule in C (forward and backward), elsewhere in
chunks of C tokens. Inside a chunk, with G_i = Σ_{s≤i} g_s (cumulative
log-decay from the chunk start, per key channel), S_0 the state entering the chunk and the
pseudo-values u_i = β_i (v_i − S'_iᵀ k_i) (S'_i: state after token i's decay, before its write):

    A_ij = Σ_d k_id k_jd e^{G_id − G_jd}   (j < i)        P_ij = Σ_d q_id k_jd e^{G_id − G_jd}   (j ≤ i)
    (I + diag(β) A) U = diag(β) (V − (K ⊙ e^G) S_0)      (unit lower-triangular: the WY/UT form)
    O   = (Q ⊙ e^G) S_0 + P U
    S_C = diag(e^{G_C}) S_0 + (K ⊙ e^{G_C − G})ᵀ U

Everything except the S_0 terms is independent of the state, so all chunks are solved at once and
only S_{n+1} = M_n S_n + Z_n is scanned (T/C small matmuls). On the CPU `chunk_kda` runs the
recurrence itself in C instead (`_scan_c`): about 4·K·V multiply-adds per token and head forward,
with the state in the cache, which beats the chunked form's many small matmuls there; its
backward keeps the state every C tokens, recomputes a chunk's per-token states from it and runs
the chain rule token by token in reverse (``kda_scan.c`` gives the formulas).

Decay factors e^{G_i − G_j} are never materialised as a [C, C, K] tensor for off-diagonal
sub-chunk blocks: they factorise as e^{G_i − G_r} e^{G_r − G_j} around a row r with j < r ≤ i, so
both factors are ≤ 1 (no overflow for any gate) and the block is one matmul. Diagonal sub-chunk
blocks (sub = 16 tokens) factorise around their first row, e^{G_i − G_r} · e^{G_r − G_j}, where the
second factor is ≥ 1; that is safe when the caller guarantees g ≥ g_lower_bound with
|g_lower_bound| · (sub − 1) ≤ 80 (K3's lb = −5: 75), so both factors are normal fp32 numbers.
Without such a bound (unbounded softplus gates, ``g_lower_bound=None``) the diagonal blocks are
materialised exactly as [sub, sub, K] decays. The choice is static (from the argument, never from
the data), so ``chunk_kda`` never synchronises with the device. Log-decay
differences are clamped at −30 before exp: every such factor multiplies O(1) values, so the
absolute error is ≤ e^−30 ≈ 1e-13 (far below fp32 resolution), while products of two factors stay
normal fp32 numbers. Entry points (the ``k3`` CLI, the trainer) also call
``torch.set_flush_denormal(True)``: decayed fp32 values otherwise turn into denormals and CPU
matmuls slow down ~100×. Importing this module changes no global state.

Layout (fla's convention): q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
state [B, H, K, V] fp32. q, k are L2-normalised by the caller (`l2_normalize`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3.ops import cpu_kernels
from k3.ops.backend import use_c
from k3.ops.norm import l2_normalize  # noqa: F401  (re-exported: q, k are normalized with it)

__all__ = ["l2_normalize", "kda_gate", "recurrent_kda", "chunk_kda"]


_LOG_DECAY_FLOOR = -30.0   # e^-30 ≈ 1e-13: products of two such factors stay normal fp32
_SAFE_FACTOR_SPAN = 80.0   # max |G_i − G_r| for the factorised diagonal blocks (e^±80 normal fp32)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None = -5.0) -> torch.Tensor:
    """Per-channel log-decay g [B, T, H, D] fp32 from f [B, T, H, D], A_log [H], dt_bias [H·D].

    lower_bound lb:    g = lb · sigmoid(exp(A_log[h]) · (f + dt_bias))     ∈ (lb, 0)
    lower_bound None:  g = −exp(A_log[h]) · softplus(f + dt_bias)         ∈ (−∞, 0)
    """
    if f.dim() != 4:
        raise ValueError(f"kda_gate: f must be [B, T, H, D], got shape {tuple(f.shape)}")
    H, D = f.shape[2], f.shape[3]
    if A_log.numel() != H:
        raise ValueError(f"kda_gate: A_log must have H={H} elements, got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != H * D:
        raise ValueError(f"kda_gate: dt_bias must have H*D={H * D} elements, got shape {tuple(dt_bias.shape)}")
    a = A_log.float().reshape(H, 1).exp()
    x = f.float() + dt_bias.float().reshape(H, D)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def _fp32_island(fn):
    """Run ``fn`` with autocast off: the recurrence and its state are fp32 under bf16 autocast."""
    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, *args, **kwargs)
    return wrapper


def _check(q, k, v, g, beta, initial_state, name: str) -> None:
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    for t_name, t in (("k", k), ("g", g)):
        if t.shape != q.shape:
            raise ValueError(f"{name}: {t_name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{name}: v must be [B, T, H, V] with B, T, H = {tuple(q.shape[:3])}, "
                         f"got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"{name}: beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    if initial_state is not None:
        B, _, H, K = q.shape
        want = (B, H, K, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"{name}: initial_state must be [B, H, K, V] = {want}, "
                             f"got {tuple(initial_state.shape)}")


@_fp32_island
def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (the decode path). Shapes as in the module docstring.

    Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 or None).
    """
    _check(q, k, v, g, beta, initial_state, "recurrent_kda")
    if q.is_cuda and _fla_available():
        return _fla_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    # [B, H, T, *] so each step reads a [B, H, *] slice.
    q32 = (q.float() * scale).transpose(1, 2)
    k32, v32 = k.float().transpose(1, 2), v.float().transpose(1, 2)
    decay = g.float().transpose(1, 2).exp().unsqueeze(-1)                 # [B, H, T, K, 1]
    b32 = beta.float().transpose(1, 2).unsqueeze(-1)                      # [B, H, T, 1]
    S = q32.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    if T == 0:
        return v.new_zeros(B, 0, H, V), (S if output_final_state else None)
    outs = []
    for t in range(T):
        S = S * decay[:, :, t]
        kt = k32[:, :, t].unsqueeze(-2)                                   # [B, H, 1, K]
        u = b32[:, :, t].unsqueeze(-1) * (v32[:, :, t].unsqueeze(-2) - kt @ S)   # [B, H, 1, V]
        S = S + kt.transpose(-1, -2) @ u
        outs.append(q32[:, :, t].unsqueeze(-2) @ S)                       # [B, H, 1, V]
    o = torch.cat(outs, dim=2).transpose(1, 2).to(v.dtype)
    return o, (S if output_final_state else None)


def _decay(x: torch.Tensor) -> torch.Tensor:
    """exp of a log-decay difference G_i − G_j with j ≤ i, clamped below (no denormals).

    No upper clamp is needed: g ≤ 0 makes the fp32 cumulative sum G non-increasing (each
    sequential step adds a value ≤ 0, and round-to-nearest cannot make that increase), so every
    such difference is ≤ 0 exactly, and a one-sided clamp has a one-comparison backward."""
    return x.clamp(min=_LOG_DECAY_FLOOR).exp_()   # in place on clamp's fresh output


def _bmm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, d] @ b[..., n, d]ᵀ -> [..., m, n] as one bmm on flattened batches (equal leading dims).

    ``a @ b.mT`` on >3-D tensors copies the transposed operand to a contiguous one first; bmm takes the
    transposed layout as it is."""
    lead = a.shape[:-2]
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]).transpose(1, 2))
    return out.view(*lead, a.shape[-2], b.shape[-2])


def _diag_halving(xs: torch.Tensor, ks: torch.Tensor, Gs: torch.Tensor) -> torch.Tensor:
    """Diagonal sub-chunk blocks for any gate (no bound), by recursive halving; sub a power of two.

    xs [..., ns, 2, s, K] (q rows, k rows), ks, Gs [..., ns, s, K] -> [..., ns, 2, s, s] holding
    Σ_d x_id k_jd e^{G_id − G_jd} for j ≤ i (entries above the diagonal are 0). A block of size 2h
    is [[D_top, 0], [L, D_bottom]]: its lower-left h×h part factorises around the bottom half's
    first row m (j < m ≤ i), e^{G_i − G_m} · e^{G_m − G_j}, both factors ≤ 1 (clamped like every
    decay), so L is one batched matmul; the two diagonal halves recurse down to 1×1 blocks,
    x_i · k_i (e^0 = 1). log2(s) matmul levels instead of an [s, s, K] elementwise tensor.
    """
    lead, (s, K) = xs.shape[:-4], xs.shape[-2:]
    ns = xs.shape[-4]
    D = (xs * ks.unsqueeze(-3)).sum(-1).reshape(*lead, ns, 2, s, 1, 1)          # 1×1 blocks
    h = 1
    while h < s:
        nb = s // (2 * h)                                                      # blocks of size 2h
        G2 = Gs.reshape(*lead, ns, nb, 2, h, K)
        ref = G2[..., 1, :1, :]                                                # [..., ns, nb, 1, K]
        x2 = xs.reshape(*lead, ns, 2, nb, 2, h, K)[..., 1, :, :]              # bottom halves
        left = (x2 * _decay(G2[..., 1, :, :] - ref).unsqueeze(-4)).movedim(-4, -3)  # [.., ns, nb, 2, h, K]
        right = ks.reshape(*lead, ns, nb, 2, h, K)[..., 0, :, :] * _decay(ref - G2[..., 0, :, :])
        L = _bmm_nt(left.flatten(-3, -2), right).unflatten(-2, (2, h)).movedim(-3, -4)  # [.., ns, 2, nb, h, h]
        D = D.reshape(*lead, ns, 2, nb, 2, h, h)
        top = torch.cat([D[..., 0, :, :], torch.zeros_like(L)], dim=-1)
        bottom = torch.cat([L, D[..., 1, :, :]], dim=-1)
        D = torch.cat([top, bottom], dim=-2)                                   # [..., ns, 2, nb, 2h, 2h]
        h *= 2
    return D.reshape(*lead, ns, 2, s, s)


def _score_blocks(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int, factor_diag: bool):
    """Sub-chunk blocks of P and A for q, k, G [..., C, K] (decays applied).

    Returns (diag [..., ns, 2, sub, sub], off) where diag[:, :, 0] / diag[:, :, 1] are the masked
    diagonal blocks of P (j ≤ i) / A (j < i) and off[I − 1] [..., 2, sub, I·sub] is row block I's
    part left of its diagonal block (P rows, then A rows), I = 1 .. ns − 1.
    """
    C, K = q.shape[-2], q.shape[-1]
    ns = C // sub
    lead = q.shape[:-2]
    Gs = G.reshape(*lead, ns, sub, K)
    ks = k.reshape(*lead, ns, sub, K)
    xs = torch.stack([q.reshape(*lead, ns, sub, K), ks], dim=-3)                  # [..., ns, 2, sub, K]
    # One left factor per row block, around its first row r: e^{G_i − G_r} ≤ 1 for i in the block.
    dG = Gs - Gs[..., :1, :]
    if factor_diag:
        # |G_i − G_r| ≤ (sub − 1)·max|g| ≤ 80: e^{±dG} are finite normal fp32 numbers, used unclamped.
        E = torch.exp(dG)
        left = xs * E.unsqueeze(-3)
        # exp(−dG), not 1 / E: the division's backward squares E (e^−160 underflows to 0).
        diag = _bmm_nt(left.flatten(-3, -2), ks * torch.exp(-dG))                  # [..., ns, 2·sub, sub]
        diag = diag.unflatten(-2, (2, sub))
    else:
        left = xs * _decay(dG).unsqueeze(-3)
        if sub & (sub - 1) == 0:
            diag = _diag_halving(xs, ks, Gs)
        else:   # sub not a power of two (odd chunk sizes): the [sub, sub, K] decays, materialised
            # all (i, j) pairs: j > i gives G_i − G_j > 0, clamped to 0 (masked out below)
            dec = (Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).clamp(_LOG_DECAY_FLOOR, 0.0).exp_()   # [.., ns, sub, sub, K]
            diag = (xs.unsqueeze(-2) * (dec * ks.unsqueeze(-3)).unsqueeze(-4)).sum(-1)
    tril = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()
    diag = diag * torch.stack([tril, tril.tril(-1)]).to(diag.dtype)
    # Off-diagonal blocks: row block I factorises around its first row r (all j < r ≤ i).
    # split / unbind rather than indexing: an indexed view's backward zero-fills a full-size gradient.
    off = []
    for blk, lb in enumerate(left.flatten(-3, -2).unbind(-3)[1:], start=1):     # lb [..., 2·sub, K]
        r = blk * sub
        right = k[..., :r, :] * _decay(G[..., r:r + 1, :] - G[..., :r, :])          # [..., r, K]
        off.append(_bmm_nt(lb, right).unflatten(-2, (2, sub)))
    return diag, off


def _assemble(diag: torch.Tensor, off: list[torch.Tensor], which: int) -> torch.Tensor:
    """[..., C, C] lower block-triangular matrix from `_score_blocks` (which: 0 = P, 1 = A)."""
    ns, sub = diag.shape[-4], diag.shape[-1]
    C = ns * sub
    if not torch.is_grad_enabled():   # inference: the blocks copied once into a zeroed matrix
        out = diag.new_zeros(*diag.shape[:-4], C, C)
        for blk, d in enumerate(diag.unbind(-3)[which].unbind(-3)):
            r = blk * sub
            if blk:
                out[..., r:r + sub, :r].copy_(off[blk - 1].unbind(-3)[which])
            out[..., r:r + sub, r:r + sub].copy_(d)
        return out
    rows = []
    for blk, d in enumerate(diag.unbind(-3)[which].unbind(-3)):
        parts = [] if blk == 0 else [off[blk - 1].unbind(-3)[which]]
        parts.append(d)
        if blk < ns - 1:
            parts.append(diag.new_zeros(*diag.shape[:-4], sub, C - (blk + 1) * sub))
        rows.append(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=-2)


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int,
                        factor_diag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, G: [..., C, K] -> (P [..., C, C] with j ≤ i, A [..., C, C] with j < i), decays applied."""
    diag, off = _score_blocks(q, k, G, sub, factor_diag)
    return _assemble(diag, off, 0), _assemble(diag, off, 1)


def _unit_lower_solve(diag_a: torch.Tensor, off_a: list[torch.Tensor], beta: torch.Tensor,
                      rhs: torch.Tensor) -> torch.Tensor:
    """Solve (I + diag(β) A) X = rhs by forward substitution over sub-chunk blocks.

    diag_a [..., ns, sub, sub], off_a[I − 1] [..., sub, I·sub] (A's blocks), beta [..., C, 1],
    rhs [..., C, R]. Diagonal blocks are inverted with one batched triangular solve, then applied
    and the off-diagonal blocks folded in by matmuls (fla's blockwise inverse, without forming it).
    """
    ns, sub = diag_a.shape[-3], diag_a.shape[-1]
    lead = diag_a.shape[:-3]
    bs = beta.reshape(*lead, ns, sub, 1)
    eye = torch.eye(sub, dtype=rhs.dtype, device=rhs.device)
    inv = torch.linalg.solve_triangular(bs * diag_a + eye, eye.expand(*lead, ns, sub, sub),
                                        upper=False, unitriangular=True)          # [..., ns, sub, sub]
    blocks = zip(rhs.split(sub, dim=-2), bs.unbind(-3), inv.unbind(-3))
    if not torch.is_grad_enabled():   # inference: the solved blocks are written into one buffer
        X = torch.empty_like(rhs)
        for blk, (r_blk, b_blk, inv_blk) in enumerate(blocks):
            r = blk * sub
            if blk:
                r_blk = r_blk - (b_blk * off_a[blk - 1]) @ X[..., :r, :]
            X[..., r:r + sub, :] = inv_blk @ r_blk   # not out=: a strided out loops over the batch
        return X
    xs = []
    for blk, (r_blk, b_blk, inv_blk) in enumerate(blocks):
        if blk:
            r_blk = r_blk - (b_blk * off_a[blk - 1]) @ torch.cat(xs, dim=-2)
        xs.append(inv_blk @ r_blk)
    return torch.cat(xs, dim=-2)


def _chunk_terms(qc, kc, vc, gc, bc, sub: int, factor_diag: bool):
    """Everything of a chunk that does not depend on the state entering it, for n chunks at once.

    qc (scaled), kc, gc [n, BH, C, K], vc [n, BH, C, V], bc [n, BH, C, 1] -> (o_intra [n, BH, C, V],
    q_eff [n, BH, C, K], Z [n, BH, K, V], M [n, BH, K, K]) with O = o_intra + q_eff S_n and
    S_{n+1} = M_n S_n + Z_n (module docstring). Chunks are independent: any split of the n
    chunks gives the same values.
    """
    V, K = vc.shape[-1], kc.shape[-1]
    G = gc.cumsum(-2)
    diag, off = _score_blocks(qc, kc, G, sub, factor_diag)
    P = _assemble(diag, off, 0)
    # (I + diag(β) A) [U0 | W] = diag(β) [V | K ⊙ e^G], so U = U0 − W S_0: one blockwise solve.
    decay_in = _decay(G)                                                   # e^{G_i}: chunk start -> i
    if torch.is_grad_enabled():
        rhs = torch.cat([vc, kc * decay_in], dim=-1) * bc
    else:   # the same products written in place of the concatenation
        rhs = torch.empty(*vc.shape[:-1], V + K, dtype=vc.dtype, device=vc.device)
        torch.mul(vc, bc, out=rhs[..., :V])
        torch.mul(kc * decay_in, bc, out=rhs[..., V:])
    UW = _unit_lower_solve(diag.unbind(-3)[1], [o.unbind(-3)[1] for o in off], bc, rhs)
    o_intra, PW = (P @ UW).split([V, K], dim=-1)                                # O = o_intra + q_eff S_0
    q_eff = qc * decay_in - PW
    G_last = G[..., -1:, :]
    k_tail = kc * _decay(G_last - G)                                       # k_j e^{G_C − G_j}, [.., C, K]
    Z, KW = (k_tail.mT @ UW).split([V, K], dim=-1)                        # S_{n+1} = M_n S_n + Z_n
    M = KW.neg()                                                           # M = diag(e^{G_C}) − KW
    M.diagonal(dim1=-2, dim2=-1).add_(_decay(G_last.squeeze(-2)))
    return o_intra, q_eff, Z, M


@_fp32_island
def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, chunk_size: int = 64,
              g_lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over a sequence (training / prefill); same signature and result as `recurrent_kda`.

    On the CPU the sequence goes through the recurrence in C (``kda_scan.c``, the custom op
    ``k3::kda_scan``: the per-token rule, one pass per token over a cached [K, V] state, heads in
    parallel), with a C backward under autograd that recomputes each ``chunk_size`` tokens from a
    kept state. On CUDA it is fla's kernel; elsewhere, or where the CPU kernels cannot be built,
    the chunked form of the module docstring. They agree to fp32 rounding (tested against the
    float64 recurrence).

    Any T (padded internally with k = 0, g = 0, β = 0 tokens, which leave the state unchanged).
    Differentiable w.r.t. q, k, v, g, beta and initial_state. g must be ≤ 0 (a log-decay).
    ``g_lower_bound``: a bound the caller guarantees (g ≥ it; KDA's ``gate_lower_bound``). It only
    picks the faster factorised diagonal blocks when |g_lower_bound| · (sub − 1) ≤ 80 (module
    docstring); None (no bound known) uses the exact materialised blocks. No host sync either way.
    """
    _check(q, k, v, g, beta, initial_state, "chunk_kda")
    if chunk_size < 1:
        raise ValueError(f"chunk_kda: chunk_size must be positive, got {chunk_size}")
    if q.is_cuda and _fla_available():
        return _fla_chunk(q, k, v, g, beta, scale, initial_state, output_final_state)
    if use_c("chunk_kda", q.device.type == "cpu"):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return _scan_c(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    return _chunked_kda(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, g_lower_bound)


@_fp32_island
def _chunked_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
                 g_lower_bound=None):
    """The chunked form of the module docstring (``chunk_kda``'s arguments, already checked)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    sub = 16 if C % 16 == 0 else C
    N = max(1, -(-T // C))
    pad = N * C - T

    def chunked(x: torch.Tensor) -> torch.Tensor:                          # [B, T, H, D] -> [N, BH, C, D]
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad)) if pad else x.float()
        return x.reshape(B, N, C, H, -1).permute(1, 0, 3, 2, 4).reshape(N, B * H, C, x.shape[-1])

    qc, kc, vc, gc = chunked(q) * scale, chunked(k), chunked(v), chunked(g)
    bc = chunked(beta.unsqueeze(-1))                                       # [N, BH, C, 1]
    factor_diag = g_lower_bound is not None and abs(g_lower_bound) * (sub - 1) <= _SAFE_FACTOR_SPAN
    if initial_state is None:
        S = qc.new_zeros(B * H, K, V)
    else:
        S = initial_state.float().reshape(B * H, K, V)
    o_intra, q_eff, Z, M = _chunk_terms(qc, kc, vc, gc, bc, sub, factor_diag)
    # unbind, not Z[n] / M[n]: each indexed view's backward would allocate a full-size zero
    # gradient (quadratic in N); unbind's backward stacks the N slice gradients once.
    states = []
    for Zn, Mn in zip(Z.unbind(0), M.unbind(0)):
        states.append(S)
        S = torch.baddbmm(Zn, Mn, S)
    states = torch.stack(states)
    # O = o_intra + q_eff S_n, one fused batched multiply-add over all chunks.
    o = torch.baddbmm(o_intra.reshape(N * B * H, C, V), q_eff.reshape(N * B * H, C, K),
                      states.reshape(N * B * H, K, V))
    o = o.reshape(N, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T].to(v.dtype)
    return o, (S.reshape(B, H, K, V) if output_final_state else None)


# --- fla dispatch (CUDA only) -------------------------------------------------------------------
# fla.ops.kda.chunk_kda / fused_recurrent_kda take the same layout and meaning as ours when called
# with their defaults use_gate_in_kernel=False (g is the natural-log decay, already activated, as
# returned by `kda_gate`), use_qk_l2norm_in_kernel=False (q, k already normalised) and
# use_beta_sigmoid_in_kernel=False (beta already in (0, 1)): q, k, g [B, T, H, K], v [B, T, H, V],
# beta [B, T, H], scale=None → K^-0.5, initial_state / final state [B, H, K, V] fp32 (K-first,
# state_v_first=False). fla's chunk size is its own (64); the result does not depend on it. fla
# returns o in q's dtype, so it is cast to v's dtype here like the torch path.
_FLA: object | None = None


def _scan_c(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size):
    """The CPU path: the recurrence over the whole sequence in one C call (``k3::kda_scan``), with
    its C backward when autograd needs one (states kept every ``chunk_size`` tokens)."""
    xs = [x.float().contiguous() for x in (q, k, v, g, beta)]
    S0 = None if initial_state is None else initial_state.float().contiguous()
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (*xs, S0) if x is not None)
    o, S, _ = _kda_scan_op(*xs, S0, float(scale), chunk_size if grad else 0)
    return o.to(v.dtype), (S if output_final_state else None)


@torch.library.custom_op("k3::kda_scan", mutates_args=(), device_types="cpu")
def _kda_scan_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None, scale: float, ckpt_chunk: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, T, H, V], final state [B, H, K, V], checkpoints [B, H, ceil(T / ckpt_chunk), K, V]: the
    state entering every ckpt_chunk tokens, for the backward; empty when ckpt_chunk is 0)."""
    _check(q, k, v, g, beta, initial_state, "k3::kda_scan")
    B, T, H, K = q.shape
    V = v.shape[-1]
    cpu_kernels.check_dense("k3::kda_scan", q=(q, (B, T, H, K)), k=(k, (B, T, H, K)), v=(v, (B, T, H, V)),
                            g=(g, (B, T, H, K)), beta=(beta, (B, T, H)),
                            **({} if initial_state is None else {"initial_state": (initial_state, (B, H, K, V))}))
    if ckpt_chunk < 0:
        raise ValueError(f"k3::kda_scan: ckpt_chunk must be >= 0, got {ckpt_chunk}")
    o, S = torch.empty(B, T, H, V), torch.empty(B, H, K, V)
    ckpt = torch.empty(B, H, -(-T // ckpt_chunk), K, V) if ckpt_chunk > 0 else torch.empty(0)
    rc = cpu_kernels.library().k3_kda_scan(
        B, T, H, K, V, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), scale,
        None if initial_state is None else initial_state.data_ptr(), o.data_ptr(), S.data_ptr(),
        ckpt.data_ptr() if ckpt_chunk > 0 else None, ckpt_chunk, torch.get_num_threads())
    if rc:
        raise MemoryError(f"chunk_kda: no memory for a [{K}, {V}] state")
    return o, S, ckpt


@_kda_scan_op.register_fake
def _(q, k, v, g, beta, initial_state, scale, ckpt_chunk):
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = -(-T // ckpt_chunk) if ckpt_chunk > 0 else 0
    return (q.new_empty(B, T, H, V), q.new_empty(B, H, K, V),
            q.new_empty(B, H, n, K, V) if ckpt_chunk > 0 else q.new_empty(0))


@torch.library.custom_op("k3::kda_scan_backward", mutates_args=(), device_types="cpu")
def _kda_scan_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ckpt: torch.Tensor, do: torch.Tensor, dS: torch.Tensor | None, scale: float, ckpt_chunk: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv, dg, dbeta, d initial_state) from do and the final state's dS (None: 0)."""
    _check(q, k, v, g, beta, None, "k3::kda_scan_backward")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if ckpt_chunk < 1:
        raise ValueError(f"k3::kda_scan_backward: ckpt_chunk must be >= 1, got {ckpt_chunk}")
    cpu_kernels.check_dense("k3::kda_scan_backward", q=(q, (B, T, H, K)), k=(k, (B, T, H, K)),
                            v=(v, (B, T, H, V)), g=(g, (B, T, H, K)), beta=(beta, (B, T, H)),
                            ckpt=(ckpt, (B, H, -(-T // ckpt_chunk), K, V)), do=(do, (B, T, H, V)),
                            **({} if dS is None else {"dS": (dS, (B, H, K, V))}))
    dq, dk, dg, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g), torch.empty_like(v)
    dbeta, dS0 = torch.empty_like(beta), torch.empty(B, H, K, V)
    rc = cpu_kernels.library().k3_kda_scan_bwd(
        B, T, H, K, V, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), scale,
        ckpt.data_ptr(), ckpt_chunk, do.data_ptr(), None if dS is None else dS.data_ptr(), dq.data_ptr(),
        dk.data_ptr(), dv.data_ptr(), dg.data_ptr(), dbeta.data_ptr(), dS0.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError(f"chunk_kda: no memory for the backward of {ckpt_chunk} tokens of [{K}, {V}] states")
    return dq, dk, dv, dg, dbeta, dS0


@_kda_scan_bwd_op.register_fake
def _(q, k, v, g, beta, ckpt, do, dS, scale, ckpt_chunk):
    B, _, H, K = q.shape
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), q.new_empty(B, H, K, v.shape[-1]))


def _kda_scan_setup(ctx, inputs, output):
    q, k, v, g, beta, initial_state, scale, ckpt_chunk = inputs
    ctx.save_for_backward(q, k, v, g, beta, output[2])
    ctx.scale, ctx.ckpt_chunk, ctx.has_initial = scale, ckpt_chunk, initial_state is not None


def _kda_scan_backward(ctx, do, dS, _dckpt):
    if ctx.ckpt_chunk <= 0:
        raise RuntimeError("k3::kda_scan was called with ckpt_chunk=0 (no checkpoints), so it has no "
                           "backward: call it through chunk_kda")
    q, k, v, g, beta, ckpt = ctx.saved_tensors
    do = torch.zeros(v.shape) if do is None else do.float().contiguous()
    dS = None if dS is None else dS.float().contiguous()
    dq, dk, dv, dg, dbeta, dS0 = _kda_scan_bwd_op(q, k, v, g, beta, ckpt, do, dS, ctx.scale, ctx.ckpt_chunk)
    return dq, dk, dv, dg, dbeta, (dS0 if ctx.has_initial else None), None, None


_kda_scan_op.register_autograd(_kda_scan_backward, setup_context=_kda_scan_setup)


def _fla_available() -> bool:
    global _FLA
    if _FLA is None:
        try:
            from fla.ops import kda as fla_kda  # noqa: PLC0415
            _FLA = fla_kda
        except Exception:  # noqa: BLE001 - any import failure means "use the torch path"
            _FLA = False
    return _FLA is not False


def _fla_call(fn, q, k, v, g, beta, scale, initial_state, output_final_state):
    o, state = fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
                  use_gate_in_kernel=False)
    return o.to(v.dtype), (state if output_final_state else None)


def _fla_chunk(q, k, v, g, beta, scale, initial_state, output_final_state):
    return _fla_call(_FLA.chunk_kda, q, k, v, g, beta, scale, initial_state, output_final_state)


def _fla_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state):
    return _fla_call(_FLA.fused_recurrent_kda, q, k, v, g, beta, scale, initial_state, output_final_state)
