"""Package structure: model/ never imports the checkpoint code; one swap helper for QAT, packing and
packed loading, and each of the three swaps exactly the routed experts."""
import ast
import pathlib
import subprocess
import sys

import pytest
from checkpoint_models import random_model

from k3.checkpoint import from_pretrained, save_pretrained
from k3.checkpoint.quantize import quantize
from k3.model.moe import RoutedExperts
from k3.model.mx_experts import FakeQuantMXExperts, PackedMXFP4Experts, pack_routed_experts
from k3.train.qat import disable_qat, enable_qat

MODEL_DIR = pathlib.Path(__file__).resolve().parents[2] / "src" / "k3" / "model"


def _imported_modules(path):
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


def test_model_sources_import_nothing_from_checkpoint():
    files = sorted(MODEL_DIR.glob("*.py"))
    assert len(files) >= 5 and any(f.name == "decoder.py" for f in files)
    seen = {f.name: _imported_modules(f) for f in files}
    assert any(m == "k3.model.moe" for m in seen["mx_experts.py"])  # positive control: imports are seen
    bad = {f: [m for m in mods if m == "k3.checkpoint" or m.startswith("k3.checkpoint.")] for f, mods in seen.items()}
    assert not any(bad.values()), bad


def test_importing_and_running_the_model_loads_no_checkpoint_module():
    code = ("import sys, torch\n"
            "from k3.config import get_preset\n"
            "from k3.model.decoder import K3ForCausalLM\n"
            "import k3.model.mx_experts, k3.train.qat\n"
            "m = K3ForCausalLM(get_preset('nano'))\n"
            "m(torch.zeros(1, 4, dtype=torch.long))\n"
            "print(sorted(n for n in sys.modules if n.startswith('k3.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    mods = eval(out.strip().splitlines()[-1])
    assert "k3.model.decoder" in mods  # positive control
    assert not [m for m in mods if m.startswith("k3.checkpoint")], mods


def test_the_methods_moved_to_checkpoint_functions():
    from k3.model.decoder import K3ForCausalLM
    assert not hasattr(K3ForCausalLM, "from_pretrained") and not hasattr(K3ForCausalLM, "save_pretrained")
    with pytest.raises(TypeError, match="directory first"):
        from_pretrained(K3ForCausalLM, "x")
    import k3  # the top-level entry points are the checkpoint functions themselves
    assert k3.from_pretrained is from_pretrained and k3.save_pretrained is save_pretrained


def _routed_names(model):
    """Independent enumeration: block_sparse_moe.experts of every MoE layer (layers >= first_k_dense_replace)."""
    cfg = model.config
    return [f"model.layers.{l}.block_sparse_moe.experts" for l in range(cfg.num_hidden_layers)
            if l >= cfg.first_k_dense_replace]


def _types(model):
    return {n: type(m) for n, m in model.named_modules()}


def _only_changed(before, after, names):
    changed = {n for n in before if n in after and before[n] is not after[n]}
    return changed == set(names)


class _ExpertsSubclass(RoutedExperts):
    """A different module that happens to subclass RoutedExperts: no swap may touch it."""


def test_qat_swaps_exactly_the_routed_experts():
    model = random_model("nano")
    extra = _ExpertsSubclass(2, 32, 32, model.moe_layers()[0].experts.act)
    model.add_module("not_routed", extra)
    want = _routed_names(model)
    assert len(want) == 3
    before = _types(model)
    assert enable_qat(model) == want
    after = _types(model)
    assert _only_changed(before, after, want) and all(after[n] is FakeQuantMXExperts for n in want)
    assert after["not_routed"] is _ExpertsSubclass
    assert disable_qat(model) == want and _types(model) == before


@pytest.mark.parametrize("qat", [False, True])
def test_packing_swaps_exactly_the_routed_experts(qat):
    model = random_model("nano")
    model.add_module("not_routed", _ExpertsSubclass(2, 32, 32, model.moe_layers()[0].experts.act))
    if qat:
        enable_qat(model)
    want = _routed_names(model)
    before = _types(model)
    assert pack_routed_experts(model) == want
    after = _types(model)
    assert _only_changed(before, after, want) and all(after[n] is PackedMXFP4Experts for n in want)
    assert pack_routed_experts(model) == []  # packed experts are not re-packed


def test_packed_loading_swaps_exactly_the_routed_experts(tmp_path):
    src = random_model("nano")
    save_pretrained(src, tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q")
    plain = from_pretrained(tmp_path / "q", keep_packed=False)
    packed = from_pretrained(tmp_path / "q", keep_packed=True)
    want = _routed_names(packed)
    tp, tq = _types(plain), _types(packed)
    assert tp.keys() == tq.keys()
    assert {n for n in tp if tp[n] is not tq[n]} == set(want)
    assert all(tq[n] is PackedMXFP4Experts for n in want) and all(tp[n] is RoutedExperts for n in want)
