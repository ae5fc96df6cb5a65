"""What k3 writes for a Kimi-Linear-mode model (``model_type: kimi_linear``, no K3-only feature) so
that the reference implementation (transformers' ``KimiLinearForCausalLM``) loads it.

transformers' forget gate holds ``A_log`` as [1, 1, H, 1] and its config falls back to
``num_key_value_heads = 32`` when the field is absent; everything else k3 writes (separate
``q/k/v_conv1d``, ``dt_bias`` [H·D], the dense MLP under ``mlp.``, per-expert ``w1/w2/w3``,
``linear_attn_config`` + ``first_k_dense_replace``) is read by transformers' own conversion.
A model with any K3-only feature (latent MoE, AttnRes, output gates, full-rank KDA gate, SiTU,
gate lower bound) is not a Kimi-Linear model and is written in k3's layout.
"""

from __future__ import annotations

import torch

from k3.config import K3Config

__all__ = ["is_kimi_linear_mode", "kimi_linear_config_fields", "a_log_file_shape"]


def is_kimi_linear_mode(config: K3Config) -> bool:
    """``model_type`` kimi_linear and no feature transformers' Kimi-Linear lacks."""
    return config.model_type == "kimi_linear" and config.wrapper is None and not config.k3_only_features()


def kimi_linear_config_fields(config: K3Config) -> dict:
    """config.json fields transformers needs beside k3's (added only where absent)."""
    return {"num_key_value_heads": config.num_attention_heads, "architectures": ["KimiLinearForCausalLM"]}


def a_log_file_shape(config: K3Config, internal: torch.Tensor) -> torch.Tensor:
    """``A_log`` [H] as written: [1, 1, H, 1] in Kimi-Linear mode, [H] otherwise."""
    return internal.reshape(1, 1, -1, 1) if is_kimi_linear_mode(config) else internal
