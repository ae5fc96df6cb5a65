"""``tool_choice`` "required" / a named function, enforced by decoding in two phases.

Phase 1 generates the thinking as usual but stops at ``</think>`` (or ``<|im_end|>``, which is then
dropped: the model may not end its turn without the call). The server then writes the start of a
call itself — ``</think>`` if the model had not, ``<|tool_calls_section_begin|><|tool_call_begin|>``
and ``functions.{name}:{k}<|tool_call_argument_begin|>`` for a named function (``k`` = the number
of calls earlier in the conversation, as the renderer numbers them) or ``functions.`` for
"required" (the model names one) — and phase 2 continues from there with the rest of
``max_tokens``. The forced ids are reported as generated tokens (they are part of the reply).
A call the model then fails to finish as valid JSON still comes back as content (the parser's rule).
"""

from __future__ import annotations

import dataclasses

from k3.infer.scheduler import TokenEvent

__all__ = ["forced_call_ids", "forced_events"]


def forced_call_ids(fmt, messages: list, choice) -> list[int] | None:
    """The ids the server writes after the thinking, or None when nothing is forced."""
    if choice is None or choice in ("auto", "none"):
        return None
    ids = fmt.ids
    head = [ids["<|tool_calls_section_begin|>"], ids["<|tool_call_begin|>"]]
    if choice == "required":
        return head + fmt.tok.encode("functions.")
    k = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
    name = choice["function"]["name"]
    return head + fmt.tok.encode(f"functions.{name}:{k}") + [ids["<|tool_call_argument_begin|>"]]


async def forced_events(svc, prompt: list[int], params, forced: list[int], events, images=None):
    """TokenEvents of the two phases as one stream (``events(handle)`` cancels on leaving);
    ``images``: the prompt's images (both phases prefill them)."""
    fmt = svc.fmt
    p1 = dataclasses.replace(params, stop_token_ids=(fmt.end_id, fmt.think_end_id))
    out: list[int] = []
    async for ev in events(svc.submit(prompt, p1, images)):
        if ev.token_id is None:
            continue
        if ev.finish_reason is not None and ev.token_id in (fmt.end_id, fmt.think_end_id):
            break  # end of phase 1: the closing token is written below
        out.append(ev.token_id)
        yield ev
        if ev.finish_reason is not None:  # "length": no room left for a call
            return
    room = params.max_tokens - len(out)  # >= 1: the closing token phase 1 ended on counted too
    written = [fmt.think_end_id, *forced][:room]
    left = room - len(written)
    for j, t in enumerate(written):
        last = left <= 0 and j == len(written) - 1
        yield TokenEvent(t, "", None, "length" if last else None)
    if left <= 0:
        return
    p2 = dataclasses.replace(params, max_tokens=left, stop_token_ids=(fmt.end_id,), max_thinking_tokens=None)
    async for ev in events(svc.submit(prompt + out + written, p2, images)):
        yield ev
