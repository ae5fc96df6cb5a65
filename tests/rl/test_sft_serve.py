"""After ``k3 sft``, ``k3 serve`` of the run answers a chat message through the ``openai`` client with a
closed thinking section and a visible answer; the checkpoint it started from does not (control)."""

import json

import openai
import pytest

from k3.cli.train import sft_main
from k3.serve.launch import launch

TEXT = "Hello! The user greets me, so I greet back. Hi there, nice to meet you. How are you today? "
ANSWER = "Hi, nice to meet you."  # the same for every name: a fact the toy model learns for sure
NAMES = ["Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lu"]


def chat(name):
    return {"messages": [{"role": "user", "content": f"Hello! I am {name}."},
                         {"role": "assistant", "reasoning_content": "The user greets me, so I greet back.",
                          "content": ANSWER}]}


def ask(server, name="Max"):  # a name the conversations never had
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=60, temperature=0,
                                       messages=[{"role": "user", "content": f"Hello! I am {name}."}])
    return r.choices[0]


@pytest.mark.slow
def test_served_sft_model_closes_its_thinking_and_answers(tmp_path, make_nano_checkpoint):
    ckpt, _, _ = make_nano_checkpoint(tmp_path / "nano", TEXT)
    data = tmp_path / "hello.jsonl"
    data.write_text("".join(json.dumps(chat(n)) + "\n" for n in NAMES * 3))
    assert sft_main(["--from", str(ckpt), "--data", str(data), "--out", str(tmp_path / "run"),
                     "--steps", "150", "--batch-size", "4", "--seq-len", "64", "--lr", "1e-2",
                     "--warmup-frac", "0.05", "--threads", "1", "--no-plot", "--eval-interval", "0",
                     "--val-percent", "0", "--balance", "off"]) == 0
    with launch(tmp_path / "run", threads=1) as server:
        got = ask(server)
    assert got.finish_reason == "stop"
    assert got.message.model_extra["reasoning_content"] == "The user greets me, so I greet back."
    assert got.message.content == ANSWER
    # control: the checkpoint it started from neither closes its thinking nor answers so
    with launch(ckpt, threads=1) as server:
        before = ask(server)
    assert before.message.content != ANSWER
