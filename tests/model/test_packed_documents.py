"""Packed documents (SPEC §10): a packed row equals its documents run alone.

The reference is the plain model on each document by itself (batch 1, no doc_ids): an independent
formulation that needs no re-layout. The control shows the same packed rows without doc_ids differ
(state and attention leak across documents), so the equality is not a property of the inputs.
"""

from __future__ import annotations

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.ops.segments import GROUP_COST, MAX_GROUPS, Segments, length_groups

ROWS = [[70, 1, 50, 39], [160], [3, 100, 57]]  # document lengths per packed row (T = 160)


def _model(attn_res: bool = True, seed: int = 0) -> K3ForCausalLM:
    cfg = get_preset("nano")
    if not attn_res:
        cfg = cfg.replace(attn_res_block_size=None)
    torch.manual_seed(seed)
    m = K3ForCausalLM(cfg)
    with torch.no_grad():  # pseudo-queries start at 0 (a uniform mix): give AttnRes something to mix
        for n, p in m.named_parameters():
            if n.endswith("res_proj.weight"):
                p.normal_(0, 0.5)
    return m.eval()


def _packed(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids, docs = [], []
    for lens in ROWS:
        ids.append(torch.randint(0, vocab, (sum(lens),), generator=g))
        docs.append(torch.cat([torch.full((n,), d) for d, n in enumerate(lens)]))
    return torch.stack(ids), torch.stack(docs)


def _alone(model, ids):
    """Each document run by itself, logits put back in the packed layout."""
    out = torch.empty(*ids.shape, model.config.vocab_size)
    for r, lens in enumerate(ROWS):
        s = 0
        for n in lens:
            out[r, s:s + n] = model(ids[r:r + 1, s:s + n]).logits[0]
            s += n
    return out


@pytest.mark.parametrize("attn_res", [True, False])
def test_packed_logits_equal_documents_alone(attn_res):
    model = _model(attn_res)
    ids, docs = _packed(model.config.vocab_size)
    with torch.no_grad():
        want = _alone(model, ids)
        got = model(ids, doc_ids=docs).logits
        leaky = model(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    # control: without doc_ids the later documents see the earlier ones
    later = torch.zeros_like(docs, dtype=torch.bool)
    later[0, 70:] = True
    later[2, 3:] = True
    assert (leaky - want)[later].abs().max().item() > 1e-3
    # the first document of each row has no earlier document: identical either way
    assert (leaky[0, :70] - want[0, :70]).abs().max().item() <= 1e-5


def test_packed_gradients_equal_documents_alone():
    """The backward through the re-layout: the summed loss of a packed batch has the gradient of
    the documents' losses summed one by one."""
    model = _model(seed=3)
    ids, docs = _packed(model.config.vocab_size, seed=4)
    labels = torch.randint(0, model.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(5))
    ce = torch.nn.functional.cross_entropy
    model.zero_grad()
    ce(model(ids, doc_ids=docs).logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for r, lens in enumerate(ROWS):
        s = 0
        for n in lens:
            ce(model(ids[r:r + 1, s:s + n]).logits[0], labels[r, s:s + n], reduction="sum").backward()
            s += n
    for n, p in model.named_parameters():
        if p.grad is None:
            assert n not in packed
            continue
        scale = p.grad.abs().max().item() + 1e-12
        assert (packed[n] - p.grad).abs().max().item() <= 1e-4 * max(1.0, scale), n


def test_loss_never_predicts_across_documents():
    model = _model()
    ids, docs = _packed(model.config.vocab_size)
    with torch.no_grad():
        out = model(ids, labels=ids, doc_ids=docs)
        logits = out.logits
    # independent: mean CE over (t -> t+1) pairs inside one document
    lp = torch.log_softmax(logits, -1)
    terms = []
    for r, lens in enumerate(ROWS):
        s = 0
        for n in lens:
            for t in range(s, s + n - 1):
                terms.append(-lp[r, t, ids[r, t + 1]])
            s += n
    assert abs(out.loss.item() - torch.stack(terms).mean().item()) <= 1e-5
    # control: the plain loss also scores the boundary pairs
    assert abs(model(ids, labels=ids).loss.item() - torch.stack(terms).mean().item()) > 1e-4


def test_segments_layout_and_bad_input():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    s = Segments.of(docs, max_groups=1)
    assert s.groups == ((4, 6),) and s.num_docs == 4
    assert s.lengths.tolist() == [2, 3, 1, 6]
    x = torch.arange(12.0).view(2, 6, 1)
    d = s.to_docs(x)[0][..., 0]                 # sorted by length: docs of 1, 2, 3, 6 tokens
    assert d[0, 0].item() == 5 and d[1, :2].tolist() == [0, 1] and d[2, :3].tolist() == [2, 3, 4]
    assert d[0, 1:].eq(5).all() and d[1, 2:].eq(1).all()   # padding repeats the last token
    assert torch.equal(s.from_docs(s.to_docs(x)), x)
    assert Segments.of(torch.zeros(3, 4, dtype=torch.long)) is None  # one document per row
    model = _model()
    with pytest.raises(ValueError, match="doc_ids shape"):
        model(torch.zeros(2, 6, dtype=torch.long), doc_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        model(torch.zeros(2, 6, dtype=torch.long), doc_ids=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="cache"):
        model(torch.zeros(1, 6, dtype=torch.long), cache=model.new_cache(1), doc_ids=docs[:1])


def test_length_groups_are_the_cheapest_partition():
    """Against an exhaustive search over every way to cut the sorted lengths into runs."""
    import itertools
    import random
    rng = random.Random(0)
    for _ in range(200):
        lens = sorted(rng.randint(1, 1000) for _ in range(rng.randint(1, 9)))
        cost = lambda ends: sum((e - s) * lens[e - 1] + GROUP_COST  # noqa: E731
                                for s, e in zip([0, *ends[:-1]], ends))
        best = min(cost([*c, len(lens)]) for k in range(0, min(MAX_GROUPS, len(lens)))
                   for c in itertools.combinations(range(1, len(lens)), k))
        assert cost(length_groups(lens)) == best


def test_grouped_layout_pads_less_and_round_trips():
    docs = torch.cat([torch.full((1, 900), 0), torch.arange(1, 2).repeat_interleave(124)[None]], 1)
    short = torch.arange(8).repeat_interleave(128)[None]
    ids = torch.cat([docs, short])
    one, grouped = Segments.of(ids, max_groups=1), Segments.of(ids)
    assert one.padded_tokens == 10 * 900 and grouped.padded_tokens < 3000
    x = torch.randn(2, 1024, 3)
    assert torch.equal(grouped.from_docs(grouped.to_docs(x)), x)
