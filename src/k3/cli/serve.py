"""``k3 serve CKPT [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--allow-missing-reasoning]``.

Binds the socket itself (``--port 0`` picks a free port) and prints ``k3 serve: listening on
http://HOST:PORT`` on stdout once it is bound, then runs uvicorn until SIGINT/SIGTERM; the engine
is closed (its thread joined) on the way out.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

__all__ = ["serve_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3 serve", description="OpenAI-compatible HTTP server over the engine.")
    p.add_argument("ckpt", help="run directory, checkpoint folder, or model directory with tokenizer.json")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    p.add_argument("--allow-missing-reasoning", action="store_true",
                   help="accept assistant tool-call turns without reasoning (rendered with empty thinking)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the CKPT folder name)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prefix-cache-mb", type=int, default=256, help="0 = off")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body accepted")
    p.add_argument("--thinking-cap-low", type=int, default=None, help="thinking tokens at effort low (512)")
    p.add_argument("--thinking-cap-high", type=int, default=None, help="thinking tokens at effort high (4096)")
    return p


def serve_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from k3.data.chat import THINKING_CAPS
    from k3.errors import K3Error

    if not 0 <= args.port <= 65535:
        raise K3Error(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("prefix_cache_mb", "thinking_cap_low", "thinking_cap_high"):
        v = getattr(args, flag)
        if v is not None and v < 0:
            raise K3Error(f"--{flag.replace('_', '-')} must be >= 0, got {v}")
    if args.max_body_mb <= 0:
        raise K3Error(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    if args.api_key is not None and not args.api_key:
        raise K3Error("--api-key: the key is empty")
    caps = dict(THINKING_CAPS)
    caps["low"] = caps["low"] if args.thinking_cap_low is None else args.thinking_cap_low
    caps["high"] = caps["high"] if args.thinking_cap_high is None else args.thinking_cap_high

    import uvicorn

    from k3.infer.engine import Engine
    from k3.infer.run_model import load_run_model
    from k3.serve.app import create_app

    model, tok = load_run_model(args.ckpt, args.device)
    if tok is None:
        raise K3Error(f"{args.ckpt}: no tokenizer.json (the server needs the model's tokenizer)")
    engine = Engine(model, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, tokenizer=tok,
                    prefix_cache_bytes=args.prefix_cache_mb << 20)
    try:
        name = args.model_name or Path(args.ckpt).resolve().name
        app = create_app(engine, tok, name, api_key=args.api_key,
                         allow_missing_reasoning=args.allow_missing_reasoning,
                         max_body_bytes=int(args.max_body_mb * 2**20), thinking_caps=caps)
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        host, port = sock.getsockname()[:2]
        print(f"k3 serve: listening on http://{host}:{port} (model {name!r})", flush=True)
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
