"""The engine's model runner (SPEC §6.1): executes a ``StepPlan`` of ``k3.infer.scheduler`` on the
model, samples, and turns tokens into request events.

``execute(plan)`` runs the plan's prefill work in order — a ``PrefillChunk`` advances one request's
batch-1 cache to ``end`` (a vision request's chunk carries its image rows at the pads), a
``PrefillBatch`` runs equal-length whole prompts as one [k, n] forward — then one decode step
(one token) of every running decode group, over the engine's prepared weights where the group's
cache allows (``k3.infer.prepared``). A request consults the prefix cache once, when its first
chunk runs (``match``: its own batch-1 cache at the deepest snapshot); after every chunk ending on
a ``cache_block`` boundary or at the prompt's end its state is inserted. After its last chunk a
request samples its first token and joins the decode batch. A failing forward fails its own
requests only: a failed batch marks its requests ``solo`` and they are prefilled one by one from
the next step; a failed chunk or decode group ends its requests with the error.

The tokens of a step are sampled for all rows at once (``sampling.sample_rows``: each row as its
own sampler would, with its own generator); ``emit`` applies the thinking cap, stop tokens and
strings, ``max_tokens``, and ends a request through the engine's ``end`` callback.
"""

from __future__ import annotations

import time

import torch

from k3.errors import K3Error
from k3.infer.prepared import accepts
from k3.infer.sampling import sample_rows
from k3.infer.scheduler import DecodeGroup, PrefillBatch, Request, Scheduler, StepPlan, TokenEvent

__all__ = ["ModelRunner"]


class ModelRunner:
    """``ModelRunner(model, scheduler, lock, end, counters, vision_model=None, prefix_cache=None,
    prepared=None)``: ``model`` the text model, ``scheduler`` whose lists it reports back to (under
    ``lock``, which other threads read them under), ``end(req, ev=None, err=None)`` finishes a
    request (called under ``lock``), ``counters`` the engine's token and step counters."""

    def __init__(self, model, scheduler: Scheduler, lock, end, counters: dict, vision_model=None,
                 prefix_cache=None, prepared=None):
        self.model, self.sched, self.lock, self.end, self.counters = model, scheduler, lock, end, counters
        self.vision_model, self.prefix_cache, self.prepared = vision_model, prefix_cache, prepared
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache_block = scheduler.cache_block

    def execute(self, plan: StepPlan) -> None:
        for work in plan.prefill:
            if isinstance(work, PrefillBatch):
                self._prefill_batch(work.reqs)
                continue
            req = work.req
            if req.finished or all(r is not req for r in self.sched.prefilling):
                continue   # an earlier chunk of this request failed
            try:
                self._prefill_chunk(req, work.end)
            except Exception as e:  # noqa: BLE001 - a failure of this request's forward fails it alone
                with self.lock:
                    self.sched.remove_prefill(req)
                    self.end(req, err=e if isinstance(e, K3Error) else K3Error(f"prefill failed: {e!r}"))
        for g in list(self.sched.groups):
            try:
                self._decode(g)
            except Exception as e:  # noqa: BLE001
                with self.lock:
                    for r in g.reqs:
                        self.end(r, err=K3Error(f"decode failed: {e!r}"))
        with self.lock:
            self.sched.drop_finished()

    # -------------------------------------------------------------------------- prefill
    def _start(self, req: Request) -> None:
        """Consult the prefix cache once per request: a usable hit (1 .. n−1 tokens) becomes the
        request's own batch-1 cache and position."""
        if req.started:
            return
        req.started = True
        if self.prefix_cache is None or not Scheduler.uses_prefix(req):
            return
        hit = self.prefix_cache.match(req.cache_key)
        if hit.cache is not None and 0 < hit.length < len(req.prompt):
            req.cache, req.pos = hit.cache, hit.length

    def _prefill_batch(self, batch: list[Request]) -> None:
        """The equal-length whole prompts of ``batch`` as one [k, n] forward; each request samples
        its first token and the survivors join the decode batch with one concatenation."""
        for r in batch:
            self._start(r)
        batch = [r for r in batch if r.cache is None]   # (a hit would resume alone: not planned so)
        if not batch:
            return
        n = len(batch[0].prompt)
        ids = torch.tensor([r.prompt for r in batch], dtype=torch.long, device=self.device)
        cache = self.model.new_cache(len(batch))
        try:
            logits = self.model(ids, cache=cache, logits_to_keep=1).logits[:, -1]  # [k, V]
        except Exception:  # noqa: BLE001 - retried alone, where an error is the request's own
            for r in batch:
                r.solo = True
            return
        c = self.counters
        c["prompt_tokens"] += len(batch) * n
        c["max_prefill_batch"] = max(c["max_prefill_batch"], len(batch))
        if self.prefix_cache is not None:
            for r, rows in zip(batch, cache.split()):
                self.prefix_cache.insert(r.prompt, rows)
        for r in batch:
            r.pos = n
        self.emit_rows(batch, logits)
        with self.lock:
            self.sched.prefilled(batch, cache)

    def _prefill_chunk(self, req: Request, end: int) -> None:
        """Run ``req``'s prompt from its position to ``end``; after the last chunk the first token is
        sampled and the request joins the decode batch."""
        n = len(req.prompt)
        self._start(req)
        if req.cache is None:
            req.cache, req.pos = self.model.new_cache(1), 0
        if req.pos >= end:
            return
        ids = torch.tensor([req.prompt[req.pos: end]], dtype=torch.long, device=self.device)
        top = req.params.prompt_logprobs
        args, kw = (ids,), {}
        if req.images is not None:   # the chunk's embeddings with the image rows at its pads (k3.infer.media)
            rows = req.images.rows(self.vision_model, self.dtype, self.device)
            args, kw = (), {"inputs_embeds": req.images.embed(self.model, req.prompt, ids, req.pos, rows)}
        if top is None:
            logits = self.model(*args, **kw, cache=req.cache, logits_to_keep=1).logits[0, -1]
        else:   # every position's logits: the logprob of each next prompt token
            every = self.model(*args, **kw, cache=req.cache).logits[0]
            self._score_prompt(req, every, end, top)
            logits = every[-1]
        self.counters["prompt_tokens"] += end - req.pos
        req.pos = end
        if self.prefix_cache is not None and (end % self.cache_block == 0 or end == n):
            self.prefix_cache.insert(req.cache_key[:end], req.cache)
        if end < n:
            return
        req.handle.prompt_logprobs = req.prompt_lps   # before the first event reaches the caller
        self.emit_rows([req], logits[None])
        rows, req.cache = req.cache, None
        with self.lock:
            self.sched.prefilled([req], rows)

    @staticmethod
    def _score_prompt(req: Request, logits: torch.Tensor, end: int, top: int) -> None:
        """Append the logprobs of prompt tokens pos+1 .. end-1 (and, with ``top``, their top
        alternatives) from this chunk's logits [end - pos, V]; the first prompt token gets None."""
        if req.prompt_lps is None:
            req.prompt_lps = [None]
        lp = torch.log_softmax(logits.float(), -1)
        nxt = req.prompt[req.pos + 1: end + 1]          # the token each position predicts
        # (empty when the chunk is the prompt's last token alone: it predicts no prompt token)
        got = lp[torch.arange(len(nxt)), torch.tensor(nxt, dtype=torch.long, device=lp.device)].tolist()
        alts = lp[:len(nxt)].topk(min(top, lp.shape[-1])) if top else None
        for j, v in enumerate(got):
            req.prompt_lps.append((v, list(zip(alts.indices[j].tolist(), alts.values[j].tolist())) if top else []))

    # --------------------------------------------------------------------------- decode
    def _decode(self, g: DecodeGroup) -> None:
        tokens = g.last_tokens(self.device)                                   # [B, 1]
        prepared = self.prepared.current() if self.prepared is not None and accepts(g.cache) else None
        logits = self.model(tokens, cache=g.cache, logits_to_keep=1, prepared=prepared).logits[:, -1]
        c = self.counters
        c["decode_steps"] += 1
        c["max_decode_batch"] = max(c["max_decode_batch"], len(g.reqs))
        self.emit_rows(g.reqs, logits)

    # ------------------------------------------------------------------------- sampling
    def emit_rows(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample every unfinished request's next token from its row of logits [B, V] in one
        batched pass (``sample_rows``: the same tokens as each request sampling alone), then emit."""
        live = [i for i, r in enumerate(reqs) if not r.finished]
        if not live:
            return
        rows = logits if len(live) == len(reqs) else logits[live]
        tokens = sample_rows(rows, [reqs[i].sampler for i in live])
        for i, tok in zip(live, tokens):
            self.emit(reqs[i], logits[i], tok)

    def emit(self, req: Request, logits: torch.Tensor, tok: int) -> None:
        """Send ``req``'s next token ``tok`` (sampled from its logits [V]) as its event; the
        thinking cap may replace it; finish the request if it ends."""
        p = req.params
        cap = p.max_thinking_tokens
        if cap is not None and len(req.out) >= cap and p.think_end_id not in req.out:
            tok = p.think_end_id  # the thinking cap: close the thinking section, the answer follows
        req.sampler.observe(tok)
        lp, top = req.sampler.logprobs(logits, tok) if p.logprobs is not None else (None, None)
        req.out.append(tok)
        if req.t_first is None:
            req.t_first = time.perf_counter()
        self.counters["generated_tokens"] += 1
        eos = self.model.config.eos_token_id
        if tok in p.stop_token_ids or (not p.ignore_eos and eos is not None and tok == eos):
            delta, finish = req.stream.flush(), "stop"
        else:
            delta, stopped = req.stream.push(req.out)
            finish = "stop" if stopped else None
            if finish is None and len(req.out) >= req.max_tokens:
                delta, finish = delta + req.stream.flush(), "length"
        ev = TokenEvent(tok, delta, lp, finish, top)
        if finish is None:
            req.handle._put(ev)
        else:
            with self.lock:
                self.end(req, ev)
