"""Providers (SPEC §7.3): one protocol, three implementations.

``provider.complete(ProviderRequest) -> ProviderReply | None`` (None: the provider has nothing
more to say, e.g. a Scripted transcript ran out). ``provider.id`` names the provider for the
reasoning rule (reasoning goes back only to the provider that produced it); ``describe()`` is what
a trajectory records as the model.

- ``OpenAICompatible(base_url, model)``: ``POST {base_url}/chat/completions`` (k3 serve or any
  OpenAI-style API); history carries ``reasoning_content`` of this provider's own turns.
- ``LocalEngine(engine)``: the in-process ``k3.infer.Engine`` with the chat format of SPEC §6.3.
- ``Scripted(turns)``: replays transcript turns (canonical tool names, translated to the harness's
  model-side names so a renamed harness is exercised as a model sees it); ignores tool results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from k3.agent.randomize import HarnessConfig
from k3.errors import K3Error

__all__ = ["ProviderReply", "ProviderRequest", "OpenAICompatible", "LocalEngine", "Scripted", "ProviderError",
           "render_prompt", "render_request"]


class ProviderError(K3Error):
    """A provider that could not answer (HTTP error, bad reply); the message names the provider."""


@dataclass
class ProviderRequest:
    messages: list[dict]
    tools: list[dict]
    cfg: HarnessConfig
    max_tokens: int | None = None
    temperature: float = 0.0
    seed: int | None = None
    effort: str | None = None
    timeout: float = 120.0


@dataclass
class ProviderReply:
    visible: str
    reasoning: str | None
    tool_calls: list[dict]     # {"id", "name" (model-side), "arguments": dict | str (unparsed JSON)}
    usage: dict = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    finish_reason: str | None = None
    # what an in-process sampler knows (LocalEngine): {"prompt_ids", "token_ids", "logprobs" (log p of
    # each sampled token under the raw logits of the weights that sampled it), "forced" (indices of
    # tokens the engine put in itself: the thinking cap's </think>)}; None for remote providers
    sample: dict | None = None


def _calls_from_openai(raw: list | None) -> list[dict]:
    out = []
    for i, c in enumerate(raw or []):
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = args  # kept as a string: the harness answers with a bad-arguments error
        out.append({"id": c.get("id") or f"call_{i}", "name": fn.get("name", ""), "arguments": parsed})
    return out


class OpenAICompatible:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, provider_id: str | None = None):
        import httpx

        self.base_url, self.model = base_url.rstrip("/"), model
        self.id = provider_id or f"openai:{self.base_url}#{model}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers)

    def describe(self) -> dict:
        return {"kind": "openai", "base_url": self.base_url, "model": self.model, "id": self.id}

    def complete(self, req: ProviderRequest) -> ProviderReply:
        import httpx

        body = {"model": self.model, "messages": req.messages, "temperature": req.temperature}
        if req.tools:
            body["tools"] = req.tools
        for k, v in (("max_tokens", req.max_tokens), ("seed", req.seed), ("reasoning_effort", req.effort)):
            if v is not None:
                body[k] = v
        try:
            r = self._client.post(self.base_url + "/chat/completions", json=body, timeout=req.timeout)
        except httpx.HTTPError as e:
            raise ProviderError(f"provider {self.id}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise ProviderError(f"provider {self.id}: HTTP {r.status_code}: {r.text[:300]}")
        try:
            data = r.json()
            choice = data["choices"][0]
            msg = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ProviderError(f"provider {self.id}: reply is not a chat completion: {r.text[:300]}") from None
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        usage = data.get("usage") or {}
        return ProviderReply(msg.get("content") or "", reasoning, _calls_from_openai(msg.get("tool_calls")),
                             {"prompt_tokens": int(usage.get("prompt_tokens", 0)),
                              "completion_tokens": int(usage.get("completion_tokens", 0))},
                             choice.get("finish_reason"))

    def close(self) -> None:
        self._client.close()


def render_request(fmt, req: ProviderRequest):
    """``req`` rendered as ``LocalEngine`` sends it: a ``RenderedChat`` (ids, and the images of its
    image parts for the engine)."""
    return fmt.render_chat(req.messages, tools=req.tools or None, reasoning_effort=req.effort)


def render_prompt(fmt, req: ProviderRequest) -> list[int]:
    """The prompt ids ``LocalEngine`` generates from for ``req`` (``fmt``: a ``ChatFormat``): the
    messages, tools and effort rendered with the generation prompt. SFT rows render the same.
    Text only: a request with images is refused here (``LocalEngine.complete`` renders those with
    ``render_chat`` and hands the engine their pixels)."""
    return fmt.render(req.messages, tools=req.tools or None, reasoning_effort=req.effort)


class LocalEngine:
    """The in-process engine: render with ``ChatFormat``, generate, parse with its ``ChatParser``."""

    def __init__(self, engine, name: str = "local", provider_id: str | None = None):
        from k3.data.chat import ChatFormat

        if engine.tokenizer is None:
            raise K3Error("LocalEngine: the engine has no tokenizer (load it with one)")
        self.engine, self.model = engine, name
        vision = getattr(engine, "vision_model", None)   # image parts reach a model with a tower
        self.fmt = ChatFormat(engine.tokenizer, vision.image_proc if vision is not None else None)
        self.id = provider_id or f"local:{name}"

    @classmethod
    def from_checkpoint(cls, path: str, device: str = "cpu") -> "LocalEngine":
        from pathlib import Path

        from k3.infer.engine import Engine

        return cls(Engine(path, device=device), name=Path(path).resolve().name)

    def describe(self) -> dict:
        return {"kind": "local", "model": self.model, "id": self.id}

    def complete(self, req: ProviderRequest) -> ProviderReply:
        from k3.data.chat import thinking_budget
        from k3.infer.sampling import SamplingParams

        chat = render_request(self.fmt, req)
        ids, images = chat.ids, [im.image for im in chat.images] or None
        room = self.engine.config.max_position_embeddings - len(ids)
        if room < 1:
            raise ProviderError(f"provider {self.id}: the prompt has {len(ids)} tokens, no room to answer")
        cap = thinking_budget(req.effort)
        params = SamplingParams(max_tokens=min(req.max_tokens or room, room), temperature=req.temperature,
                                seed=req.seed, stop_token_ids=(self.fmt.end_id,), max_thinking_tokens=cap,
                                think_end_id=self.fmt.think_end_id, logprobs=0)
        done = self.engine.submit(ids, params, images=images).result()
        parser = self.fmt.parser()
        for t in done.token_ids:
            if parser.ended:
                break
            parser.feed(t)
        res = parser.finish(done.finish_reason)
        out = list(done.token_ids)
        end = self.fmt.think_end_id
        forced = [cap] if cap is not None and len(out) > cap and out[cap] == end and end not in out[:cap] else []
        return ProviderReply(res.content, res.reasoning, _calls_from_openai(res.tool_calls),
                             {"prompt_tokens": len(ids), "completion_tokens": len(out)},
                             res.finish_reason,
                             {"prompt_ids": list(ids), "token_ids": out, "logprobs": list(done.logprobs),
                              "forced": forced})

    def close(self) -> None:
        self.engine.close()


class Scripted:
    """Replays ``turns`` (transcript dicts: reasoning, content, tool_calls with canonical names)."""

    def __init__(self, turns: list[dict], provider_id: str = "scripted", name: str = "scripted"):
        self.turns, self.id, self.model = list(turns), provider_id, name
        self.next = 0
        self.calls_made = 0

    def describe(self) -> dict:
        return {"kind": "scripted", "model": self.model, "id": self.id, "turns": len(self.turns)}

    def complete(self, req: ProviderRequest) -> ProviderReply | None:
        if self.next >= len(self.turns):
            return None
        t = self.turns[self.next]
        self.next += 1
        calls = []
        for c in t.get("tool_calls", []):
            name, args = req.cfg.to_model(c["name"], c.get("arguments", {}))
            calls.append({"id": f"call_{self.calls_made}", "name": name, "arguments": args})
            self.calls_made += 1
        return ProviderReply(t.get("content", ""), t.get("reasoning"), calls, finish_reason="tool_calls"
                             if calls else "stop")

    def close(self) -> None:
        pass
