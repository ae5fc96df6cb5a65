"""The request counter behind /metrics sees every status, including a 500 that Starlette's
outermost error middleware sends for an unhandled exception (outside the counting middleware)."""

import asyncio

from fastapi import FastAPI

from k3.serve.app import _CountStatus
from k3.serve.metrics import Metrics


def _call(app, path):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "http_version": "1.1", "root_path": ""}
    try:
        asyncio.run(app(scope, receive, send))
    except RuntimeError:
        pass  # the app re-raises the bug after answering 500
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_unhandled_errors_are_counted_as_500_and_normal_replies_as_they_are():
    metrics = Metrics()
    app = FastAPI()

    @app.get("/health")
    def ok():
        return {"status": "ok"}

    @app.get("/metrics")
    def broken():
        raise RuntimeError("a server bug")

    app.add_middleware(_CountStatus, metrics=metrics)
    assert _call(app, "/health") == 200          # positive control: counted as 200
    assert _call(app, "/metrics") == 500
    assert metrics.requests == {("/health", 200): 1, ("/metrics", 500): 1}
