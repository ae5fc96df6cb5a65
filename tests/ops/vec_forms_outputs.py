"""Outputs of every C kernel on fixed inputs, saved with ``torch.save`` to ``argv[1]`` as
``{"form": cpu_kernels.vector_form(), "out": {name: [tensors]}}``: run by ``test_vec_forms.py`` once
per build of the kernels, to compare the builds bit for bit. Not a test file itself."""

import sys

import torch

from k3 import K3ForCausalLM
from k3.config import get_preset
from k3.infer.prepared import PreparedModel
from k3.model.cache import K3Cache
from k3.ops import cpu_kernels
from k3.ops.kda import chunk_kda
from k3.ops.norm import rms_norm
from k3.ops.packed_mm import PackedMatrix


def outputs() -> dict:
    torch.set_num_threads(2)
    out = {}
    for B, T, H, K, V in [(2, 70, 3, 64, 64), (1, 33, 2, 20, 32), (1, 30, 1, 24, 136)]:   # vector and scalar forms
        g = torch.Generator().manual_seed(K * 1000 + V)
        q = torch.randn(B, T, H, K, generator=g)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
        v = torch.randn(B, T, H, V, generator=g)
        gg, beta = -torch.rand(B, T, H, K, generator=g) * 0.2, torch.rand(B, T, H, generator=g)
        xs = [t.requires_grad_(True) for t in (q, k, v, gg, beta, torch.randn(B, H, K, V, generator=g) * 0.1)]
        o, st = chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
        (o * torch.randn(o.shape, generator=g)).sum().add((st * torch.randn(st.shape, generator=g)).sum()).backward()
        out[f"kda {B, T, H, K, V}"] = [o.detach(), st.detach()] + [x.grad for x in xs]
    g = torch.Generator().manual_seed(0)
    for K, N in [(512, 2120), (100, 70)]:
        P = PackedMatrix(torch.randn(K, N, generator=g))
        for M in (1, 2, 3, 5, 8, 9, 17):
            out[f"packed {K, N, M}"] = [P.mm(torch.randn(M, K, generator=g))]
    P = PackedMatrix(torch.randn(4, 256, 96, generator=g))
    for S in (1, 3, 13):
        x = torch.randn(6, 256, generator=g)
        rows, experts = torch.randint(0, 6, (S,), generator=g), torch.randint(0, 4, (S,), generator=g)
        out[f"rows_mm {S}"] = [P.rows_mm(x, rows, experts)]
    for M, D in [(130, 40), (70, 64)]:   # RMSNorm: a tail vector, and whole ones; blocks of 64 rows
        x = torch.randn(M, D, generator=g).requires_grad_(True)
        w = (torch.rand(D, generator=g) + 0.5).requires_grad_(True)
        y = rms_norm(x, w, 1e-6)
        (y * torch.randn(M, D, generator=g)).sum().backward()
        out[f"rms_norm {M, D}"] = [y.detach(), x.grad, w.grad]
    lib = cpu_kernels.library()
    for kind in range(4):
        x = torch.randn(1003, generator=g) * 30
        lib.k3_map(kind, x.data_ptr(), x.numel())
        out[f"map {kind}"] = [x]
    torch.manual_seed(1)
    m = K3ForCausalLM(get_preset("nano"))   # fp32 training: every C training op
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape) * 0.3)
    ids = torch.randint(0, m.config.vocab_size, (2, 96))
    res = m(ids, labels=ids)
    res.loss.backward()
    out["train"] = [res.loss.detach(), res.logits.detach()] + [p.grad for p in m.parameters() if p.grad is not None]
    m.eval()
    with torch.no_grad():
        caches = []
        for n in (3, 17, 8, 30):
            c = m.new_cache(1)
            m(torch.randint(0, m.config.vocab_size, (1, n)), cache=c)
            caches.append(c)
        cache, prepared = K3Cache.cat(caches), PreparedModel(m)
        tok, steps = torch.randint(0, m.config.vocab_size, (4, 1)), []
        for _ in range(4):
            logits = m(tok, cache=cache, prepared=prepared).logits[:, -1]
            steps.append(logits.clone())
            tok = logits.argmax(-1)[:, None]
        out["decode"] = steps
    return out


if __name__ == "__main__":
    form = cpu_kernels.vector_form()
    if form is None:
        sys.exit(f"the kernels are unavailable: {cpu_kernels.unavailable()}")
    torch.save({"form": form, "out": outputs()}, sys.argv[1])
