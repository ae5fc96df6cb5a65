"""The engine's prefill (a mixin of ``Engine``): prompt chunks of one request, or the whole short
prompts of several requests as one batched forward.

Per step the engine spends at most ``prefill_chunk`` prompt tokens, oldest request first. A
request consults the prefix cache once (``_start``): a hit gives it its own batch-1 cache at the
deepest snapshotted boundary. ``_prefill_chunk`` runs the next chunk of one request (cut at every
``cache_block`` boundary when the prefix cache is on, and the boundary snapshotted).
``_fresh_batch`` / ``_prefill_together``: prefix-cache misses waiting together whose whole prompt
is one chunk and of the same length n run as one [k, n] forward (rows of one length: no padding,
which a KDA state would absorb), then each gets its end snapshot, its first token and joins the
decode batch with one concatenation. A failing batched forward marks its requests ``solo`` and
they are retried one by one, so an error stays its own request's.
"""

from __future__ import annotations

import torch

from k3.infer.scheduler import DecodeGroup, Request

__all__ = ["PrefillSteps"]


class PrefillSteps:
    """Prefill methods of ``Engine`` (engine thread only); they use its model, prefix cache,
    counters, ``_prefill`` list, ``_groups`` and ``_emit`` / ``_emit_rows``."""

    def _chunk_end(self, pos: int, n: int, budget: int) -> int:
        """End of the next prefill chunk: at most ``budget`` tokens, and with the prefix cache never
        past the next ``cache_block`` boundary (each boundary gets its snapshot)."""
        end = min(pos + budget, n)
        if self.prefix_cache is not None:
            end = min(end, (pos // self.cache_block + 1) * self.cache_block)
        return end

    def _start(self, req: Request) -> bool:
        """Consult the prefix cache once per request; True when it starts from scratch (a miss)."""
        if not req.started:
            req.started = True
            scored = req.params.prompt_logprobs is not None   # every prompt position is run
            hit = self.prefix_cache.match(req.cache_key) if self.prefix_cache is not None and not scored else None
            if hit is not None and 0 < hit.length < len(req.prompt) and hit.cache is not None:
                req.cache, req.pos = hit.cache, hit.length
        return req.cache is None

    def _fresh_batch(self, budget: int) -> list[Request]:
        """The prefilling requests to run as one forward: the head request and the next ones with a
        prompt of the same length, when each is a prefix-cache miss and its whole prompt is one
        chunk (``_chunk_end(0, n, budget) == n``), at most ``budget`` tokens in all. Requests of
        equal length only, so no row is padded (a KDA state would absorb the padding). Only whole
        short prompts: a long prompt keeps its boundary snapshots, and since two prompts of the
        same length never resume from each other's end snapshot, matching them before either
        runs loses no prefix-cache hit among them. (A member queued behind a shorter prompt it
        extends is matched before that one's end snapshot exists: same tokens, a miss instead of
        a hit of at most ``cache_block`` tokens.)"""
        head = self._prefill[0]
        n = len(head.prompt)
        if head.solo or head.cache is not None or self._chunk_end(0, n, budget) != n or not self._start(head):
            return []
        batch, used = [head], n
        for r in self._prefill[1:]:
            if used + n > budget:
                break
            if len(r.prompt) == n and not r.solo and r.cache is None and self._start(r):
                batch.append(r)
                used += n
        return batch

    def _prefill_together(self, batch: list[Request]) -> int:
        """Prefill the equal-length whole prompts of ``batch`` as one [k, n] forward; each request
        gets its first token and the survivors join the decode batch with one concatenation.
        Returns the prompt tokens run (0 when the forward failed: the requests are then prefilled
        one by one, so a failure fails only its own request)."""
        n = len(batch[0].prompt)
        ids = torch.tensor([r.prompt for r in batch], dtype=torch.long, device=self.device)
        cache = self.model.new_cache(len(batch))
        try:
            logits = self.model(ids, cache=cache, logits_to_keep=1).logits[:, -1]  # [k, V]
        except Exception:  # noqa: BLE001 - retried alone, where an error is the request's own
            for r in batch:
                r.solo = True
            return 0
        c = self._counters
        c["prompt_tokens"] += len(batch) * n
        c["max_prefill_batch"] = max(c["max_prefill_batch"], len(batch))
        if self.prefix_cache is not None:
            for r, rows in zip(batch, cache.split()):
                self.prefix_cache.insert(r.prompt, rows)
        with self._cv:
            for r in batch:
                self._prefill.remove(r)
                r.pos = n
        self._emit_rows(batch, logits)
        keep = [i for i, r in enumerate(batch) if not r.finished]
        if keep:
            self._to_decode([batch[i] for i in keep], cache if len(keep) == len(batch) else cache.select(keep))
        return len(batch) * n

    def _prefill_chunk(self, req: Request, budget: int) -> int:
        """Run the next chunk of ``req``'s prompt (at most ``budget`` tokens); returns its length.
        After the last chunk the first token is sampled and the request joins the decode batch."""
        n = len(req.prompt)
        self._start(req)
        if req.cache is None:
            req.cache, req.pos = self.model.new_cache(1), 0
        end = self._chunk_end(req.pos, n, budget)
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
        ran, req.pos = end - req.pos, end
        self._counters["prompt_tokens"] += ran
        if self.prefix_cache is not None and (end % self.cache_block == 0 or end == n):
            self.prefix_cache.insert(req.cache_key[:end], req.cache)
        if end < n:
            return ran
        with self._cv:
            self._prefill.remove(req)
        req.handle.prompt_logprobs = req.prompt_lps   # before the first event reaches the caller
        self._emit_rows([req], logits[None])
        rows, req.cache = req.cache, None
        if not req.finished:
            self._to_decode([req], rows)
        return ran

    @staticmethod
    def _score_prompt(req: Request, logits: torch.Tensor, end: int, top: int) -> None:
        """Append the logprobs of prompt tokens pos+1 .. end-1 (and, with ``top``, their top
        alternatives) from this chunk's logits [end - pos, V]; the first prompt token gets None."""
        if req.prompt_lps is None:
            req.prompt_lps = [None]
        lp = torch.log_softmax(logits.float(), -1)
        nxt = req.prompt[req.pos + 1: end + 1]          # the token each position predicts
        got = lp[torch.arange(len(nxt)), torch.tensor(nxt, device=lp.device)].tolist()
        alts = lp[:len(nxt)].topk(min(top, lp.shape[-1])) if top else None
        for j, v in enumerate(got):
            req.prompt_lps.append((v, list(zip(alts.indices[j].tolist(), alts.values[j].tolist())) if top else []))

    def _to_decode(self, reqs: list[Request], rows) -> None:
        """``reqs`` (prefilled; their cache rows ``rows``, in order) join the first decode group that
        accepts those rows, or start one."""
        with self._cv:
            group = next((g for g in self._groups if g.accepts(rows)), None)
            if group is None:
                self._groups.append(DecodeGroup(reqs, rows))
            else:
                group.join(reqs, rows)
