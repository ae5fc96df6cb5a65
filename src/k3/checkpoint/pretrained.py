"""Model-level checkpoint calls: save a K3ForCausalLM, load into one, build one from a directory.

Packed MXFP4 inference (SPEC §3.7): ``from_pretrained(..., keep_packed=True)`` builds the model
with ``PackedMXFP4Experts`` in place of every ``RoutedExperts`` and copies the checkpoint's
``.weight_packed`` / ``.weight_scale`` bytes straight into them (nothing is dequantized at load,
experts stay at 4.25 bits per weight in memory). The default, ``keep_packed=None``, keeps them
packed exactly when config.json declares compressed-tensors ``mxfp4-pack-quantized`` (what
``k3 quantize`` writes and the release ships); a checkpoint with packed tensors but no such
declaration is dequantized, as before. ``keep_packed=False`` always dequantizes into float experts;
``keep_packed=True`` on a float checkpoint loads it and quantizes the experts once, from the
stored precision.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from k3.checkpoint.load import CheckpointFiles, checkpoint_dtype, plan_load, scan, stream_into
from k3.checkpoint.names import (expected_tensors, holds_packed_experts, is_mxfp4_quantization, storage_dtype,
                                 stores_packed_experts)
from k3.checkpoint.save import save_state_dict
from k3.config import K3Config
from k3.model.moe import RoutedExperts
from k3.model.mx_experts import PackedMXFP4Experts, pack_routed_experts

__all__ = ["save_pretrained", "load_checkpoint", "from_pretrained"]

log = logging.getLogger("k3.checkpoint")


def save_pretrained(model: nn.Module, directory: str | os.PathLike, max_shard_size: int | str = "2GB",
                    dtype: torch.dtype | None = None) -> list[str]:
    """Save ``model`` (a K3ForCausalLM) in k3's layout; see :func:`k3.checkpoint.save.save_state_dict`."""
    if any(t.is_meta for t in model.state_dict().values()):
        raise ValueError("cannot save a model whose tensors are on the meta device")
    return save_state_dict(model.state_dict(), model.config, directory, max_shard_size, dtype)


def _destinations(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict(keep_vars=True)
    expected = expected_tensors(model.config, packed=holds_packed_experts(sd))
    missing = sorted(set(expected) - set(sd))
    if missing:  # a k3 bug, not a user error: names.py and the model disagree
        raise AssertionError(f"model has no parameters {missing[:5]} that names.expected_tensors lists")
    return {n: sd[n] for n in expected}


def load_checkpoint(model: nn.Module, directory: str | os.PathLike, strict: bool = True) -> list[str]:
    """Load a checkpoint into ``model`` in place; return the unexpected tensor names (lenient mode).

    Everything is validated against the model before the first byte is copied. A model on the
    meta device is only validated (no tensor data is read).
    """
    files = scan(directory)
    config: K3Config = model.config
    if files.config.fingerprint() != config.fingerprint():
        log.info("%s: config.json differs from the model's config; loading by tensor shapes",
                 files.directory)
    plan = plan_load(files, config, strict, packed=holds_packed_experts(model.state_dict()))
    dest = _destinations(model)
    if not any(t.is_meta for t in dest.values()):
        stream_into(plan, {n: t.data for n, t in dest.items()}, config)
    return plan.unexpected


class _SkipInit(TorchFunctionMode):
    """Makes in-place ops (the initialisers: ``normal_``, ``copy_``, ...) no-ops while a model is
    built only to be overwritten by a checkpoint: storage is allocated but never written.
    """

    _KEEP = {"requires_grad_", "resize_", "set_", "share_memory_", "retain_grad_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        t = args[0] if args else kwargs.get("tensor")
        if name.endswith("_") and not name.endswith("__") and name not in self._KEEP and isinstance(t, torch.Tensor):
            return t
        return func(*args, **kwargs)


def _empty_model(cls: type, config: K3Config, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``cls(config)`` with uninitialised storage in the checkpoint dtype policy (no random init)."""
    with torch.device(device), _SkipInit():
        model = cls(config)
    if any(m._non_persistent_buffers_set for m in model.modules()):
        # Non-persistent buffers are computed at construction and not in checkpoints: build for real.
        with torch.device(device):
            model = cls(config)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        want = storage_dtype(name, dtype) if t.is_floating_point() else t.dtype
        if t.dtype != want:  # fresh storage, so the uninitialised pages are never touched
            t.data = torch.empty(t.shape, dtype=want, device=t.device)
    return model


def _with_empty_packed_experts(model: nn.Module) -> nn.Module:
    """Swap every RoutedExperts for a PackedMXFP4Experts of the same shape (zero bytes, to be filled
    from a checkpoint); the float expert storage is released."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, RoutedExperts):
                with torch.device(child.w1.device):
                    packed = PackedMXFP4Experts(child.num_experts, child.dim, child.intermediate, child.act)
                setattr(parent, child_name, packed)
    return model


def declares_packed(files: CheckpointFiles) -> bool:
    """config.json declares compressed-tensors ``mxfp4-pack-quantized`` (the keep_packed default)."""
    return is_mxfp4_quantization(files.quantization)


def from_pretrained(cls: type, directory: str | os.PathLike, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None, strict: bool = True,
                    keep_packed: bool | None = None) -> nn.Module:
    """Build ``cls`` (K3ForCausalLM) from a checkpoint directory of any supported layout.

    ``dtype`` None keeps the checkpoint's dtype (fp32-kept tensors stay fp32); ``device="meta"``
    validates the checkpoint and returns a shape-only model without reading tensor data.
    ``keep_packed``: routed experts as ``PackedMXFP4Experts`` (see the module docstring); None =
    whether config.json declares ``mxfp4-pack-quantized``.
    """
    files = scan(directory)
    device = torch.device(device or "cpu")
    dtype = dtype or checkpoint_dtype(files)
    if keep_packed is None:
        keep_packed = declares_packed(files)
    direct = keep_packed and stores_packed_experts(files.tensors)  # bytes copied as stored
    plan = plan_load(files, files.config, strict, packed=direct)  # fail before allocating anything
    model = _empty_model(cls, files.config, dtype, device)
    if direct:
        _with_empty_packed_experts(model)
    if device.type != "meta":
        stream_into(plan, {n: t.data for n, t in _destinations(model).items()}, files.config)
    if keep_packed and not direct:
        if device.type == "meta":
            _with_empty_packed_experts(model)
        else:
            pack_routed_experts(model)  # quantize the float experts just loaded
    return model
