"""Server metrics in the Prometheus text format (version 0.0.4).

Counters kept here: HTTP requests by path and status, time to first token (sum and count, so a
scraper gets the mean as ``sum / count``), and per finished generation its tokens and decode time
(the tokens/s gauge is the mean over the last 64 generations: tokens after the first divided by the
time from the first token to the last). Engine gauges (active sequences, queue depth, prompt and
generated tokens, prefix-cache hits) are read from ``Engine.stats()`` at scrape time.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["Metrics"]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (path, status) -> n
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.cancelled = 0
        self._rates: collections.deque = collections.deque(maxlen=64)  # (tokens after first, seconds)

    def request(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(path, status)] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1

    def generation(self, tokens: int, t_first: float | None, t_last: float | None, cancelled: bool) -> None:
        with self._lock:
            self.cancelled += cancelled
            if t_first is not None and t_last is not None and tokens > 1 and t_last > t_first:
                self._rates.append((tokens - 1, t_last - t_first))

    def tokens_per_second(self) -> float:
        with self._lock:
            n = sum(t for t, _ in self._rates)
            s = sum(d for _, d in self._rates)
        return n / s if s > 0 else 0.0

    def render(self, stats: dict) -> str:
        """The exposition text: ``# TYPE`` lines then samples."""
        hits, misses = stats.get("prefix_hits", 0), stats.get("prefix_misses", 0)
        out = ["# TYPE k3_http_requests_total counter"]
        with self._lock:
            for (path, status), n in sorted(self.requests.items()):
                out.append(f'k3_http_requests_total{{path="{path}",status="{status}"}} {n}')
            ttft = (self.ttft_sum, self.ttft_count, self.cancelled)
        gauges = [
            ("k3_active_sequences", "gauge", stats.get("active", 0)),
            ("k3_queue_depth", "gauge", stats.get("waiting", 0)),
            ("k3_prompt_tokens_total", "counter", stats.get("prompt_tokens", 0)),
            ("k3_generated_tokens_total", "counter", stats.get("generated_tokens", 0)),
            ("k3_prefix_cache_hits_total", "counter", hits),
            ("k3_prefix_cache_misses_total", "counter", misses),
            ("k3_prefix_cache_hit_rate", "gauge", hits / (hits + misses) if hits + misses else 0.0),
            ("k3_prefix_cache_bytes", "gauge", stats.get("prefix_cache_bytes", 0)),
            ("k3_time_to_first_token_seconds_sum", "counter", ttft[0]),
            ("k3_time_to_first_token_seconds_count", "counter", ttft[1]),
            ("k3_cancelled_requests_total", "counter", ttft[2]),
            ("k3_output_tokens_per_second", "gauge", self.tokens_per_second()),
            ("k3_decode_steps_total", "counter", stats.get("decode_steps", 0)),
        ]
        for name, kind, v in gauges:
            out += [f"# TYPE {name} {kind}", f"{name} {v}"]
        return "\n".join(out) + "\n"
