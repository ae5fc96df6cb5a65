"""``EventBridge``: many streams read in one event loop, woken once per engine step (not once per
token and stream), with every stream's events equal to what the blocking handle gives; leaving a
stream early cancels its request; a failed request raises in its stream."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from k3.config import get_preset
from k3.errors import K3Error
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model.decoder import K3ForCausalLM
from k3.serve.bridge import EventBridge

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(get_preset("nano")).eval()


@pytest.fixture
def engine(model):
    eng = Engine(model, max_batch=8)
    yield eng
    eng.close()
    assert not [t for t in threading.enumerate() if t.name == "k3-engine"]


def _prompts(k):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (3 + i,), generator=g).tolist() for i in range(k)]


async def _read(bridge, handle, stop_after=None):
    out = []
    async for ev in bridge.events(handle):
        out.append(ev)
        if stop_after is not None and len(out) >= stop_after:
            break
    return out


def test_eight_streams_in_one_loop_equal_the_blocking_handles(engine):
    prompts = _prompts(8)
    want = [c.token_ids for c in engine.generate(prompts, PARAMS)]  # the positive reference

    async def main():
        bridge = EventBridge(engine, asyncio.get_running_loop())
        try:
            s0 = engine.stats()["decode_steps"]
            handles = [engine.submit(p, PARAMS) for p in prompts]
            got = await asyncio.gather(*(_read(bridge, h) for h in handles))
            return got, bridge.wakeups, engine.stats()["decode_steps"] - s0
        finally:
            bridge.close()

    got, wakeups, steps = asyncio.run(main())
    assert [[e.token_id for e in evs] for evs in got] == want
    assert all(evs[-1].finish_reason == "length" for evs in got)
    # one wake-up per engine step at most (plus the prefill steps), never one per token and stream
    assert 0 < wakeups <= steps + len(prompts) < 8 * PARAMS.max_tokens


def test_leaving_a_stream_cancels_its_request_and_errors_reach_the_stream(engine):
    async def main():
        bridge = EventBridge(engine, asyncio.get_running_loop())
        try:
            h = engine.submit(_prompts(1)[0], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
            first = await _read(bridge, h, stop_after=2)  # then the generator is closed: cancel
            bad = engine.submit([], PARAMS)  # refused at submit: empty prompt
            with pytest.raises(K3Error, match="prompt: empty"):
                await _read(bridge, bad)
            ok = await _read(bridge, engine.submit(_prompts(1)[0], PARAMS))  # positive control
            return h, first, ok
        finally:
            bridge.close()

    h, first, ok = asyncio.run(main())
    assert len(first) == 2 and len(ok) == PARAMS.max_tokens
    for _ in h:  # the cancelled request's stream ends ...
        pass
    assert h.finish_reason == "cancelled"
    st = engine.stats()
    assert st["active"] == 0 and st["waiting"] == 0  # ... and its slot is free
