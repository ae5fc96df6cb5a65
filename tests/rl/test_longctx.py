"""k3.rl.longctx: retrieval items against an independent solver, scoring, and ``retrieve`` /
``accept`` on a random nano model (greedy output checked against a plain loop of full forwards)."""

import re

import pytest
import torch

from k3.config import get_preset
from k3.data.tokenizer import train_tokenizer
from k3.errors import K3Error
from k3.model.cache import cache_bytes_per_sequence
from k3.model.decoder import K3ForCausalLM
from k3.rl import longctx
from k3.rl.longctx import accept, make_retrieval, retrieve, score_answer, solve

FACT_RE = re.compile(r"The secret code of (\S+) is (\d+)\.")


@pytest.fixture(scope="module")
def tok():
    text = (" ".join(longctx.FILLER_WORDS) + " The secret code of Kalo is 12345. Question: what is the "
            "secret code of Kalo? Answer: the secret code of Kalo is 67890.")
    return train_tokenizer([text * 30], vocab_size=400)


@pytest.fixture(scope="module")
def model():
    """A random nano model (max_position_embeddings 2048) with sharpened logits, so greedy choices
    are not float ties between the engine's path and plain forwards."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = K3ForCausalLM(get_preset("nano"))
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return m.eval()


def haystack_span(prompt: str) -> tuple[int, int]:
    return prompt.index("\n\n") + 2, prompt.rindex("\n\nQuestion:")


@pytest.mark.parametrize("kind", ["needle", "multikey"])
def test_items_solve_fit_and_place(tok, kind):
    for length in (256, 1024, 4096):
        for depth in (0.0, 0.5, 1.0):
            for seed in (0, 1):
                it = make_retrieval(kind, tok, length, depth, seed)
                where = f"{kind} T={length} depth={depth} seed={seed}"
                assert solve(it.prompt) == it.answer, where
                assert it.prompt_ids == tok.encode(it.prompt) and it.tokens == len(it.prompt_ids), where
                # stated tolerance: length - max(12, length // 100) <= tokens <= length
                assert length - max(12, length // 100) <= it.tokens <= length, (where, it.tokens)
                assert it.prompt.endswith(f"Answer: the secret code of {it.query} is")
                start, end = haystack_span(it.prompt)
                hay = it.prompt[start:end]
                facts = FACT_RE.findall(hay)
                n = 1 if kind == "needle" else 4
                assert len(facts) == n == it.n_keys, where
                keys, values = [k for k, _ in facts], [v for _, v in facts]
                assert len(set(keys)) == n and len(set(values)) == n, where
                assert keys.count(it.query) == 1 and dict(facts)[it.query] == it.answer, where
                # nothing but the facts carries a digit or the words of the fact template
                rest = FACT_RE.sub("", hay)
                assert not re.search(r"\d|secret|code", rest), where
                # placement: exact at the ends; in the middle within half a filler sentence
                fact = f"The secret code of {it.query} is {it.answer}."
                if depth == 0.0:
                    assert hay.startswith(fact), where
                elif depth == 1.0:
                    assert hay.endswith(fact), where
                others = [f"The secret code of {k} is {v}." for k, v in facts if k != it.query]
                for o in others:
                    hay = hay.replace(o + " ", "").replace(" " + o, "")
                pos = hay.index(fact)
                filler = len(hay) - len(fact) - 1
                assert abs(pos - depth * filler) <= 70, (where, pos, filler)


def test_items_deterministic_and_seeded(tok):
    a = make_retrieval("multikey", tok, 512, 0.3, 7, n_keys=6)
    assert a.prompt == make_retrieval("multikey", tok, 512, 0.3, 7, n_keys=6).prompt
    b = make_retrieval("multikey", tok, 1024, 0.8, 7, n_keys=6)
    assert (a.keys, a.values, a.query) == (b.keys, b.values, b.query)  # same seed: same facts
    assert make_retrieval("multikey", tok, 512, 0.3, 8, n_keys=6).prompt != a.prompt
    d = a.as_dict()
    assert "prompt_ids" not in d and "prompt" not in d
    assert {k: d[k] for k in ("kind", "length", "tokens", "depth", "seed", "query", "answer")} == dict(
        kind="multikey", length=512, tokens=a.tokens, depth=0.3, seed=7, query=a.query, answer=a.answer)
    with pytest.raises(K3Error, match="too short"):
        make_retrieval("multikey", tok, 40, 0.5, 0)
    for bad in (dict(kind="haystack"), dict(depth=1.5), dict(kind="needle", n_keys=3),
                dict(kind="multikey", n_keys=1)):
        with pytest.raises(K3Error):
            make_retrieval(**{**dict(kind="needle", tokenizer=tok, length=256, depth=0.5, seed=0), **bad})


def test_solver_refuses_missing_and_duplicated_key(tok):
    it = make_retrieval("multikey", tok, 1024, 0.5, 3)
    fact = f"The secret code of {it.query} is {it.answer}."
    assert solve(it.prompt) == it.answer  # positive control: the unedited prompt solves
    assert it.prompt.count(fact) == 1
    with pytest.raises(K3Error, match="0 fact sentences"):
        solve(it.prompt.replace(fact, "The river is quiet."))
    start, _ = haystack_span(it.prompt)
    twice = it.prompt[:start] + f"The secret code of {it.query} is 11111. " + it.prompt[start:]
    with pytest.raises(K3Error, match="2 fact sentences"):
        solve(twice)
    with pytest.raises(K3Error, match="no 'Question"):
        solve(it.prompt.split("\n\nQuestion:")[0])
    # a key that is a prefix of another key is not confused with it
    p = ("x\n\nThe secret code of Kaloren is 11111. The secret code of Kalo is 22222.\n\n"
         "Question: what is the secret code of Kalo? Answer: the secret code of Kalo is")
    assert solve(p) == "22222"


@pytest.mark.parametrize("text, answer, ok", [
    (" 48213.", "48213", True), ("48213", "48213", True), ("\n 48213, and more", "48213", True),
    ("48213!?", "48213", True), ("4821", "48213", False), ("482130", "48213", False),
    ("", "48213", False), ("   ", "48213", False), (" the code is 48213", "48213", False),
    ("48 213", "48213", False),
])
def test_score_answer(text, answer, ok):
    assert score_answer(text, answer) is ok


def test_retrieve_matches_plain_greedy_loop(model, tok):
    items = [make_retrieval("needle", tok, 160, 0.5, 0), make_retrieval("multikey", tok, 200, 1.0, 1)]
    rows = retrieve(model, tok, items, max_new_tokens=6)
    assert len(rows) == 2
    for it, row in zip(items, rows, strict=True):
        ids = torch.tensor([it.prompt_ids])
        with torch.no_grad():
            for _ in range(6):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        want = tok.decode(ids[0, len(it.prompt_ids):].tolist())
        assert row["output"] == want
        assert row["correct"] is score_answer(want, it.answer)
        assert row["seconds"] > 0
        assert {k: row[k] for k in it.as_dict()} == it.as_dict()
        assert "prompt_ids" not in row


def test_retrieve_scores_a_correct_continuation(model, tok, monkeypatch):
    """The output is the new tokens only, decoded: a model that says the answer is correct."""
    it = make_retrieval("needle", tok, 160, 0.0, 2)

    def says_answer(m, ids, n, temperature):
        assert temperature == 0.0 and n == 8 and ids.tolist() == it.prompt_ids
        return torch.cat([ids, torch.tensor(tok.encode(f" {it.answer}. Done"))])
    monkeypatch.setattr(longctx, "generate", says_answer)
    (row,) = retrieve(model, tok, [it])
    assert row["output"] == f" {it.answer}. Done" and row["correct"] is True


def test_retrieve_refuses_a_prompt_beyond_max_positions(model, tok):
    long = make_retrieval("needle", tok, 4096, 0.5, 0)
    with pytest.raises(K3Error, match=rf"{long.tokens}.*max_position_embeddings=2048"):
        retrieve(model, tok, [make_retrieval("needle", tok, 160, 0.5, 0), long])


def test_accept_rows(model):
    cfg = model.config
    model.train()
    try:
        rows = accept(model, [64, 4096, 256], decode_tokens=4, seed=0)
        assert model.training  # the caller's mode is restored
    finally:
        model.eval()
    assert [r["length"] for r in rows] == [64, 4096, 256]
    bad = rows[1]
    assert bad["ok"] is False and "4096" in bad["error"] and "max_position_embeddings=2048" in bad["error"]
    assert "\n" not in bad["error"]
    for r in (rows[0], rows[2]):   # positive control: the lengths that fit run, before and after it
        T = r["length"]
        assert r["ok"] is True and r["decode_tokens"] == 4
        assert r["prefill_seconds"] > 0 and r["decode_seconds"] > 0
        assert r["prefill_s_per_token"] == pytest.approx(r["prefill_seconds"] / T)
        assert r["decode_s_per_token"] == pytest.approx(r["decode_seconds"] / 4)
        want = cache_bytes_per_sequence(cfg, T, torch.float32)
        assert r["cache_mla_bytes"] == want["mla_latent"] > 0
        assert r["cache_kda_bytes"] == want["kda_state"] > 0
        assert r["cache_bytes"] == want["total"]
        if r["peak_rss_bytes"] is None:
            assert "clear_refs" in r["peak_note"]
        else:
            assert r["peak_rss_bytes"] >= r["rss_before_bytes"] > 0
    assert rows[2]["cache_mla_bytes"] == 4 * rows[0]["cache_mla_bytes"]
    assert rows[2]["cache_kda_bytes"] == rows[0]["cache_kda_bytes"]


def test_accept_without_clear_refs(model, monkeypatch):
    real_open = open

    def no_clear_refs(path, *a, **k):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *a, **k)
    monkeypatch.setattr(longctx, "open", no_clear_refs, raising=False)
    (row,) = accept(model, [32], decode_tokens=2)
    assert row["ok"] is True and row["peak_rss_bytes"] is None
    assert "clear_refs is not writable" in row["peak_note"]


def test_queried_fact_stays_at_the_ends_among_crowded_facts(tok):
    """With 8 facts and one short filler sentence other facts share the first and last boundary;
    depth 0 / 1 still put the queried fact first / last in the haystack."""
    with pytest.raises(K3Error, match="alone take") as e:
        make_retrieval("multikey", tok, 50, 0.0, 0, n_keys=8)
    length = int(re.search(r"alone take (\d+) tokens", str(e.value)).group(1)) + 15
    shared = 0
    for seed in range(4):
        for depth, check in ((0.0, str.startswith), (1.0, str.endswith)):
            it = make_retrieval("multikey", tok, length, depth, seed, n_keys=8)
            assert solve(it.prompt) == it.answer
            start, end = haystack_span(it.prompt)
            hay = it.prompt[start:end]
            assert check(hay, f"The secret code of {it.query} is {it.answer}.")
            # another fact sits on the same side of the filler (the case this test is about)
            parts = re.split(r"(?<=\.) (?!The secret code)", hay)
            edge = parts[0] if depth == 0.0 else parts[-1]
            shared += len(FACT_RE.findall(edge)) > 1
    assert shared >= 2


def test_training_documents_answer_every_fact_and_share_the_item_format():
    """Each answered line of a training document, cut before its value, is a prompt the exact
    solver answers with that value (so the document teaches what the evaluation asks); its keys
    never come from the evaluation items' stream."""
    from k3.rl.longctx import make_retrieval, solve, training_document

    doc = training_document(5, 200, 6)
    body, qa = doc.rsplit("\n\n", 1)
    lines = qa.strip().splitlines()
    assert len(lines) == 6
    for line in lines:
        prompt, value = line.rsplit(" ", 1)
        assert solve(body + "\n\n" + prompt) == value.rstrip(".")
    assert len(body.split()) >= 200
    assert training_document(5, 200, 6) == doc and training_document(6, 200, 6) != doc
    item = make_retrieval("multikey", type("T", (), {"encode": staticmethod(str.split)})(), 300, 0.5, 5, n_keys=6)
    assert not set(item.keys) & {line.split(" of ", 1)[1].split("?")[0] for line in lines}


@pytest.fixture(scope="module")
def doc_tok():
    from k3.rl.longctx import training_document

    return train_tokenizer([training_document(i, 100, 3) for i in range(200)], vocab_size=500)


@pytest.mark.parametrize("min_keys", [None, 1])
def test_retrieval_batches_train_only_answers_each_with_its_fact_in_the_row(doc_tok, min_keys):
    """Every row is one document: the trained targets are exactly its answered questions, and
    each answer is what the exact solver reads off the row's own input before that question (no
    question is cut off from its fact); nothing before the questions nor in the padding is
    trained; rows never exceed seq_len and their lengths spread over the training length. With
    ``min_keys`` the fact counts spread over [min_keys, n_keys]."""
    from k3.data.packing import IGNORE_INDEX
    from k3.rl.longctx import RetrievalBatches

    src = RetrievalBatches(doc_tok, 8, 3, min_keys=min_keys)
    lengths, counts = [], set()
    for _ in range(4):
        x, y = src.next_batch(320)
        assert x.shape == y.shape == (8, 320)
        for r in range(8):
            trained = (y[r] != IGNORE_INDEX).nonzero().flatten()
            first, last = int(trained[0]), int(trained[-1])
            assert (y[r, first:last + 1] != IGNORE_INDEX).all()     # one trained span, at the end
            assert (y[r, last + 1:] == IGNORE_INDEX).all() and (x[r, last + 1:] == 0).all()
            lengths.append(last + 2)
            text_in = doc_tok.decode(x[r, :first + 1].tolist())
            assert text_in.endswith("\n\n") and "Question:" not in text_in
            answers = doc_tok.decode(y[r, first:last + 1].tolist())
            assert answers.startswith("Question:")
            lines = answers.splitlines()
            counts.add(len(lines))
            before = text_in
            for line in lines:
                prompt, value = line.rsplit(" ", 1)
                assert solve(before + prompt) == value.rstrip(".")
                before += line + "\n"
            assert x[r, first + 1:last + 1].tolist() == y[r, first:last].tolist()   # inputs = targets shifted
    assert counts == ({3} if min_keys is None else {1, 2, 3})
    assert max(lengths) <= 321 and max(lengths) >= 290 and min(lengths) <= 240


def test_retrieval_batches_resume_and_refuse_a_row_too_short(doc_tok):
    from k3.rl.longctx import RetrievalBatches

    a = RetrievalBatches(doc_tok, 4, 3)
    a.next_batch(320)
    state = a.state_dict()
    want = a.next_batch(320)
    b = RetrievalBatches(doc_tok, 4, 3)
    b.load_state_dict(state)
    got = b.next_batch(320)
    assert all(torch.equal(u, v) for u, v in zip(want, got, strict=True))
    assert not torch.equal(RetrievalBatches(doc_tok, 4, 3, seed=1).next_batch(320)[0], want[0])
    with pytest.raises(K3Error, match="3 facts takes .* tokens without filler"):
        RetrievalBatches(doc_tok, 4, 3).next_batch(120)
    RetrievalBatches(doc_tok, 4, 1).next_batch(120)   # positive control: one fact fits in 120
    with pytest.raises(K3Error, match="min_keys=4 is more than n_keys=3"):
        RetrievalBatches(doc_tok, 4, 3, min_keys=4)


def test_a_run_on_retrieval_batches_saves_their_tokenizer(doc_tok, tmp_path):
    """Trainer(batches=RetrievalBatches) keeps the batch source's tokenizer with its checkpoint,
    so the run loads for evaluation like a corpus run; resuming checks the source's fingerprint."""
    from k3.infer.run_model import load_run_model
    from k3.rl.longctx import RetrievalBatches
    from k3.train.config import TrainConfig
    from k3.train.loop import Trainer

    tc = TrainConfig.build(None, {"preset": "nano", "out": str(tmp_path / "run"), "steps": 2, "batch_size": 2,
                                  "curriculum": [[0, 320]], "eval_interval": 0, "ckpt_interval": 0, "threads": 1,
                                  "plot": False})
    assert Trainer(tc, print_fn=lambda *a: None, tty=False,
                   batches=RetrievalBatches(doc_tok, 2, 3)).train().status == "done"
    small = train_tokenizer([longctx.training_document(i, 50, 3) for i in range(50)], vocab_size=600)
    with pytest.raises(ValueError, match="tokenizer has 600 ids but the model's vocab_size is 512"):
        Trainer(TrainConfig.build(None, {**tc.to_dict(), "out": str(tmp_path / "small")}), print_fn=lambda *a: None,
                tty=False, batches=RetrievalBatches(small, 2, 3))
    model, tok = load_run_model(tmp_path / "run")
    assert tok.fingerprint == doc_tok.fingerprint
    assert model.config.vocab_size >= tok.vocab_size
    other = train_tokenizer([longctx.training_document(i, 50, 3) for i in range(50)], vocab_size=500)
    tc2 = TrainConfig.build(None, {**tc.to_dict(), "steps": 3})
    with pytest.raises(Exception, match="fingerprint"):
        Trainer(tc2, resume=True, print_fn=lambda *a: None, tty=False, batches=RetrievalBatches(other, 2, 3))
    t = Trainer(tc2, resume=True, print_fn=lambda *a: None, tty=False, batches=RetrievalBatches(doc_tok, 2, 3))
    assert t.train().status == "done" and t.step == 3
