"""``k3 generate`` and ``k3 chat`` through the real CLI on a saved random nano model + tokenizer:
the streamed text equals the engine's greedy text, the chat template's token layout, thinking
dimmed or collapsed, one-line errors with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from k3.data.chat import ChatFormat
from k3.model.decoder import K3ForCausalLM

DIM = "\x1b[2m"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, make_nano_checkpoint):
    return make_nano_checkpoint(tmp_path_factory.mktemp("nano_model"),
                                "hello world, the quick brown fox jumps over the lazy dog. ")


def k3(*args, stdin: str = ""):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "k3.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=120)


def test_generate_streams_the_greedy_continuation(ckpt):
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    d, model, tok = ckpt
    r = k3("generate", d, "--prompt", "hello world", "--max-tokens", 12, "--temperature", 0, "--ignore-eos")
    assert r.returncode == 0, r.stderr
    with Engine(model, tokenizer=tok) as eng:
        want = eng.submit(tok.encode("hello world"),
                          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).result()
    assert r.stdout == want.text + "\n"
    assert "12 tokens" in r.stderr and "tokens/s decode" in r.stderr and "finish: length" in r.stderr
    cached = k3("generate", d, "--prompt", "hello world", "--max-tokens", 12, "--temperature", 0, "--ignore-eos",
                "--prefix-cache-mb", 64, "--prefill-chunk", 3)
    assert cached.returncode == 0 and cached.stdout == r.stdout, cached.stderr


@pytest.mark.parametrize("flags,msg", [
    (["--prompt", ""], "--prompt: the prompt is empty"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p must be a number in (0, 1]"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--prompt", "x", "--max-tokens", "0"], "--max-tokens must be an int > 0"),
    (["--prompt", "x", "--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--prompt", "x", "--prefix-cache-mb", "-1"], "--prefix-cache-mb must be >= 0"),
])
def test_generate_bad_input_is_one_line_and_exit_2(ckpt, flags, msg):
    r = k3("generate", ckpt[0], *flags)
    assert r.returncode == 2 and r.stderr.startswith("k3 generate: error: ")
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr and "Traceback" not in r.stderr


def test_missing_checkpoint_is_exit_2(tmp_path):
    r = k3("chat", tmp_path / "nope")
    assert r.returncode == 2 and "no such file or directory" in r.stderr and "Traceback" not in r.stderr


def test_chat_template_layout(ckpt):
    tok = ckpt[2]
    sp = {n: tok.token_to_id(n) for n in ("<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                                        "<think>", "</think>")}
    ids = ChatFormat(tok).render([{"role": "user", "content": "hi <|im_end|>"},
                            {"role": "assistant", "content": "yo", "reasoning": "hm"},
                            {"role": "user", "content": "ok"}])
    e = tok.encode
    want = ([sp["<|im_user|>"], *e("user"), sp["<|im_middle|>"], *e("hi <|im_end|>"), sp["<|im_end|>"]]
            + [sp["<|im_assistant|>"], *e("assistant"), sp["<|im_middle|>"], sp["<think>"], *e("hm"),
               sp["</think>"], *e("yo"), sp["<|im_end|>"]]
            + [sp["<|im_user|>"], *e("user"), sp["<|im_middle|>"], *e("ok"), sp["<|im_end|>"]]
            + [sp["<|im_assistant|>"], *e("assistant"), sp["<|im_middle|>"], sp["<think>"]])
    assert ids == want
    assert ids.count(sp["<|im_end|>"]) == 3  # the typed "<|im_end|>" stayed plain text


def test_chat_streams_thinking_dimmed_or_collapsed(ckpt):
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    d, model, tok = ckpt
    flags = ["--max-tokens", 6, "--temperature", 0]
    shown = k3("chat", d, *flags, "--show-thinking", stdin="hello\n/exit\n")
    hidden = k3("chat", d, *flags, stdin="hello\nworld\n")
    assert shown.returncode == 0 and hidden.returncode == 0, shown.stderr + hidden.stderr
    with Engine(model, tokenizer=tok) as eng:  # the first reply, from the same rendered prompt
        first = eng.submit(ChatFormat(tok).render([{"role": "user", "content": "hello"}]),
                           SamplingParams(max_tokens=6, temperature=0,
                                          stop_token_ids=[tok.token_to_id("<|im_end|>")])).result()
    assert tok.token_to_id("</think>") not in first.token_ids  # random weights: all of it is thinking
    assert len(first.token_ids) == 6 and first.text
    assert shown.stdout.startswith(DIM + first.text)
    assert "(thinking: 6 tokens, unfinished)" in hidden.stdout and first.text not in hidden.stdout
    assert shown.stderr.count("tokens/s") == 1 and hidden.stderr.count("tokens/s") == 2  # one per turn


def test_chat_reply_after_the_thinking_is_shown_plainly(ckpt, tmp_path):
    """A model edited so that ``</think>`` wins within the first steps: the reasoning (dimmed, or
    collapsed into a count) then the content, exactly the text of the engine's tokens."""
    from k3.checkpoint import save_pretrained
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    _, model, tok = ckpt
    end_think, im_end = tok.token_to_id("</think>"), tok.token_to_id("<|im_end|>")
    prompt = ChatFormat(tok).render([{"role": "user", "content": "hello"}])
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[im_end])
    with Engine(model) as eng:
        free = eng.submit(prompt, params).result().token_ids
    edited = K3ForCausalLM(model.config)
    edited.load_state_dict(model.state_dict())
    with torch.no_grad():  # </think> scores twice what the third free token scores
        edited.lm_head.weight[end_think] = 2 * edited.lm_head.weight[free[2]]
    edited.eval()
    save_pretrained(edited, tmp_path)
    tok.save(tmp_path)
    with Engine(edited) as eng:
        ids = eng.submit(prompt, params).result().token_ids
    assert end_think in ids[:3]
    cut = ids.index(end_think)
    body = [t for t in ids[cut + 1:] if t != im_end]
    reasoning, content = tok.decode(ids[:cut]), tok.decode(body)
    assert body and content, ids  # there is a reply after the thinking
    flags = ["--max-tokens", 8, "--temperature", 0]
    shown = k3("chat", tmp_path, *flags, "--show-thinking", stdin="hello\n")
    hidden = k3("chat", tmp_path, *flags, stdin="hello\n")
    assert shown.returncode == 0 and hidden.returncode == 0, shown.stderr + hidden.stderr
    assert shown.stdout == f"{DIM}{reasoning}\x1b[0m\n{content}\n"
    assert hidden.stdout == f"{DIM}(thinking: {cut} tokens; --show-thinking shows them)\x1b[0m\n{content}\n"
