"""Named model configurations (SPEC §2): the released K3 and Kimi-Linear-48B, and three small ones.

``nano`` (CPU tests, seconds), ``tiny`` and ``small`` keep K3's shape at small scale: the KDA/MLA
3:1 split with MLA at the last layer, a dense first layer, Latent MoE with one shared expert,
SiTU, Block AttnRes. Each preset is a function returning a validated :class:`K3Config`, written
with keyword arguments so every number is named.

Vision (SPEC §3.9): ``k3`` carries the release's ``vision_config`` (27 × 1024 MoonViT3d tower,
projector to 7168). The small presets stay text-only (their checkpoints and config.json files are
flat text configs); :func:`vision_preset` gives a small tower sized to each of them.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from k3.config.checks import did_you_mean
from k3.config.model import K3Config, LinearAttnConfig, k3_layer_split
from k3.errors import ConfigError
from k3.config.vision import RELEASE_VISION_CONFIG, VisionConfig

__all__ = ["PRESETS", "get_preset", "list_presets", "vision_preset"]


def k3() -> K3Config:
    """The released K3: the text model at K3Config's defaults, eos = <|im_end|>, and the release's
    vision_config (MoonViT3d tower + patchmergerv2 projector)."""
    return K3Config(eos_token_id=163586, vision_config=copy.deepcopy(RELEASE_VISION_CONFIG))


def kimi_linear_48b() -> K3Config:
    """Kimi-Linear-48B-A3B: plain MoE, SwiGLU, no AttnRes, ungated MLA, low-rank KDA gate."""
    n = 27
    full = [4, 8, 12, 16, 20, 24, 27]
    return K3Config(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=n,
        linear_attn_config=LinearAttnConfig(
            kda_layers=[i for i in range(1, n + 1) if i not in full], full_attn_layers=full,
            num_heads=32, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=None,
            use_full_rank_gate=False),
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=False, mla_latent_norm_eps=1e-6,
        intermediate_size=9216, first_k_dense_replace=1, num_experts=256, num_experts_per_token=8,
        num_shared_experts=1, moe_intermediate_size=1024, routed_expert_hidden_size=None,
        latent_moe_use_norm=False, routed_scaling_factor=2.446, hidden_act="silu",
        activation_situ_linear_beta=None, attn_res_block_size=None, eos_token_id=163586,
        model_type="kimi_linear",
    )


def _small(*, vocab_size: int, hidden_size: int, num_hidden_layers: int, heads: int, head_dim: int,
           q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
           v_head_dim: int, intermediate_size: int, num_experts: int, num_experts_per_token: int,
           moe_intermediate_size: int, routed_expert_hidden_size: int, attn_res_block_size: int,
           max_position_embeddings: int) -> K3Config:
    """A K3-shaped small model; ``heads`` serves both KDA and MLA, ``head_dim`` is the KDA head."""
    kda, full = k3_layer_split(num_hidden_layers)
    return K3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        linear_attn_config=LinearAttnConfig(kda_layers=kda, full_attn_layers=full, num_heads=heads,
                                            head_dim=head_dim),
        num_attention_heads=heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        intermediate_size=intermediate_size, num_experts=num_experts,
        num_experts_per_token=num_experts_per_token, num_shared_experts=1,
        moe_intermediate_size=moe_intermediate_size, routed_expert_hidden_size=routed_expert_hidden_size,
        attn_res_block_size=attn_res_block_size, max_position_embeddings=max_position_embeddings,
        bos_token_id=None, eos_token_id=0, pad_token_id=None, mla_latent_norm_eps=None,
    )


def nano() -> K3Config:
    return _small(vocab_size=512, hidden_size=64, num_hidden_layers=4, heads=2, head_dim=32,
                  q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  intermediate_size=128, num_experts=8, num_experts_per_token=2, moe_intermediate_size=32,
                  routed_expert_hidden_size=32, attn_res_block_size=2, max_position_embeddings=2048)


def tiny() -> K3Config:
    return _small(vocab_size=4096, hidden_size=256, num_hidden_layers=8, heads=4, head_dim=64,
                  q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  intermediate_size=768, num_experts=16, num_experts_per_token=4, moe_intermediate_size=128,
                  routed_expert_hidden_size=128, attn_res_block_size=4, max_position_embeddings=8192)


def small() -> K3Config:
    return _small(vocab_size=8192, hidden_size=512, num_hidden_layers=12, heads=8, head_dim=64,
                  q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                  intermediate_size=1536, num_experts=32, num_experts_per_token=4, moe_intermediate_size=256,
                  routed_expert_hidden_size=256, attn_res_block_size=4, max_position_embeddings=16384)


def _small_vision(*, text_hidden_size: int, width: int, layers: int, heads: int, mlp: int,
                  pos_table: int) -> VisionConfig:
    """A small MoonViT3d tower (release layout, head_dim = width / heads) for a small text model."""
    return VisionConfig(vt_hidden_size=width, vt_num_hidden_layers=layers, vt_num_attention_heads=heads,
                        qkv_hidden_size=width, vt_intermediate_size=mlp, mm_hidden_size=width,
                        init_pos_emb_height=pos_table, init_pos_emb_width=pos_table,
                        text_hidden_size=text_hidden_size)


_VISION: dict[str, Callable[[], VisionConfig]] = {
    "nano": lambda: _small_vision(text_hidden_size=64, width=64, layers=2, heads=2, mlp=128, pos_table=16),
    "tiny": lambda: _small_vision(text_hidden_size=256, width=128, layers=3, heads=4, mlp=256, pos_table=32),
    "small": lambda: _small_vision(text_hidden_size=512, width=128, layers=4, heads=4, mlp=512, pos_table=32),
    "k3": lambda: VisionConfig.from_dict(RELEASE_VISION_CONFIG),
}


def vision_preset(name: str) -> VisionConfig | None:
    """The vision tower that goes with preset ``name`` (None for the text-only kimi-linear-48b)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
                          f"choose one of {list_presets()}")
    return _VISION[name]() if name in _VISION else None


PRESETS: dict[str, Callable[[], K3Config]] = {
    "nano": nano, "tiny": tiny, "small": small, "kimi-linear-48b": kimi_linear_48b, "k3": k3,
}


def list_presets() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> K3Config:
    """The preset ``name``, with ``overrides`` (schema fields) applied through ``K3Config.replace``."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
                          f"choose one of {list_presets()}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
