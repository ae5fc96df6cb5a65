"""Response bodies of the chat and completion endpoints, whole and streamed (OpenAI schema).

A chat reply's generated ids go through the streaming ``ChatParser``: ``reasoning_content`` and
``content`` come back separately (in stream deltas too), tool calls as ``{id, type: "function",
function: {name, arguments}}`` with ``arguments`` a JSON string. A streamed tool call is sent
whole once its ``<|tool_call_end|>`` shows it valid (a call that does not parse comes back as
content, never half-sent). ``finish_reason`` is the parser's: "tool_calls" or "stop" after
``<|im_end|>``, else the engine's ("length", "stop" for EOS).
"""

from __future__ import annotations

import json
import time

from k3.data.chat_parser import ContentDelta, ReasoningDelta, ToolCallEnd

__all__ = ["chat_whole", "chat_stream", "completion_whole", "completion_stream"]


class _Timing:
    """Time to first token and the per-generation record for the metrics."""

    def __init__(self, svc):
        self.svc, self.t0, self.first, self.last, self.n = svc, time.perf_counter(), None, None, 0

    def token(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.svc.metrics.first_token(now - self.t0)
        self.last, self.n = now, self.n + 1

    def done(self, cancelled: bool) -> None:
        self.svc.metrics.generation(self.n, self.first, self.last, cancelled)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _run(svc, evs, on_event, out: dict):
    """Feed every event to ``on_event``, yielding what it returns; leaves ``out["n"]`` (tokens) and
    ``out["reason"]`` (the engine's finish reason)."""
    timing, reason, finished = _Timing(svc), None, False
    try:
        async for ev in evs:
            if ev.token_id is not None:
                timing.token()
            reason = ev.finish_reason or reason
            r = on_event(ev)
            if r is not None:
                yield r
        finished = True
    finally:
        timing.done(cancelled=not finished)
        out.update(n=timing.n, reason=reason)


async def chat_whole(svc, handle, evs, rid: str, n_prompt: int) -> dict:
    parser = svc.fmt.parser()
    ids = []

    def on(ev):
        if ev.token_id is not None and not parser.ended:
            ids.append(ev.token_id)
            parser.feed(ev.token_id)

    st: dict = {}
    async for _ in _run(svc, evs, on, st):
        pass
    n, reason = st["n"], st["reason"]
    res = parser.finish(reason)
    msg = {"role": "assistant", "content": res.content, "reasoning_content": res.reasoning}
    if res.tool_calls:
        msg["tool_calls"] = res.tool_calls
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": svc.model_name,
            "choices": [{"index": 0, "message": msg, "finish_reason": res.finish_reason, "logprobs": None}],
            "usage": _usage(n_prompt, n)}


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _deltas(events, parser) -> list[dict]:
    """Parser events -> OpenAI deltas; a tool call is sent whole at its valid end."""
    out = []
    for e in events:
        if isinstance(e, ReasoningDelta):
            out.append({"reasoning_content": e.text})
        elif isinstance(e, ContentDelta):
            out.append({"content": e.text})
        elif isinstance(e, ToolCallEnd) and e.valid:
            c = parser.tool_calls[e.index]
            out.append({"tool_calls": [{"index": e.index, "id": c["id"], "type": "function",
                                        "function": dict(c["function"])}]})
    return out


def _chunk(rid: str, obj: str, created: int, model: str, payload: dict, finish, usage) -> str:
    """One SSE event of a stream: a choice carrying ``payload`` (delta or text), or the final usage."""
    body = {"id": rid, "object": obj, "created": created, "model": model,
            "choices": [] if usage else [{"index": 0, **payload, "finish_reason": finish, "logprobs": None}]}
    if usage:
        body["usage"] = usage
    return _data(body)


async def chat_stream(svc, handle, evs, rid: str, n_prompt: int, include_usage: bool):
    parser, created = svc.fmt.parser(), int(time.time())

    def chunk(delta, finish=None, usage=None):
        return _chunk(rid, "chat.completion.chunk", created, svc.model_name, {"delta": delta}, finish, usage)

    def on(ev):
        if ev.token_id is None or parser.ended:
            return None
        return "".join(chunk(d) for d in _deltas(parser.feed(ev.token_id), parser)) or None

    st: dict = {}
    yield chunk({"role": "assistant", "content": ""})
    try:
        async for text in _run(svc, evs, on, st):
            yield text
    except Exception as e:  # noqa: BLE001 - the engine failed this request: say so in the stream
        yield _data({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        yield "data: [DONE]\n\n"
        return
    n, reason = st["n"], st["reason"]
    res = parser.finish(reason)
    for d in _deltas(res.tail_events, parser):
        yield chunk(d)
    yield chunk({}, res.finish_reason)
    if include_usage:
        yield chunk(None, usage=_usage(n_prompt, n))
    yield "data: [DONE]\n\n"


async def completion_whole(svc, handle, evs, rid: str, n_prompt: int, echo: list[int] | None = None,
                           logprobs: int | None = None, score_only: bool = False) -> dict:
    """The whole completion; ``echo``: the prompt ids, put before it (text and logprobs);
    ``logprobs``: OpenAI's legacy logprobs object; ``score_only``: the completion is dropped."""
    text, evs_seen, st = [], [], {}

    def on(ev):
        text.append(ev.text_delta)
        evs_seen.append(ev)

    async for _ in _run(svc, evs, on, st):
        pass
    n, reason = st["n"], st["reason"]
    if score_only:
        text, evs_seen, n, reason = [], [], 0, "length"
    tok = svc.tok
    out = "".join(text)
    lp = None
    if logprobs is not None:
        rows = []   # (token id, its logprob, [(id, logprob)] alternatives)
        if echo is not None:
            scored = handle.prompt_logprobs or [None]
            rows += [(t, None if s is None else s[0], [] if s is None else s[1]) for t, s in zip(echo, scored)]
        rows += [(ev.token_id, ev.logprob, ev.top_logprobs or []) for ev in evs_seen if ev.token_id is not None]
        strs = [tok.decode([t]) for t, _, _ in rows]
        offsets, at = [], 0
        for s_ in strs:
            offsets.append(at)
            at += len(s_)
        lp = {"tokens": strs, "token_ids": [t for t, _, _ in rows], "token_logprobs": [v for _, v, _ in rows],
              "top_logprobs": [None if v is None else {tok.decode([i]): x for i, x in alts} for _, v, alts in rows],
              "text_offset": offsets}
    if echo is not None:
        out = tok.decode(echo) + out
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": svc.model_name,
            "choices": [{"index": 0, "text": out, "finish_reason": reason or "length", "logprobs": lp}],
            "usage": _usage(n_prompt, n)}


async def completion_stream(svc, handle, evs, rid: str, n_prompt: int, include_usage: bool):
    created, st = int(time.time()), {}

    def chunk(text, finish=None, usage=None):
        return _chunk(rid, "text_completion", created, svc.model_name, {"text": text}, finish, usage)

    try:
        async for text in _run(svc, evs, lambda ev: chunk(ev.text_delta, ev.finish_reason)
                               if ev.text_delta or ev.finish_reason else None, st):
            yield text
    except Exception as e:  # noqa: BLE001
        yield _data({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
    else:
        if include_usage:
            yield chunk(None, usage=_usage(n_prompt, st["n"]))
    yield "data: [DONE]\n\n"
