"""Vision tower + projector (SPEC §3.9) against an independent formulation written here.

The reference works in fp64 with loops and explicit index arithmetic: per-patch embedding by
matrix-vector products, the learned table resized by the align_corners=False bilinear formula,
RoPE one complex pair at a time, dense softmax attention with an explicit block-diagonal mask,
the 2×2 merge by patch indices. Every refusal test has a positive control beside it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from k3.cli import main
from k3.config import K3Config, get_preset
from k3.errors import ConfigError
from k3.model.summary import build_meta_model, build_meta_vision, format_breakdown, parameter_breakdown
from k3.model.vision import VisionModel
from k3.ops.vision import merge_patches, patch_positions, resize_pos_table, rope_2d, varlen_attention
from k3.config.presets import vision_preset
from k3.config.vision import RELEASE_VISION_CONFIG, ImageProcConfig, VisionConfig, vision_config_of

# The released config.json's vision_config, verbatim (moonshotai/Kimi-K3).
RELEASE = {
    "_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
    "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "linear_bias": False,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 1024,
    "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "patch_embed_proj_bias": False,
    "patch_size": 14, "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "qkv_hidden_size": 1536,
    "text_hidden_size": 7168, "vt_hidden_size": 1024, "vt_intermediate_size": 4096,
    "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27,
}
TOWER_EPS = torch.finfo(torch.float32).eps  # nn.RMSNorm(eps=None) in fp32
GRIDS = [(1, 4, 6), (1, 2, 2), (2, 2, 4), (1, 2, 20)]  # down- and up-sized tables, a 2-frame item


# ------------------------------------------------------------------------------ the reference
def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _bilinear(table, h, w):
    """[H0, W0, D] -> [h, w, D]: src = (dst + ½)·in/out − ½ clamped at 0, neighbours i0, min(i0+1, in−1)."""
    def taps(n_out, n_in):
        out = []
        for o in range(n_out):
            src = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
            i0 = int(math.floor(src))
            out.append((i0, min(i0 + 1, n_in - 1), src - i0))
        return out
    H0, W0, D = table.shape
    out = torch.empty(h, w, D, dtype=table.dtype)
    for y, (y0, y1, ly) in enumerate(taps(h, H0)):
        for x, (x0, x1, lx) in enumerate(taps(w, W0)):
            out[y, x] = (1 - ly) * ((1 - lx) * table[y0, x0] + lx * table[y0, x1]) \
                + ly * ((1 - lx) * table[y1, x0] + lx * table[y1, x1])
    return out


def _rope_pairs(z, rows, cols, swap_axes=False):
    """z [N, H, d]: pair k = channels (2k, 2k+1) turns by col·f (k even) or row·f (k odd),
    f = θ^(−4⌊k/2⌋/d)."""
    d = z.shape[-1]
    out = z.clone()
    for k in range(d // 2):
        f = 10000.0 ** (-4 * (k // 2) / d)
        use_col = (k % 2 == 0) != swap_axes
        ang = ((cols if use_col else rows) * f)[:, None]
        a, b = z[..., 2 * k], z[..., 2 * k + 1]
        out[..., 2 * k], out[..., 2 * k + 1] = a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()
    return out


def _reference(vc, sd, pixels, grids, swap_axes=False):
    """[M, text_hidden] from the state dict ``sd`` (fp64), written without k3.ops."""
    D, H, Q, L = vc.vt_hidden_size, vc.vt_num_attention_heads, vc.qkv_hidden_size, vc.vt_num_hidden_layers
    dh = Q // H
    ids, rows, cols, pos_terms = [], [], [], []
    for i, (t, h, w) in enumerate(grids):
        table = _bilinear(sd["vision_tower.patch_embed.pos_emb.weight"], h, w)
        omega = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) / (D / 2))
        for tau in range(t):
            time = torch.cat([torch.sin(tau * omega), torch.cos(tau * omega)])
            for y in range(h):
                for x in range(w):
                    ids.append(i), rows.append(y), cols.append(x)
                    pos_terms.append(table[y, x] + (time if t > 1 else 0))
    ids = torch.tensor(ids)
    rows, cols = torch.tensor(rows, dtype=torch.float64), torch.tensor(cols, dtype=torch.float64)
    W = sd["vision_tower.patch_embed.proj.weight"].reshape(D, -1)
    x = torch.stack([torch.mv(W, p.reshape(-1)) for p in pixels]) + torch.stack(pos_terms)
    mask = ids[:, None] != ids[None, :]                                          # True: another image
    for b in range(L):
        pre = f"vision_tower.encoder.blocks.{b}."
        qkv = _rms(x, sd[pre + "norm0.weight"], TOWER_EPS) @ sd[pre + "wqkv.weight"].T
        q, k, v = (qkv[:, j * Q:(j + 1) * Q].reshape(-1, H, dh) for j in range(3))
        q, k = _rope_pairs(q, rows, cols, swap_axes), _rope_pairs(k, rows, cols, swap_axes)
        s = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(dh)
        a = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
        x = x + torch.einsum("hnm,mhd->nhd", a, v).reshape(-1, Q) @ sd[pre + "wo.weight"].T
        u = _rms(x, sd[pre + "norm1.weight"], TOWER_EPS) @ sd[pre + "mlp.fc0.weight"].T
        u = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + u @ sd[pre + "mlp.fc1.weight"].T
    x = _rms(x, sd["vision_tower.encoder.final_layernorm.weight"], TOWER_EPS)
    merged, off = [], 0
    for t, h, w in grids:
        for R in range(h // 2):
            for C in range(w // 2):
                members = [sum(x[off + tau * h * w + (2 * R + a) * w + (2 * C + c)] for tau in range(t)) / t
                           for a, c in ((0, 0), (0, 1), (1, 0), (1, 1))]
                merged.append(torch.cat(members))
        off += t * h * w
    z = torch.stack(merged) @ sd["mm_projector.proj.0.weight"].T
    z = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    z = z @ sd["mm_projector.proj.2.weight"].T
    return _rms(z, sd["mm_projector.post_norm.weight"], vc.projector_ln_eps)


def _model(name="nano", seed=0):
    """A small model with weights large enough that RoPE, masks and norms change the output."""
    torch.manual_seed(seed)
    m = VisionModel(vision_preset(name))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("pos_emb.weight"):
                p.normal_()
            else:
                p.normal_(0, 1.5 / math.sqrt(p[0].numel()))
    return m


def _pixels(grids, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=g) * 2 - 1


# ------------------------------------------------------------------------------ the model
def test_model_matches_the_independent_reference():
    m, px = _model(), _pixels(GRIDS)
    out = m(px, torch.tensor(GRIDS))
    sd = {k: v.double() for k, v in m.state_dict().items()}
    ref = _reference(m.config, sd, px.double(), GRIDS)
    assert out.shape == (6 + 1 + 2 + 10, 64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    # the reference has the power to tell the RoPE axes apart (a row/column swap is far off)
    swapped = _reference(m.config, sd, px.double(), GRIDS, swap_axes=True)
    assert (swapped - ref).abs().max() > 1e-2


def test_packed_images_equal_each_image_alone():
    m = _model("tiny", seed=2)
    grids = [(1, 6, 4), (1, 2, 2), (1, 4, 8)]
    px = _pixels(grids, seed=3)
    packed = m.split(m(px, grids), grids)
    start = 0
    for g, rows in zip(grids, packed):
        n = g[0] * g[1] * g[2]
        alone = m(px[start:start + n], [g])
        torch.testing.assert_close(rows, alone, rtol=1e-5, atol=1e-5)
        assert rows.shape == ((g[1] // 2) * (g[2] // 2), 256)
        start += n


def test_tower_and_projector_layouts_and_backward():
    m, grids = _model(), [(1, 2, 4), (2, 2, 2)]
    px = _pixels(grids)
    merged = m.vision_tower(px, grids)
    assert merged.shape == (2 + 1, 4, 64)                          # [M, kh·kw, D]
    out = m.mm_projector(merged)
    torch.testing.assert_close(out, m.mm_projector(merged.flatten(1)))
    out.square().sum().backward()
    for name in ("vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.blocks.1.wqkv.weight",
                 "mm_projector.proj.0.weight"):
        assert m.get_parameter(name).grad.abs().sum() > 0, name


def test_bf16_forward_follows_fp32():
    m, grids = _model(), [(1, 4, 4)]
    px = _pixels(grids)
    ref = m(px, grids)
    out = m.to(torch.bfloat16)(px, grids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)


def test_bad_inputs_are_named():
    m = _model()
    with pytest.raises(ValueError, match="grid_thws covers 8 patches but pixel_values has 7"):
        m(_pixels([(1, 2, 4)])[:7], [(1, 2, 4)])
    with pytest.raises(ValueError, match="not a multiple of the 2x2 merge kernel"):
        m(_pixels([(1, 3, 4)]), [(1, 3, 4)])
    with pytest.raises(ValueError, match=r"pixel_values must be \[N, 3, 14, 14\]"):
        m(torch.zeros(8, 3, 16, 16), [(1, 2, 4)])
    with pytest.raises(ValueError, match="t=5 frames"):
        m(_pixels([(5, 2, 2)]), [(5, 2, 2)])
    assert m(_pixels([(4, 2, 2)]), [(4, 2, 2)]).shape == (1, 64)   # positive control: t = 4 is covered


def test_meta_build_then_init_weights():
    with torch.device("meta"):
        m = VisionModel(vision_preset("nano"))
    m.to_empty(device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float("nan"))
    m.init_weights()
    for name, p in m.named_parameters():
        assert torch.isfinite(p).all(), name
        if "norm" in name:
            assert (p == 1).all(), name
        else:
            assert 0.01 < p.std() < 0.03, name


# ------------------------------------------------------------------------------ the ops
def test_merge_order_on_a_grid_that_encodes_t_row_col():
    grids = [(2, 4, 6), (1, 2, 2)]
    vals = [(tau + 10 * i, y, x) for i, (t, h, w) in enumerate(grids)
            for tau in range(t) for y in range(h) for x in range(w)]
    out = merge_patches(torch.tensor(vals, dtype=torch.float64), grids)
    assert out.shape == (6 + 1, 4, 3)
    for R in range(2):
        for C in range(3):
            expect = [[0.5, 2 * R + a, 2 * C + c] for a, c in ((0, 0), (0, 1), (1, 0), (1, 1))]
            assert out[R * 3 + C].tolist() == expect
    assert out[6].tolist() == [[10, 0, 0], [10, 0, 1], [10, 1, 0], [10, 1, 1]]


def test_patch_positions_are_frame_major_then_row_major():
    assert patch_positions([(2, 2, 3)]).tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]] * 2


@pytest.mark.parametrize("h, w", [(4, 6), (20, 3), (64, 64), (1, 1), (100, 70)])
def test_pos_table_resize_equals_interpolate_and_the_bilinear_formula(h, w):
    table = torch.randn(64, 64, 8, dtype=torch.float64)
    out = resize_pos_table(table, h, w)
    expect = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
    torch.testing.assert_close(out, expect[0].permute(1, 2, 0))
    torch.testing.assert_close(out, _bilinear(table, h, w))
    if (h, w) == (64, 64):
        assert out is table                                        # the table itself, untouched
    cubic = resize_pos_table(table, h, w, mode="bicubic")
    torch.testing.assert_close(cubic, F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic",
                                                    align_corners=False)[0].permute(1, 2, 0))


def test_rope_equals_the_pair_loop_and_one_column_moves_only_channels_4i_4i1():
    torch.manual_seed(0)
    z = torch.randn(12, 3, 16, dtype=torch.float64)
    pos = torch.randint(0, 40, (12, 2))
    ref = _rope_pairs(z, pos[:, 0].double(), pos[:, 1].double())
    torch.testing.assert_close(rope_2d(z, pos).double(), ref, rtol=1e-5, atol=1e-5)
    moved = rope_2d(z, pos + torch.tensor([0, 1])) - rope_2d(z, pos)
    col_channels = torch.tensor([c % 4 < 2 for c in range(16)])
    assert moved[..., ~col_channels].abs().max() == 0 and moved[..., col_channels].abs().max() > 1e-3
    moved = rope_2d(z, pos + torch.tensor([1, 0])) - rope_2d(z, pos)
    assert moved[..., col_channels].abs().max() == 0 and moved[..., ~col_channels].abs().max() > 1e-3


def test_rope_scores_depend_only_on_the_offset():
    torch.manual_seed(1)
    q, k = torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    def score(pq, pk):
        return (rope_2d(q, torch.tensor([pq])) * rope_2d(k, torch.tensor([pk]))).sum(-1)
    torch.testing.assert_close(score((3, 5), (1, 9)), score((12, 0), (10, 4)), rtol=1e-5, atol=1e-5)
    assert (score((3, 5), (1, 9)) - score((3, 5), (9, 1))).abs().max() > 1e-3


def test_varlen_attention_equals_dense_attention_with_a_block_mask():
    torch.manual_seed(2)
    lens = [5, 1, 9, 3]
    q, k, v = (torch.randn(sum(lens), 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    s = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(8)
    a = torch.softmax(s.masked_fill(seg[:, None] != seg[None, :], float("-inf")), -1)
    ref = torch.einsum("hnm,mhd->nhd", a, v)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for x, y in zip(grads, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(x, y)


# ------------------------------------------------------------------------------ configuration
def test_release_vision_config_round_trips_identically():
    vc = VisionConfig.from_dict(RELEASE)
    assert vc.to_dict() == RELEASE
    assert json.dumps(vc.to_dict(), indent=2) == json.dumps(RELEASE, indent=2, sort_keys=True)
    assert VisionConfig(_attn_implementation="flash_attention_2").to_dict() == RELEASE  # release defaults
    assert (vc.head_dim, vc.projector_dim) == (128, 4096)


def test_transformers_resaved_vision_config_round_trips():
    d = {**RELEASE, "_name_or_path": "", "architectures": None, "model_type": "", "dtype": None,
         "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "return_dict": True,
         "output_attentions": False, "is_encoder_decoder": False, "chunk_size_feed_forward": 0}
    d.pop("_attn_implementation")
    assert VisionConfig.from_dict(d).to_dict() == dict(sorted(d.items()))


def test_k3_preset_carries_the_release_vision_config_through_config_json(tmp_path):
    c = get_preset("k3")
    assert c.vision_config == RELEASE == RELEASE_VISION_CONFIG
    c.to_json(tmp_path / "config.json")
    back = K3Config.from_json(tmp_path / "config.json")
    assert back.vision_config == RELEASE and vision_config_of(back).to_dict() == RELEASE


@pytest.mark.parametrize("change, message", [
    ({"vt_hiden_size": 1024}, r"unknown option\(s\) 'vt_hiden_size' \(did you mean 'vt_hidden_size'\?\)"),
    ({"vt_num_hidden_layers": "27"}, "vision_config.vt_num_hidden_layers must be an int"),
    ({"attn_bias": "false"}, "vision_config.attn_bias must be true or false"),
    ({"projector_ln_eps": 0}, "vision_config.projector_ln_eps must be > 0"),
    ({"merge_kernel_size": [2]}, r"vision_config.merge_kernel_size must be a list \[kh, kw\]"),
    ({"vt_num_attention_heads": 10},
     r"vision_config.vt_num_attention_heads \(10\) must divide vision_config.qkv_hidden_size \(1536\)"),
    ({"vt_num_attention_heads": 12, "qkv_hidden_size": 72}, "head dim .* = 6 must be a multiple of 4"),
    ({"norm_type": "layernorm"}, r"vision_config.norm_type must be one of \['rmsnorm'\]"),
    ({"mm_hidden_size": 1152}, r"vision_config.mm_hidden_size \(1152\) must equal vt_hidden_size \(1024\)"),
])
def test_bad_vision_config_is_refused_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        VisionConfig.from_dict({**RELEASE, **change})


@pytest.mark.parametrize("change", [
    {"vt_hidden_size": 1024}, {"vt_num_hidden_layers": 3}, {"attn_bias": True}, {"projector_ln_eps": 1e-6},
    {"merge_kernel_size": [2, 2]}, {"vt_num_attention_heads": 16}, {"qkv_hidden_size": 96},
    {"pos_emb_interpolation_mode": "bicubic"}, {"mm_hidden_size": None},
    {"video_attn_type": "spatial_temporal"},
])
def test_good_vision_config_values_are_accepted(change):   # positive controls of the refusals
    vc = VisionConfig.from_dict({**RELEASE, **change})
    assert vc.to_dict() == {**RELEASE, **change}


def test_vision_config_of_checks_the_text_width():
    nano = get_preset("nano")
    wrong = K3Config(**{n: getattr(nano, n) for n in nano.text_field_names()}, vision_config=RELEASE)
    with pytest.raises(ConfigError, match=r"text_hidden_size \(7168\) must equal the text model's "
                                          r"hidden_size \(64\)"):
        vision_config_of(wrong)
    right = K3Config(**{n: getattr(nano, n) for n in nano.text_field_names()},
                     vision_config=vision_preset("nano").to_dict())
    assert vision_config_of(right).vt_hidden_size == 64 and vision_config_of(nano) is None


@pytest.mark.parametrize("wh, size, grid, tokens", [
    ((310, 470), (310, 470), (1, 34, 24), 204), ((7300, 30), (7168, 29), (1, 4, 512), 512),
    ((13, 9), (13, 9), (1, 2, 2), 1), ((4000, 3000), (4000, 3000), (1, 216, 286), 15444),
    ((10000, 100), (7168, 71), (1, 6, 512), 768), ((8000, 8000), (3586, 3586), (1, 258, 258), 16641),
    ((100, 100), (100, 100), (1, 8, 8), 16), ((30, 16), (30, 16), (1, 2, 4), 2),
    ((60, 60), (60, 60), (1, 6, 6), 9),
])
def test_image_size_rule_matches_the_research_vectors(wh, size, grid, tokens):
    p = ImageProcConfig()
    assert (p.resize_size(*wh), p.grid_thw(*wh), p.num_tokens(*wh)) == (size, grid, tokens)
    assert (p.max_side, p.pad_multiple) == (7168, (28, 28))


def test_image_proc_config_refuses_unknown_keys():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) 'in_patch_limt'"):
        ImageProcConfig.from_dict({"in_patch_limt": 16384})
    assert ImageProcConfig.from_dict({"in_patch_limit": 16384}).in_patch_limit == 16384
    with pytest.raises(ConfigError, match="image width must be > 0"):
        ImageProcConfig().grid_thw(0, 5)


# ------------------------------------------------------------------------------ parameter count
def test_release_tower_and_projector_count_447_358_976_with_the_release_names():
    vision = build_meta_vision(get_preset("k3"))
    counts = {n: sum(p.numel() for p in c.parameters()) for n, c in vision.named_children()}
    assert counts == {"vision_tower": 401_214_464, "mm_projector": 46_144_512}
    assert sum(counts.values()) == 447_358_976
    shapes = {n: tuple(p.shape) for n, p in vision.named_parameters()}
    expect = {"vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
              "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
              "vision_tower.encoder.final_layernorm.weight": (1024,),
              "mm_projector.proj.0.weight": (4096, 4096), "mm_projector.proj.2.weight": (7168, 4096),
              "mm_projector.post_norm.weight": (7168,)}
    for b in range(27):
        pre = f"vision_tower.encoder.blocks.{b}."
        expect.update({pre + "norm0.weight": (1024,), pre + "norm1.weight": (1024,),
                       pre + "wqkv.weight": (4608, 1024), pre + "wo.weight": (1024, 1536),
                       pre + "mlp.fc0.weight": (4096, 1024), pre + "mlp.fc1.weight": (1024, 4096)})
    assert shapes == expect and not list(vision.buffers())


def test_params_command_reports_the_vision_lines(tmp_path, capsys):
    nano = get_preset("nano")
    vc = vision_preset("nano")
    cfg = K3Config(**{n: getattr(nano, n) for n in nano.text_field_names()}, vision_config=vc.to_dict())
    cfg.to_json(tmp_path / "config.json")
    assert main(["params", "--config", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    D, L, I, Ht = 64, 2, 128, 64                                   # by hand: the nano tower
    tower = D * 3 * 14 * 14 + 16 * 16 * D + L * (2 * D + 3 * D * D + D * D + 2 * I * D) + D
    assert d["vision"] == {"vision_tower": tower, "mm_projector": (4 * D) ** 2 + Ht * 4 * D + Ht}
    assert d["total"] == parameter_breakdown(build_meta_model(nano)).total   # text total unchanged
    b = parameter_breakdown(build_meta_model(nano), build_meta_vision(cfg))
    assert f"{'text + vision':<22}{b.total + sum(d['vision'].values()):>20,}" in format_breakdown(b)
    # another tower's vision_config: the text model is still counted, the vision one is named as skipped
    cfg.vision_config = {"model_type": "moonvit", "hidden_size": 1152}
    cfg.to_json(tmp_path / "config.json")
    assert main(["params", "--config", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["vision"] == {} and "vision_config not counted" in err and "'hidden_size'" in err
