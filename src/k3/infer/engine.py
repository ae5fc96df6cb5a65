"""The inference engine (SPEC §6.1): continuous batching over one model owned by one thread.

Three parts, as vLLM splits them: ``k3.infer.scheduler.Scheduler`` decides each step's work
(admission within ``max_batch`` and ``max_cache_bytes``, prefill chunks and batches within
``prefill_chunk`` tokens, the decode groups) and returns a ``StepPlan`` without touching a model;
``k3.infer.runner.ModelRunner`` executes the plan (forwards, prefix-cache lookups and snapshots,
sampling, events); this ``Engine`` is the thin threaded shell around them.

``submit`` validates a request in the caller's thread and queues it; a bad request gets a handle
that raises its ``K3Error`` and never reaches the model, so the others are unaffected. The engine
thread repeats one *step*: apply cancels, ``schedule()``, ``execute(plan)``, measure the caches,
then close the handles of requests that ended (after their cache rows were dropped, so a caller
that saw the end sees freed stats) and call the listeners. ``add_listener(fn)``: ``fn()`` after
every step, so one consumer of many handles (the server's event loop) wakes once per step and
``poll``s them.
"""

from __future__ import annotations

import operator
import threading
from pathlib import Path

import torch

from k3.errors import K3Error
from k3.infer.media import PromptImages
from k3.infer.prepared import PreparedWeights
from k3.infer.detok import TextStream
from k3.infer.runner import ModelRunner
from k3.infer.sampling import Sampler, SamplingParams
from k3.infer.scheduler import Completion, Request, RequestHandle, Scheduler, TokenEvent
from k3.model.cache import KDAState, MLAState, cache_bytes_per_sequence
from k3.model.multimodal import K3VLForConditionalGeneration
from k3.threads import release_openmp_team

__all__ = ["Engine"]


def _load(path, dtype, device, tokenizer):
    """A model directory (config.json), or a run directory / checkpoint folder loaded as
    ``k3 sample`` and ``k3 serve`` load it (``load_run_model``: the verified checkpoint, QAT runs
    with their fake-quantized experts), so every entry point gives one checkpoint the same numbers."""
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import Tokenizer

    path = Path(path)
    if path.is_dir() and not (path / "config.json").is_file():
        from k3.infer.run_model import load_run_model
        model, tok = load_run_model(path, str(device or "cpu"))
        if dtype is not None and dtype != torch.float32:
            model = model.to(dtype)
        return model, tokenizer or tok
    from k3.infer.run_model import model_class_of
    model = from_pretrained(path, dtype=dtype or torch.float32, device=device, model_class=model_class_of(path))
    if tokenizer is None and (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.load(path / "tokenizer.json")
    return model, tokenizer


class Engine:
    """``Engine(model_or_checkpoint_dir, max_batch=16, prefill_chunk=512, cache_block=64, ...)``.

    ``prepared_decode`` (default on) gives each decode step ``model(..., prepared=P)``: the model's
    own forward over weights the engine prepared once (``k3.infer.prepared``: the same math in few
    C calls, rebuilt when a weight changes), where the model allows it (``PreparedWeights.why``).
    ``prefix_cache_bytes`` > 0 turns the prefix cache on with that byte budget;
    ``max_cache_bytes`` bounds the running sequences' caches (each reserves its worst case,
    prompt + max_tokens, at admission; one that alone exceeds the budget fails).
    Use as a context manager or call ``close()`` (joins the scheduler thread).
    """

    def __init__(self, model_or_dir, max_batch: int = 16, prefill_chunk: int = 512, cache_block: int = 64,
                 prefix_cache_bytes: int = 0, max_cache_bytes: int | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None, tokenizer=None,
                 prepared_decode: bool = True):
        for name, v in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk), ("cache_block", cache_block)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise K3Error(f"Engine: {name} must be an int >= 1, got {v!r}")
        for name, v in (("prefix_cache_bytes", prefix_cache_bytes), ("max_cache_bytes", max_cache_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise K3Error(f"Engine: {name} must be an int >= 0, got {v!r}")
        if isinstance(model_or_dir, (str, Path)):
            model_or_dir, tokenizer = _load(model_or_dir, dtype, device, tokenizer)
        elif dtype is not None or device is not None:
            model_or_dir = model_or_dir.to(dtype=dtype, device=device)
        model_or_dir = model_or_dir.eval()
        # a vision model: its tower embeds images at prefill, its text model does everything else
        self.vision_model = model_or_dir if isinstance(model_or_dir, K3VLForConditionalGeneration) else None
        self.model = model_or_dir.language_model if self.vision_model is not None else model_or_dir
        self.config = self.model.config
        self.tokenizer = tokenizer
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_batch, self.prefill_chunk, self.cache_block = max_batch, prefill_chunk, cache_block
        self.max_cache_bytes = max_cache_bytes
        self.prefix_cache = None
        if prefix_cache_bytes:
            from k3.infer.prefix_cache import PrefixCache
            self.prefix_cache = PrefixCache(cache_block, prefix_cache_bytes)
        self._cv = threading.Condition()
        self._sched = Scheduler(max_batch, prefill_chunk, cache_block, max_cache_bytes, self.prefix_cache)
        self._counters = dict(prompt_tokens=0, generated_tokens=0, finished=0, failed=0, decode_steps=0,
                              max_decode_batch=0, max_prefill_batch=1)
        # the decode backend (None: off); the groups' caches are the engine's own, so KDA states
        # are updated in place
        self.prepared = PreparedWeights(self.model, in_place_state=True) if prepared_decode else None
        self._runner = ModelRunner(self.model, self._sched, self._cv, self._end, self._counters,
                                   vision_model=self.vision_model, prefix_cache=self.prefix_cache,
                                   prepared=self.prepared)
        self._cancels: set[int] = set()
        self._closing: list = []  # handle closures waiting for the end of the step
        self._next_id = 0
        self._stop = False
        self._bytes = dict(kda_state_bytes=0, mla_latent_bytes=0)
        self._prefix_stats: dict = {}
        self._listeners: list = []
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        release_openmp_team()   # k3.threads: this thread's idle OpenMP team would slow the engine's
        self._thread.start()

    # ------------------------------------------------------------------------------ public
    def submit(self, prompt_ids, params: SamplingParams | dict | None = None, images=None) -> RequestHandle:
        """Queue a request; returns at once. Bad input fails this handle only. ``images`` (a vision
        model): the prompt's images in order (paths, bytes, data: URLs or PIL images), one per media
        block of the prompt (``ChatFormat.render_chat`` gives both)."""
        if threading.current_thread() is not self._thread:
            release_openmp_team()   # the caller's idle OpenMP team (if it ran torch since) would
            #                         throttle the engine thread's workers (k3.threads)
        with self._cv:
            handle = RequestHandle(self._next_id, self)
            self._next_id += 1
        try:
            req = self._make_request(handle, prompt_ids, params, images)
        except K3Error as e:
            handle._fail(e)
            with self._cv:
                self._counters["failed"] += 1
            self._notify()
            return handle
        with self._cv:
            if self._stop:
                handle._fail(K3Error("Engine: closed"))
                self._notify()
                return handle
            self._sched.add(req)
            self._cv.notify()
        return handle

    def generate(self, prompts, params: SamplingParams | dict | list | None = None) -> list[Completion]:
        """Submit every prompt (a list of token-id lists) and wait for all; one params or a list."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise K3Error(f"generate: {len(plist)} params for {len(prompts)} prompts")
        handles = [self.submit(p, q) for p, q in zip(prompts, plist)]
        return [h.result() for h in handles]

    def add_listener(self, fn) -> None:
        """Call ``fn()`` after every engine step (in the engine thread), and after events put outside
        a step (a request cancelled while waiting, a refused submit): a consumer of many handles
        (the server's event loop) wakes once per step and ``poll``s its handles, instead of one
        blocking reader per request. ``fn`` must be quick and must not raise."""
        with self._cv:
            self._listeners.append(fn)

    def remove_listener(self, fn) -> None:
        with self._cv:
            self._listeners.remove(fn)

    def _notify(self) -> None:
        with self._cv:
            listeners = list(self._listeners)
        for fn in listeners:
            fn()

    def stats(self) -> dict:
        """Active / waiting requests, cache bytes (KDA state, MLA latent KV, prefix cache), prefix
        hits and misses, token and request counters (``decode_steps``, ``max_decode_batch``,
        ``max_prefill_batch``: most requests prefilled by one forward); bytes as of the end of the
        last step."""
        with self._cv:
            out = dict(active=self._sched.num_active(), waiting=len(self._sched.waiting), **self._bytes,
                       **self._counters)
            pc = self._prefix_stats
        out.update(prefix_cache_bytes=pc.get("bytes", 0), prefix_hits=pc.get("hits", 0),
                   prefix_misses=pc.get("misses", 0), prefix_hit_tokens=pc.get("hit_tokens", 0))
        return out

    def close(self) -> None:
        """Stop the scheduler thread (requests still open fail with "closed") and join it."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------------- requests
    def _make_request(self, handle, prompt_ids, params, images=None) -> Request:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise K3Error(f"params must be SamplingParams or a dict, got {type(params).__name__}")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.flatten().tolist()
        try:
            prompt = [operator.index(t) for t in prompt_ids]
        except TypeError:
            raise K3Error("prompt: must be a sequence of int token ids") from None
        V, max_pos = self.config.vocab_size, self.config.max_position_embeddings
        if not prompt:
            raise K3Error("prompt: empty (at least one token id is needed)")
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise K3Error(f"prompt: token id {bad[0]} outside the vocabulary [0, {V})")
        if len(prompt) >= max_pos:
            raise K3Error(f"prompt: {len(prompt)} tokens leave no room for output within "
                          f"max_position_embeddings={max_pos}")
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise K3Error(f"SamplingParams.stop_token_ids: {bad[0]} outside the vocabulary [0, {V})")
        if params.think_end_id is not None and params.think_end_id >= V:
            raise K3Error(f"SamplingParams.think_end_id: {params.think_end_id} outside the vocabulary [0, {V})")
        if params.stop and self.tokenizer is None:
            raise K3Error("SamplingParams.stop: stop strings need a tokenizer (Engine(..., tokenizer=))")
        max_tokens = min(params.max_tokens, max_pos - len(prompt))
        reserved = cache_bytes_per_sequence(self.config, len(prompt) + max_tokens, self.dtype)["total"]
        if self.max_cache_bytes is not None and reserved > self.max_cache_bytes:
            raise K3Error(f"max_cache_bytes={self.max_cache_bytes} is smaller than this request's cache "
                          f"({reserved} bytes for {len(prompt)} prompt + {max_tokens} new tokens)")
        media = self._prompt_images(prompt, images)
        sampler = Sampler(params, V, prompt, self.device)
        return Request(handle, prompt, params, sampler, TextStream(self.tokenizer, params.stop), reserved,
                       max_tokens, solo=params.prompt_logprobs is not None or media is not None, images=media)

    def _prompt_images(self, prompt: list[int], images) -> PromptImages | None:
        """The request's images checked against its prompt (None without images)."""
        if images is None:
            if self.vision_model is not None and self.vision_model.media_pad_token_id in prompt:
                raise K3Error(f"prompt: holds <|media_pad|> tokens (id {self.vision_model.media_pad_token_id}) "
                              "but no images were given")
            return None
        if self.vision_model is None:
            raise K3Error("images: this model has no vision tower (a text-only model takes token ids only)")
        return PromptImages.of(prompt, images, self.vision_model)

    def _cancel(self, handle: RequestHandle) -> None:
        with self._cv:
            r = self._sched.remove_waiting(handle)
            if r is None:   # admitted: cancelled at the start of the next step
                self._cancels.add(handle.rid)
                self._cv.notify()
                return
            self._end(r, TokenEvent(None, "", None, "cancelled"), now=True)
        self._notify()

    def _end(self, req: Request, ev: TokenEvent | None = None, err: BaseException | None = None,
             now: bool = False) -> None:
        """Finish ``req``: its last event goes out at once; the end of its stream (or its error) only
        after the step that dropped its cache rows, so a caller that saw the end sees freed stats."""
        req.finished = True
        if ev is not None:
            req.handle._put(ev)
        close = (lambda: req.handle._fail(err)) if err is not None else req.handle._close
        self._counters["failed" if err is not None else "finished"] += 1
        if now:
            close()
        else:
            self._closing.append(close)

    def _release(self) -> None:
        with self._cv:
            closing, self._closing = self._closing, []
        for close in closing:
            close()

    # ------------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        why = "Engine: closed before the request finished"
        sched = self._sched
        try:
            with torch.no_grad():
                while True:
                    with self._cv:
                        if not (self._stop or sched.has_work()):
                            release_openmp_team()  # idle: no team of ours to throttle other threads'
                        while not (self._stop or sched.has_work()):
                            self._cv.wait()
                        if self._stop:
                            break
                        cancels, self._cancels = self._cancels, set()
                        if cancels:
                            for r in sched.cancel(cancels):
                                self._end(r, TokenEvent(None, "", None, "cancelled"))
                            sched.drop_finished()
                        plan = sched.schedule()
                    self._runner.execute(plan)
                    self._measure()
                    self._release()
                    self._notify()
        except BaseException as e:  # a bug in the loop itself: no request may wait forever
            why = f"Engine: scheduler stopped by {e!r}"
            raise
        finally:
            with self._cv:
                self._stop = True
                for r in sched.requests():
                    if not r.finished:
                        self._end(r, err=K3Error(why))
                sched.clear()
            self._measure()
            self._release()
            self._notify()

    def _measure(self) -> None:
        caches = [r.cache for r in self._sched.prefilling if r.cache is not None] + [g.cache for g in self._sched.groups]
        kda = mla = 0
        for c in caches:
            for s in c.layers:
                if isinstance(s, KDAState):
                    kda += s.nbytes()
                elif isinstance(s, MLAState):
                    mla += s.nbytes()
        with self._cv:
            self._bytes.update(kda_state_bytes=kda, mla_latent_bytes=mla)
            if self.prefix_cache is not None:  # read here, in the thread that mutates the tree
                self._prefix_stats = self.prefix_cache.stats()
