"""Model-level checkpoint calls, the user entry points: ``save_pretrained(model, dir)``,
``load_checkpoint(model, dir)`` (in place) and ``from_pretrained(dir)`` (builds a K3ForCausalLM).

They live here, not as methods of ``K3ForCausalLM``, so ``k3.model`` never imports
``k3.checkpoint`` (the model knows nothing of files). ``k3.checkpoint.from_pretrained`` and
``k3.checkpoint.save_pretrained`` replace the former ``K3ForCausalLM.from_pretrained`` /
``model.save_pretrained`` methods.

Every load verifies the shards' sha256 first (``verify=False`` skips it; see ``load.scan``).

Native vision: the three calls also take a ``K3VLForConditionalGeneration`` (``from_pretrained(dir,
model_class=K3VLForConditionalGeneration)``): the release's multimodal layout, text tensors under
``language_model.`` through the same name mapping, the vision tower and projector under their own
names (``names.expected_vision_tensors``). The default K3ForCausalLM load of a multimodal
checkpoint still reads the text model only.

Packed MXFP4 inference (SPEC §3.7): ``from_pretrained(..., keep_packed=True)`` builds the model
with ``PackedMXFP4Experts`` in place of every ``RoutedExperts`` and copies the checkpoint's
``.weight_packed`` / ``.weight_scale`` bytes straight into them (nothing is dequantized at load,
experts stay at 4.25 bits per weight in memory). The default, ``keep_packed=None``, keeps them
packed exactly when config.json declares compressed-tensors ``mxfp4-pack-quantized`` (what
``k3 quantize`` writes and the release ships); a checkpoint with packed tensors but no such
declaration is dequantized. ``keep_packed=False`` always dequantizes into float experts;
``keep_packed=True`` on a float checkpoint loads it and quantizes the experts once, from the
stored precision.

Activations follow the declaration (``quantization_config...input_activations``), in both
layouts: null (the release: weights-only) runs expert inputs in the compute dtype; the MXFP8
group-32 scheme (a ``k3 quantize`` of a QAT model) fake-quantizes them, packed
(``PackedMXFP4Experts(act_fmt=...)``) or dequantized (``FakeQuantMXExperts`` over the dequantized
weights, which re-quantize to themselves). So ``keep_packed=True`` and ``False`` give identical
logits for every checkpoint.
"""

from __future__ import annotations

import copy
import logging
import os

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from k3.config.hf import DEFAULT_WRAPPER
from k3.checkpoint.load import CheckpointFiles, LoadPlan, checkpoint_dtype, plan_load, plan_vision, scan, stream_into
from k3.checkpoint.names import (declared_act_fmt, expected_tensors, expected_vision_tensors, holds_packed_experts,
                                 is_mxfp4_quantization, is_vision_tensor, storage_dtype, stores_packed_experts)
from k3.checkpoint.save import CONFIG_NAME, save_state_dict
from k3.config import K3Config
from k3.errors import CheckpointError, ConfigError
from k3.model.moe import RoutedExperts
from k3.model.multimodal import MEDIA_PAD_KEY, K3VLForConditionalGeneration
from k3.model.mx_experts import FakeQuantMXExperts, PackedMXFP4Experts, pack_routed_experts, swap_modules
from k3.config.vision import VisionConfig, vision_config_of

__all__ = ["save_pretrained", "load_checkpoint", "from_pretrained", "model_act_fmt"]

log = logging.getLogger("k3.checkpoint")


def model_act_fmt(model: nn.Module) -> str | None:
    """The activation format of ``model``'s packed experts (None without packed experts); all
    packed modules must agree, since one checkpoint declares one."""
    fmts = {m.act_fmt for m in model.modules() if isinstance(m, PackedMXFP4Experts)}
    if len(fmts) > 1:
        raise CheckpointError(f"packed experts disagree on the activation format: {sorted(map(str, fmts))}")
    return fmts.pop() if fmts else None


def _text_model(model: nn.Module) -> nn.Module:
    """The K3ForCausalLM that holds the text tensors: the model itself, or a VL model's ``language_model``."""
    return model.language_model if isinstance(model, K3VLForConditionalGeneration) else model


def save_pretrained(model: nn.Module, directory: str | os.PathLike, max_shard_size: int | str = "2GB",
                    dtype: torch.dtype | None = None) -> list[str]:
    """Save ``model`` (a K3ForCausalLM) in k3's layout (HF-named safetensors shards + index with
    sha256 + config.json, atomically); see :func:`k3.checkpoint.save.save_state_dict`. Packed
    experts declare their activation format in ``quantization_config``.

    A :class:`K3VLForConditionalGeneration` is written in the release's multimodal layout: text
    tensors under ``language_model.``, ``vision_tower.…`` / ``mm_projector.…`` as floats (``dtype``,
    else their own; never MXFP4), config.json the kimi_k3 wrapper (text_config + vision_config)
    with the model's ``media_placeholder_token_id``."""
    if any(t.is_meta for t in model.state_dict().values()):
        raise CheckpointError("cannot save a model whose tensors are on the meta device")
    text = _text_model(model)
    if text is model:
        return save_state_dict(model.state_dict(), model.config, directory, max_shard_size, dtype,
                               act_fmt=model_act_fmt(model))
    config = text.config.replace()  # a copy whose wrapper names the model's <|media_pad|> id
    config.wrapper = {**copy.deepcopy(config.wrapper or DEFAULT_WRAPPER), MEDIA_PAD_KEY: model.media_pad_token_id}
    return save_state_dict(text.state_dict(), config, directory, max_shard_size, dtype,
                           act_fmt=model_act_fmt(text), vision=model.vision_state_dict())


def _destinations(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict(keep_vars=True)
    expected = expected_tensors(model.config, packed=holds_packed_experts(sd))
    missing = sorted(set(expected) - set(sd))
    if missing:  # a k3 bug, not a user error: names.py and the model disagree
        raise AssertionError(f"model has no parameters {missing[:5]} that names.expected_tensors lists")
    return {n: sd[n] for n in expected}


def _vision_destinations(model: K3VLForConditionalGeneration) -> dict[str, torch.Tensor]:
    sd = {n: t for n, t in model.state_dict(keep_vars=True).items() if is_vision_tensor(n)}
    expected = expected_vision_tensors(model.vision_config)
    if set(expected) != set(sd):  # a k3 bug, not a user error: names.py and the model disagree
        raise AssertionError(f"vision tensors of the model {sorted(set(sd) ^ set(expected))[:5]} disagree "
                             "with names.expected_vision_tensors")
    return {n: sd[n].data for n in expected}


def _vision_plan(files: CheckpointFiles, vc: VisionConfig | None, strict: bool) -> LoadPlan:
    if vc is None:
        raise CheckpointError(f"{os.path.join(files.directory, CONFIG_NAME)}: no vision_config, so no "
                              "vision tower to load (K3ForCausalLM loads the text model)")
    return plan_vision(files, vc, strict)


def _check_declared_acts(model: nn.Module, files: CheckpointFiles) -> None:
    """A checkpoint that declares its expert activations must match the experts it loads into
    (packed / QAT experts carry ``act_fmt``; plain float experts run weights-only)."""
    if files.quantization is None:  # float checkpoints (master weights) declare nothing
        return
    path = os.path.join(files.directory, CONFIG_NAME)
    declared = declared_act_fmt(files.quantization, path)
    have = {getattr(m, "act_fmt", None) for m in model.modules()
            if type(m) in (RoutedExperts, FakeQuantMXExperts, PackedMXFP4Experts)}
    if have and have != {declared}:
        raise CheckpointError(f"{path}: quantization_config declares input_activations "
                              f"{declared or 'null'} but the model's experts run {sorted(map(str, have))}; "
                              "build the model with from_pretrained to follow the checkpoint")


def load_checkpoint(model: nn.Module, directory: str | os.PathLike, strict: bool = True,
                    verify: bool = True) -> list[str]:
    """Load a checkpoint into ``model`` in place; return the unexpected tensor names (lenient mode).

    Everything is validated against the model before the first byte is copied (``verify``: the
    sha256 of every shard too). A model on the meta device is only validated from headers (no
    tensor data is read, so nothing is hashed). A ``K3VLForConditionalGeneration`` loads its text
    model and its vision tower and projector (both validated before either is copied).
    """
    meta = any(t.is_meta for t in model.state_dict().values())
    files = scan(directory, verify and not meta)
    text = _text_model(model)
    _check_declared_acts(text, files)
    config: K3Config = text.config
    if files.config.fingerprint() != config.fingerprint():
        log.info("%s: config.json differs from the model's config; loading by tensor shapes",
                 files.directory)
    plan = plan_load(files, config, strict, packed=holds_packed_experts(text.state_dict()))
    vplan = _vision_plan(files, model.vision_config, strict) if text is not model else None
    dest = _destinations(text)
    if not any(t.is_meta for t in dest.values()):
        stream_into(plan, {n: t.data for n, t in dest.items()}, config)
        if vplan is not None:
            stream_into(vplan, _vision_destinations(model), config)
    return plan.unexpected + (vplan.unexpected if vplan is not None else [])


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


def _with_empty_packed_experts(model: nn.Module, act_fmt: str | None) -> list[str]:
    """Swap every RoutedExperts for a PackedMXFP4Experts of the same shape (zero bytes, to be filled
    from a checkpoint); the float expert storage is released."""
    return swap_modules(model, (RoutedExperts,), lambda m: PackedMXFP4Experts.empty_like(m, act_fmt))


def declares_packed(files: CheckpointFiles) -> bool:
    """config.json declares compressed-tensors ``mxfp4-pack-quantized`` (the keep_packed default)."""
    return is_mxfp4_quantization(files.quantization)


def _default_class() -> type:
    from k3.model.decoder import K3ForCausalLM
    return K3ForCausalLM


def from_pretrained(directory: str | os.PathLike, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None, strict: bool = True,
                    keep_packed: bool | None = None, verify: bool = True, model_class: type | None = None,
                    ) -> nn.Module:
    """Build a K3ForCausalLM (or ``model_class``) from a checkpoint directory of any supported layout.

    ``model_class=K3VLForConditionalGeneration`` also loads the vision tower and projector of a
    multimodal checkpoint (``vision_tower.…`` / ``mm_projector.…``, checked against its
    vision_config: a missing or, with ``strict``, unexpected vision tensor is refused by name); the
    default K3ForCausalLM loads the text model and ignores them.

    ``dtype`` None keeps the checkpoint's dtype (fp32-kept tensors stay fp32); ``device="meta"``
    validates the checkpoint from its headers and returns a shape-only model without reading tensor
    data (so without hashing). ``keep_packed``: routed experts as ``PackedMXFP4Experts`` (see the
    module docstring); None = whether config.json declares ``mxfp4-pack-quantized``. ``verify``:
    check every shard's sha256 first.
    """
    if isinstance(directory, type):
        raise TypeError("from_pretrained(directory, ...) takes the directory first; the model class, "
                        "if not K3ForCausalLM, goes in model_class=")
    device = torch.device(device or "cpu")
    files = scan(directory, verify and device.type != "meta")
    act_fmt = declared_act_fmt(files.quantization, os.path.join(files.directory, CONFIG_NAME))
    dtype = dtype or checkpoint_dtype(files)
    if keep_packed is None:
        keep_packed = declares_packed(files)
    direct = keep_packed and stores_packed_experts(files.tensors)  # bytes copied as stored
    plan = plan_load(files, files.config, strict, packed=direct)  # fail before allocating anything
    cls = model_class or _default_class()
    vplan = None
    if issubclass(cls, K3VLForConditionalGeneration):
        try:
            vc = vision_config_of(files.config)
        except ConfigError as e:
            raise CheckpointError(f"{os.path.join(files.directory, CONFIG_NAME)}: {e}") from None
        vplan = _vision_plan(files, vc, strict)
    model = _empty_model(cls, files.config, dtype, device)
    text = _text_model(model)
    if direct:
        _with_empty_packed_experts(text, act_fmt)
    if device.type != "meta":
        stream_into(plan, {n: t.data for n, t in _destinations(text).items()}, files.config)
        if vplan is not None:
            stream_into(vplan, _vision_destinations(model), files.config)
    if keep_packed and not direct:
        if device.type == "meta":
            _with_empty_packed_experts(text, act_fmt)
        else:
            pack_routed_experts(text, act_fmt)  # quantize the float experts just loaded
    elif not keep_packed and act_fmt is not None:  # dequantized weights, declared MXFP8 inputs
        swap_modules(text, (RoutedExperts,), lambda m: FakeQuantMXExperts(m, act_fmt))
    return model
