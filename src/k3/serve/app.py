"""The OpenAI-compatible HTTP API over one ``Engine`` (SPEC §6.4): ``create_app(engine, tokenizer, ...)``.

Routes: ``GET /`` (the chat page, ``k3.serve.page``), ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (both stream as server-sent events when ``stream`` is true), ``GET /health``,
``GET /metrics``.

Every error goes through one handler (``_error``) and is answered as ``{"error": {message, type,
param, code}}``: bad input is 4xx (400 invalid, 401 auth, 404 unknown model or route, 413 body too
large); only a fault of the server itself is 5xx. Bodies are read here (not by FastAPI) so that a
size limit, invalid JSON and invalid UTF-8 are refused before any parsing.

Each request is one engine submission; its events reach the event loop through one
``EventBridge`` (``k3.serve.bridge``: one loop wake-up per engine step for all streams). When a
streaming client goes away, the response task is cancelled and the request is cancelled in the
engine at once (its batch slot and cache are freed before the next step).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.data.chat import ChatFormat, thinking_budget
from k3.errors import K3Error
from k3.infer.sampling import SamplingParams
from k3.serve.bridge import EventBridge
from k3.serve.chat import chat_stream, chat_whole, completion_stream, completion_whole
from k3.serve.forcing import forced_call_ids, forced_events
from k3.serve.metrics import Metrics
from k3.serve.page import chat_page
from k3.serve.protocol import ApiError, ChatRequest, CompletionRequest, error_body

__all__ = ["create_app", "Service"]


class Service:
    """What the routes share: engine, tokenizer, chat format, options, metrics."""

    def __init__(self, engine, tokenizer, model_name: str, api_key: str | None = None,
                 allow_missing_reasoning: bool = False, max_body_bytes: int = 4 << 20,
                 thinking_caps: dict | None = None):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        vision = getattr(engine, "vision_model", None)   # images in chats when the model has a tower
        self.fmt = ChatFormat(tokenizer, vision.image_proc if vision is not None else None)
        self.api_key, self.allow_missing_reasoning = api_key, allow_missing_reasoning
        self.max_body_bytes, self.thinking_caps = max_body_bytes, thinking_caps
        self.max_pos = engine.config.max_position_embeddings
        self.metrics = Metrics()
        self.created = int(time.time())
        self._bridge: EventBridge | None = None

    def events(self, handle):
        """The handle's TokenEvents as an async iterator in the running loop (``EventBridge``)."""
        loop = asyncio.get_running_loop()
        if self._bridge is None or self._bridge.loop is not loop:
            if self._bridge is not None:
                self._bridge.close()
            self._bridge = EventBridge(self.engine, loop)
        return self._bridge.events(handle)

    # ---------------------------------------------------------------------- request checks
    def auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if got != f"Bearer {self.api_key}":
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                           "authentication_error", code="invalid_api_key")

    async def body(self, request: Request, model_cls):
        """Read at most ``max_body_bytes``, parse JSON, validate into ``model_cls``."""
        size, parts = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size <= self.max_body_bytes:
                parts.append(chunk)
            elif size > 8 * self.max_body_bytes:
                break  # stop reading a hostile body early; the answer is the same
        if size > self.max_body_bytes:
            raise ApiError(413, f"request body of {size}+ bytes exceeds the limit of {self.max_body_bytes} bytes",
                           code="body_too_large")
        try:
            data = json.loads(b"".join(parts))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise ApiError(400, f"request body is not valid JSON ({type(e).__name__})", code="invalid_json") \
                from None
        if not isinstance(data, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ApiError(400, f"{where}: {err['msg']}", param=where) from None
        if req.model != self.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return req

    def max_tokens(self, asked: int | None, prompt_len: int) -> int:
        room = self.max_pos - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; the context is {self.max_pos}",
                           param="messages", code="context_length_exceeded")
        if asked is not None and asked > room:
            raise ApiError(400, f"max_tokens={asked} exceeds the {room} tokens left in the context "
                                f"({prompt_len} prompt tokens of {self.max_pos})", param="max_tokens")
        return room if asked is None else asked

    def params(self, req, max_tokens: int, **extra) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p),
                              top_k=req.top_k, min_p=float(req.min_p), seed=req.seed,
                              presence_penalty=float(req.presence_penalty),
                              frequency_penalty=float(req.frequency_penalty),
                              repetition_penalty=float(req.repetition_penalty), ignore_eos=req.ignore_eos,
                              **extra)

    def submit(self, ids, params, images=None):
        handle = self.engine.submit(ids, params, images=images)
        if handle.error is not None:  # validated in submit: the request never ran
            raise ApiError(400, str(handle.error))
        return handle

    # ------------------------------------------------------------------------- chat prompt
    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], SamplingParams, list | None]:
        """(prompt ids, sampling params, the prompt's images or None)."""
        tools = _check_tools(req.tools, req.tool_choice)
        effort = req.reasoning_effort or "max"
        chat = self.fmt.render_chat(req.messages, tools=tools, reasoning_effort=effort,
                                    allow_missing_reasoning=self.allow_missing_reasoning)
        ids, images = chat.ids, [im.image for im in chat.images] or None
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; send one", param="max_tokens")
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        cap = thinking_budget(effort, self.thinking_caps)
        params = self.params(req, self.max_tokens(asked, len(ids)), stop_token_ids=(self.fmt.end_id,),
                             max_thinking_tokens=cap, think_end_id=self.fmt.think_end_id)
        return ids, params, images


def _check_tools(tools, choice):
    """The tools to render: ``tool_choice`` "none" renders none; "required" and a named function need
    tools (and the name must be one of them). Tool specs themselves are checked by the renderer."""
    if choice is None or choice == "auto":
        return tools
    if not tools:
        raise ApiError(400, f"tool_choice {choice!r} needs a non-empty tools list", param="tool_choice")
    if choice == "none":
        return None
    if choice == "required":
        return tools
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or set(choice) - {"type", "function"} or set(fn) - {"name"}:
        raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or "
                            "{'type': 'function', 'function': {'name': NAME}}", param="tool_choice")
    names = [t["function"].get("name") for t in tools
             if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return tools


def _error(request: Request, exc: Exception) -> JSONResponse:
    """The one exception handler: every error becomes an OpenAI-style body."""
    if isinstance(exc, ApiError):
        status, body = exc.status, error_body(exc.message, exc.type, exc.param, exc.code)
    elif isinstance(exc, K3Error):  # the renderer / sampling params naming a bad field
        status, body = 400, error_body(str(exc))
    elif isinstance(exc, RequestValidationError):
        status, body = 400, error_body(str(exc.errors()[:1]))
    elif isinstance(exc, StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        status, body = exc.status_code, error_body(str(exc.detail), kind)
    else:
        status, body = 500, error_body(f"internal error: {exc!r}", "server_error")
    return JSONResponse(body, status_code=status)


class _CountStatus:
    """ASGI middleware: count every HTTP response by path and status (streams count at their start)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in _PATHS else "other"

        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.request(path, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            # an unhandled error is answered by Starlette's outermost middleware, outside this one:
            # count the 500 it sends here, so /metrics never hides a server error
            if not started:
                self.metrics.request(path, 500)
            raise


_PATHS = {"/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"}


def create_app(engine, tokenizer, model_name: str, **options) -> FastAPI:
    svc = Service(engine, tokenizer, model_name, **options)
    app = FastAPI(title="k3 serve", docs_url=None, redoc_url=None)
    for exc in (ApiError, K3Error, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc, _error)
    app.add_middleware(_CountStatus, metrics=svc.metrics)
    app.state.service = svc

    @app.get("/")
    def page():
        return HTMLResponse(chat_page())

    @app.get("/health")
    def health():
        ok = engine._thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(svc.metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models(request: Request):
        svc.auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": svc.created,
                                            "owned_by": "k3"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        svc.auth(request)
        req = await svc.body(request, ChatRequest)
        ids, params, images = svc.chat_prompt(req)
        forced = forced_call_ids(svc.fmt, req.messages, req.tool_choice)
        if forced is None:
            handle = svc.submit(ids, params, images)
            evs = svc.events(handle)
        else:
            handle, evs = None, forced_events(svc, ids, params, forced, svc.events, images)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(chat_stream(svc, handle, evs, rid, len(ids), usage))
        return await _unless_gone(request, chat_whole(svc, handle, evs, rid, len(ids)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        svc.auth(request)
        req = await svc.body(request, CompletionRequest)
        ids = _prompt_ids(req.prompt, tokenizer)
        stop = [_checked_text(t, "stop") for t in ([req.stop] if isinstance(req.stop, str) else req.stop or [])]
        if req.stream and (req.echo or req.logprobs is not None):
            raise ApiError(400, "echo and logprobs are not supported with stream",
                           param="echo" if req.echo else "logprobs")
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens=0 only scores the prompt: it needs echo=true", param="max_tokens")
        score_only = req.max_tokens == 0   # one token is generated and dropped: the prompt's scores are the answer
        params = svc.params(req, svc.max_tokens(1 if score_only else req.max_tokens, len(ids)), stop=stop,
                            logprobs=req.logprobs,
                            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
        handle = svc.submit(ids, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(completion_stream(svc, handle, svc.events(handle), rid, len(ids), usage))
        echo = ids if req.echo else None
        return await _unless_gone(request, completion_whole(svc, handle, svc.events(handle), rid, len(ids),
                                                            echo=echo, logprobs=req.logprobs, score_only=score_only))

    return app


def _checked_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (``"\ud800"`` in JSON) cannot be encoded
    as UTF-8 nor tokenized, so it is the client's error, not the server's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (a lone surrogate)", param=param) from None
    return text


def _prompt_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(_checked_text(prompt, "prompt"))
    elif prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is not supported; send one",
                           param="prompt")
        ids = tokenizer.encode(_checked_text(prompt[0], "prompt"))
    else:
        ids = list(prompt)
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    return ids


async def _unless_gone(request: Request, coro):
    """Await a whole (non-streamed) reply, checking every 0.2 s whether the client is still there;
    if it left, the reply task is cancelled, which cancels the request in the engine."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return JSONResponse(error_body("the client closed the connection", code="client_closed"),
                                status_code=499)


def _sse(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
