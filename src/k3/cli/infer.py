"""``k3 generate CKPT --prompt ...`` (streaming) and ``k3 chat CKPT`` (interactive), on the Engine.

``CKPT`` is a run directory, a checkpoint folder or a model directory with ``tokenizer.json``
(``k3.infer.run_model.load_run_model``). Errors are one line and exit 2 (``k3.cliutil.guarded``,
applied to every delegated subcommand by ``k3.cli``).

The chat template (SPEC §6.3) comes from ``k3.data.chat.ChatFormat``, the renderer training and
the server share: earlier assistant turns keep their reasoning (preserved thinking), the
generation prompt ends with ``<think>``, and message text is encoded as plain text, so a user
typing ``<|im_end|>`` cannot forge a special token.
"""

from __future__ import annotations

import argparse
import sys
import time

from k3.infer.run_model import check_prompt, load_run_model

__all__ = ["generate_main", "chat_main"]

DIM, RESET = "\x1b[2m", "\x1b[0m"


def _sampling_args(p: argparse.ArgumentParser, temperature: float, prefix_cache_mb: int) -> None:
    p.add_argument("ckpt", help="run directory, checkpoint folder, or model directory with tokenizer.json")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix-cache-mb", type=int, default=prefix_cache_mb,
                   help=f"prefix cache budget in MiB, 0 = off (default {prefix_cache_mb})")


def _params(args, stop_token_ids=()):
    """SamplingParams from the flags; an invalid value is reported under its flag's name."""
    import re

    from k3.errors import K3Error
    from k3.infer.sampling import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              stop=args.stop, seed=args.seed, ignore_eos=args.ignore_eos,
                              stop_token_ids=tuple(stop_token_ids))
    except K3Error as e:
        raise K3Error(re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                             str(e))) from None


def _engine(args):
    from k3.infer.engine import Engine
    from k3.infer.run_model import load_run_model

    from k3.errors import K3Error

    if args.prefix_cache_mb < 0:
        raise K3Error(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.prefill_chunk < 1:
        raise K3Error(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    model, tok = load_run_model(args.ckpt, args.device)
    return Engine(model, max_batch=1, prefill_chunk=args.prefill_chunk, tokenizer=tok,
                  prefix_cache_bytes=args.prefix_cache_mb << 20), tok


def _rate(n: int, t0: float, t_first: float | None, t_end: float) -> str:
    decode = n - 1
    dt = t_end - (t_first or t0)
    tps = f"{decode / dt:.1f} tokens/s decode" if decode > 0 and dt > 0 else "n/a tokens/s"
    ttft = f"{((t_first or t_end) - t0) * 1000:.0f} ms to first token"
    return f"{n} tokens, {tps}, {ttft}"


def generate_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 generate", description="Continue a prompt, streaming the text.")
    _sampling_args(p, temperature=0.8, prefix_cache_mb=0)
    p.add_argument("--prompt", required=True, help="text to continue")
    args = p.parse_args(argv)
    from k3.errors import K3Error

    if not args.prompt:
        raise K3Error("--prompt: the prompt is empty")
    params = _params(args)
    engine, tok = _engine(args)
    with engine:
        t0 = time.perf_counter()
        t_first, n, reason = None, 0, None
        for ev in engine.submit(tok.encode(args.prompt), params):
            if ev.token_id is not None:
                n += 1
                t_first = t_first or time.perf_counter()
            reason = ev.finish_reason or reason
            sys.stdout.write(ev.text_delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(f"[{_rate(n, t0, t_first, time.perf_counter())}; finish: {reason}]", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------ chat
def _reply(engine, chat, ids, params, show_thinking: bool, out) -> tuple[str, str, str]:
    """Stream one assistant turn; returns (reasoning, content, stats line)."""
    think_end = chat.think_end_id
    parts = {"reasoning": [], "content": []}
    mode, n_think, n, t_first = "reasoning", 0, 0, None
    t0 = time.perf_counter()
    if show_thinking:
        out.write(DIM)
    for ev in engine.submit(ids, params):
        if ev.token_id is not None:
            n += 1
            t_first = t_first or time.perf_counter()
        delta = ev.text_delta
        if mode == "reasoning" and ev.token_id == think_end:
            parts["reasoning"].append(delta.replace("</think>", "", 1))
            if show_thinking:
                out.write(parts["reasoning"][-1] + RESET + "\n")
            else:
                out.write(f"{DIM}(thinking: {n_think} tokens; --show-thinking shows them){RESET}\n")
            mode = "content"
            continue
        parts[mode].append(delta)
        if mode == "reasoning":
            n_think += ev.token_id is not None
            if show_thinking:
                out.write(delta)
        else:
            out.write(delta)
        out.flush()
    if mode == "reasoning":
        out.write(RESET if show_thinking else f"{DIM}(thinking: {n_think} tokens, unfinished){RESET}")
    out.write("\n")
    return "".join(parts["reasoning"]), "".join(parts["content"]), _rate(n, t0, t_first, time.perf_counter())


def chat_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 chat", description="Chat with a model (one line per message; "
                                "/exit or end of input quits).")
    _sampling_args(p, temperature=0.6, prefix_cache_mb=256)  # each turn resumes from the last
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--show-thinking", action="store_true", help="show the reasoning (dimmed)")
    args = p.parse_args(argv)
    from k3.data.chat import ChatFormat

    engine, tok = _engine(args)
    chat = ChatFormat(tok)  # the one SPEC §6.3 renderer (k3.data.chat), shared with training and serving
    params = _params(args, stop_token_ids=[chat.end_id])
    messages = [{"role": "system", "content": args.system}] if args.system else []
    tty = sys.stdin.isatty()
    with engine:
        while True:
            if tty:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            reasoning, content, rate = _reply(engine, chat, chat.render(messages), params,
                                              args.show_thinking, sys.stdout)
            messages.append({"role": "assistant", "content": content, "reasoning": reasoning})
            print(f"{DIM}[{rate}]{RESET}", file=sys.stderr)
    return 0


def _stream_printer(tok, prompt_len: int, ids_so_far: list[int]):
    printed = [""]

    def on_token(nxt) -> None:
        ids_so_far.append(int(nxt[0]))
        text = tok.decode(ids_so_far[prompt_len:])
        if text.endswith("\ufffd"):  # a UTF-8 sequence split across tokens: wait for the rest
            return
        sys.stdout.write(text[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = text
    return on_token


def sample_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 sample", description="Continue a prompt with a trained model.")
    p.add_argument("run", help="run directory (or its checkpoint folder)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    args = p.parse_args(argv)

    def run() -> int:
        import math

        import torch

        from k3.errors import K3Error

        from k3.infer.generate import generate
        from k3.infer.sampling import sample_next_token
        model, tok = load_run_model(args.run, args.device)
        ids = tok.encode(args.prompt)
        check_prompt(ids, args.max_new_tokens, model.config.max_position_embeddings)
        if not math.isfinite(args.temperature):
            raise K3Error(f"--temperature must be a finite number >= 0, got {args.temperature}")
        sample_next_token(torch.zeros(1, 2), args.temperature, args.top_k, args.top_p)  # validates
        sys.stdout.write(args.prompt)
        out_ids: list[int] = list(ids)
        generate(model, torch.tensor([ids]), args.max_new_tokens, args.temperature, args.top_k,
                 args.top_p, args.seed, eos=None if args.no_stop else tok.eos_token_id,
                 on_token=_stream_printer(tok, len(ids), out_ids))
        sys.stdout.write("\n")
        return 0

    from k3.cliutil import guarded
    return guarded("sample", run)
