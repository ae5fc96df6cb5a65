"""Reasoning state through ``OpenAICompatible`` against a real ``k3 serve`` of a nano model.

Two recording proxies (in this test, loopback, free ports) stand in front of ONE server, so provider
A and provider B are different endpoints of the same model. What each proxy received is compared
with what the provider was meant to send, and the server's ``usage.prompt_tokens`` with the length
of the chat format's rendering of exactly those messages (``ChatFormat.render`` here, in the test):
the server rendered the earlier reasoning for A, and never saw A's reasoning when B was asked.
``LocalEngine`` is checked the same way in process.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from k3.agent.providers import LocalEngine, OpenAICompatible, ProviderRequest
from k3.agent.randomize import HarnessConfig
from k3.agent.tools import tool_schemas
from k3.tasks.tool_specs import DEFAULT_TOOLS
from k3.agent.turns import AgentTurn, ToolCall, ToolResult, history_messages
from k3.data.chat import ChatFormat
from k3.serve.launch import launch


@pytest.fixture(scope="module")
def nano(tmp_path_factory, make_nano_checkpoint):
    return make_nano_checkpoint(tmp_path_factory.mktemp("agent-serve") / "nano",
                                "run the shell command, read the file, then submit the work. ")


class _Recorder(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append(json.loads(body))
        r = httpx.post(self.server.upstream + self.path, content=body,
                       headers={"Content-Type": "application/json"}, timeout=120)
        self.send_response(r.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def proxies(nano):
    with launch(nano[0], "--thinking-cap-low", "3", threads=1) as srv:
        made = []
        for _ in range(2):
            p = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
            p.upstream, p.bodies = srv.url, []
            threading.Thread(target=p.serve_forever, daemon=True).start()
            made.append(p)
        try:
            yield made
        finally:
            for p in made:
                p.shutdown()
                p.server_close()


def _req(messages, tools):
    return ProviderRequest(messages, tools, HarnessConfig(), max_tokens=6, temperature=0.0, seed=0, effort="low")


@pytest.mark.slow
def test_reasoning_round_trips_to_its_own_provider_and_never_reaches_another(nano, proxies):
    fmt = ChatFormat(nano[2])
    pa_http, pb_http = proxies
    a = OpenAICompatible(f"http://127.0.0.1:{pa_http.server_port}/v1", "nano")
    b = OpenAICompatible(f"http://127.0.0.1:{pb_http.server_port}/v1", "nano")
    assert a.id != b.id
    tools = tool_schemas(HarnessConfig(), list(DEFAULT_TOOLS))
    first = a.complete(_req(history_messages("system", "list the files", [], a.id), tools))
    assert first.reasoning  # the low-effort cap ends thinking after 3 tokens; 3 tokens of text came back
    # the harness records A's turn, with one tool call and its result, and asks A again
    t1 = AgentTurn(first.visible, first.reasoning, [ToolCall("functions.list:0", "list", {"path": "."})],
                   [ToolResult("functions.list:0", "list", "calc.py (40 bytes)")], a.id)
    msgs_a = history_messages("system", "list the files", [t1], a.id)
    second = a.complete(_req(msgs_a, tools))
    got = pa_http.bodies[-1]["messages"]
    assert [m.get("reasoning_content") for m in got if m["role"] == "assistant"] == [first.reasoning]
    rendered = fmt.render(msgs_a, tools=tools, reasoning_effort="low")
    without = fmt.render([{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs_a],
                         tools=tools, reasoning_effort="low", allow_missing_reasoning=True)
    assert second.usage["prompt_tokens"] == len(rendered) > len(without)
    # the same history asked of B: A's reasoning is not sent, the turns come as a re-plan note
    msgs_b = history_messages("system", "list the files", [t1], b.id)
    third = b.complete(_req(msgs_b, tools))
    sent_b = pb_http.bodies[-1]
    assert all("reasoning_content" not in m and "reasoning" not in m for m in sent_b["messages"])
    assert first.reasoning not in [m.get("content") for m in sent_b["messages"]]
    assert third.usage["prompt_tokens"] == len(fmt.render(msgs_b, tools=tools, reasoning_effort="low"))
    assert len(pa_http.bodies) == 2 and len(pb_http.bodies) == 1
    a.close()
    b.close()


def test_local_engine_provider_renders_the_same_prompt_and_parses_reasoning(nano):
    from k3.infer.engine import Engine

    _, model, tok = nano
    with Engine(model, tokenizer=tok) as eng:
        p = LocalEngine(eng, name="nano")
        tools = tool_schemas(HarnessConfig(), ["shell", "submit"])
        msgs = history_messages("system", "run ls", [], p.id)
        r = p.complete(ProviderRequest(msgs, tools, HarnessConfig(), max_tokens=5, temperature=0.0, seed=0,
                                       effort="low"))
        assert r.usage["prompt_tokens"] == len(ChatFormat(tok).render(msgs, tools=tools, reasoning_effort="low"))
        assert r.usage["completion_tokens"] >= 1 and r.reasoning is not None


VERIFY_ZERO = ("import os, sys\nsys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\nimport vharness\n"
               "vharness.main(lambda ctx: (0.0, 'nothing to check'), __file__)\n")


@pytest.fixture(scope="module")
def env_home(tmp_path_factory):
    """One sandbox manager root for this module's task runs (the base image is built once)."""
    return tmp_path_factory.mktemp("agent-env")


def _tiny_task(tmp_path):
    d = tmp_path / "tiny-openai"
    (d / "workspace").mkdir(parents=True)
    (d / "verifier").mkdir()
    (d / "workspace" / "a.txt").write_text("hello\n")
    (d / "verifier" / "verify.py").write_text(VERIFY_ZERO)
    (d / "task.toml").write_text('id = "tiny-openai"\nkind = "shell"\ngoal = "say hi"\nsubmit = ["a.txt"]\n'
                                 "[budget]\nsteps = 3\nwall_seconds = 60\n")
    return d


@pytest.mark.slow
def test_k3_task_run_with_the_local_engine_provider(nano, tmp_path, env_home, monkeypatch, capsys):
    from k3.cli.task import task_main
    from k3.rl.trajectory import read_trajectory

    monkeypatch.setenv("K3_ENV_HOME", str(env_home))
    traj = tmp_path / "t.jsonl"
    code = task_main(["run", str(_tiny_task(tmp_path)), "--provider", "local", "--ckpt", str(nano[0]),
                      "--max-tokens", "6", "--effort", "low", "--out", str(traj)])
    assert code == 0 and "tiny-openai: score 0.000" in capsys.readouterr().out
    recs = read_trajectory(traj)
    assert recs[0]["conditions"]["model"] == {"kind": "local", "model": "nano", "id": "local:nano"}
    turn = next(r for r in recs if r["type"] == "turn")
    assert turn["provider"] == "local:nano" and turn["metadata"]["usage"]["completion_tokens"] >= 1
    from k3.env.manager import SandboxManager
    assert SandboxManager(str(env_home)).list() == []  # nothing left behind


@pytest.mark.slow
def test_k3_task_run_with_the_openai_provider_records_what_the_server_was_sent(nano, proxies, tmp_path, env_home,
                                                                              monkeypatch, capsys):
    """The whole loop with a model-backed provider, in a real namespace sandbox: the trajectory's
    conditions are what the server received (renamed tools of seed 5, prompt, sampling)."""
    from k3.env.manager import SandboxManager
    from k3.cli.task import task_main
    from k3.rl.trajectory import read_trajectory

    monkeypatch.setenv("K3_ENV_HOME", str(env_home))
    d = _tiny_task(tmp_path)
    pa = proxies[0]
    before = len(pa.bodies)
    url = f"http://127.0.0.1:{pa.server_port}/v1"
    traj = tmp_path / "t.jsonl"
    code = task_main(["run", str(d), "--provider", "openai", "--base-url", url, "--model", "nano", "--seed", "5",
                      "--max-tokens", "8", "--effort", "low", "--out", str(traj)])
    assert code == 0 and "tiny-openai: score 0.000" in capsys.readouterr().out
    recs = read_trajectory(traj)
    cond = recs[0]["conditions"]
    sent = pa.bodies[before]
    assert cond["model"] == {"kind": "openai", "base_url": url, "model": "nano", "id": f"openai:{url}#nano"}
    names = HarnessConfig.from_seed(5).tool_names   # the task allows the default tools, renamed
    assert sent["tools"] == cond["tools"] and {t["function"]["name"] for t in sent["tools"]} == \
        {names[t] for t in DEFAULT_TOOLS}
    assert sent["messages"][0]["content"] == cond["prompt"]["system"] and sent["messages"][1]["content"] == "say hi"
    assert (sent["max_tokens"], sent["reasoning_effort"], sent["seed"]) == (8, "low", 5)
    turns = [r for r in recs if r["type"] == "turn"]
    assert turns and turns[0]["provider"] == f"openai:{url}#nano" and turns[0]["reasoning"]
    assert recs[-1]["type"] == "end" and recs[-1]["tokens"] > 0
    assert SandboxManager(str(env_home)).list() == []  # nothing left behind
