"""fp32 matmul over panel-packed weights for decode-sized batches (the C kernel beside this file).

A decode step multiplies a few rows (1 to a few dozen) by each weight, so it is bound by reading
the weights. MKL's sgemm streams them well for one row but about half as fast from 4 rows on, and
the MoE's per-expert products cost one dispatch each. ``PackedMatrix`` stores ``W [K, N]`` (or a
stack ``[E, K, N]``) as column panels and multiplies with one kernel call:

* ``mm(x, res, norm_c)``: ``res + n(x) @ W`` (``res`` may be a row ``[N]``, broadcast; ``n`` the
  row norm of the decode step, or none);
* ``rows_mm(x, rows, experts)``: slot ``s`` gets ``x[rows[s]] @ W[experts[s]]`` (the routed experts
  of all tokens in one call).

Each output element is one FMA chain over ``k`` in order, so a row's result never depends on the
other rows of the batch. The kernel is part of ``k3.ops.cpu_kernels`` (compiled on first use).
"""

from __future__ import annotations

import torch

from k3.ops import cpu_kernels

__all__ = ["NR", "PackedMatrix", "check_rows"]

NR = 32   # panel width (columns), as in packed_mm.c


def check_rows(x: torch.Tensor, K: int, what: str, M: int | None = None) -> None:
    """x must be fp32 CPU rows [M, K] (any M when None) with unit column stride, as the kernels read
    them; else a ValueError naming ``what``."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != K or \
            (M is not None and x.shape[0] != M) or (x.stride(1) != 1 and x.shape[1] > 1):
        raise ValueError(f"{what}: expected fp32 CPU rows [{'M' if M is None else M}, {K}] with unit column "
                         f"stride, got {x.dtype} {x.device.type} {tuple(x.shape)} strides {x.stride()}")


class PackedMatrix:
    """``w [K, N]`` or ``[E, K, N]`` (fp32, any strides) copied into panels ``[E, ceil(N/NR), K, NR]``."""

    __slots__ = ("E", "K", "N", "data", "_lib")

    def __init__(self, w: torch.Tensor):
        self._lib = cpu_kernels.library()
        if w.dtype != torch.float32 or w.dim() not in (2, 3) or w.numel() == 0:
            raise ValueError(f"PackedMatrix: expected fp32 [K, N] or [E, K, N] with no empty dimension, got "
                             f"{w.dtype} {tuple(w.shape)}")
        w = w.detach().reshape(-1, *w.shape[-2:])
        E, K, N = w.shape
        np_ = -(-N // NR)
        data = torch.zeros(E, K, np_ * NR)
        data[:, :, :N] = w
        self.E, self.K, self.N = E, K, N
        self.data = data.view(E, K, np_, NR).permute(0, 2, 1, 3).contiguous()

    def unpacked(self) -> torch.Tensor:
        """The matrix back as ``[E, K, N]`` (a copy; for tests and inspection)."""
        E, np_, K, _ = self.data.shape
        return self.data.permute(0, 2, 1, 3).reshape(E, K, np_ * NR)[:, :, :self.N].contiguous()

    def mm(self, x: torch.Tensor, res: torch.Tensor | None = None, norm_c: float | None = None) -> torch.Tensor:
        """``n(x) @ W`` (``res + n(x) @ W`` when given: ``[M, N]`` or a row ``[N]``); a single matrix
        only. ``norm_c``: n(x) = x / sqrt(Σ x² + norm_c) per row (the decode step's RMSNorm, whose
        weight and √K are in W), else n(x) = x."""
        if self.E != 1:
            raise ValueError(f"PackedMatrix.mm: this is a stack of {self.E} matrices; use rows_mm")
        check_rows(x, self.K, "PackedMatrix.mm")
        if norm_c is not None and not norm_c >= 0:
            raise ValueError(f"PackedMatrix.mm: norm_c must be >= 0, got {norm_c}")
        M = x.shape[0]
        y = torch.empty(M, self.N)
        if res is not None:
            y.copy_(res)
        rc = self._lib.k3_packed_mm(x.data_ptr(), x.stride(0), M, self.K, self.data.data_ptr(), self.N,
                               y.data_ptr(), self.N, int(res is not None), -1.0 if norm_c is None else norm_c,
                               torch.get_num_threads())
        if rc:
            raise MemoryError("PackedMatrix.mm: no memory for the kernel's work lists")
        return y

    def rows_mm(self, x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``[S, N]``: slot ``s`` is ``x[rows[s]] @ W[experts[s]]`` (``rows``, ``experts``: int64 ``[S]``)."""
        check_rows(x, self.K, "PackedMatrix.rows_mm")
        rows, experts = rows.reshape(-1), experts.reshape(-1)
        if rows.dtype != torch.int64 or experts.dtype != torch.int64 or rows.shape != experts.shape:
            raise ValueError(f"PackedMatrix.rows_mm: rows and experts must be int64 of one length, got "
                             f"{rows.dtype} {tuple(rows.shape)} and {experts.dtype} {tuple(experts.shape)}")
        rows, experts = rows.contiguous(), experts.contiguous()
        S = rows.shape[0]
        y = torch.empty(S, self.N)
        rc = self._lib.k3_packed_rows_mm(x.data_ptr(), x.stride(0), x.shape[0], rows.data_ptr(), experts.data_ptr(),
                                    S, self.K, self.data.data_ptr(), self.N, self.E, y.data_ptr(),
                                    torch.get_num_threads())
        if rc == 1:
            raise IndexError(f"PackedMatrix.rows_mm: a row index is outside [0, {x.shape[0]})")
        if rc == 2:
            raise IndexError(f"PackedMatrix.rows_mm: an expert index is outside [0, {self.E})")
        if rc:
            raise MemoryError("PackedMatrix.rows_mm: no memory for the kernel's work lists")
        return y
