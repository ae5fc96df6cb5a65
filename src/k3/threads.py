"""CPU threads on a machine that other processes share (``--threads auto``), and OpenMP teams.

Three mechanisms, all measured on the 2-core machine this project grew on (docs/TRAINING_SPEED.md,
docs/INFERENCE.md):

* **OpenMP wait policy.** torch's CPU build runs its parallel regions on GNU OpenMP (libgomp).
  Unset, libgomp lets an idle worker spin ~300,000 times before it sleeps; when another process
  holds a core, the spinning workers take the CPU that the thread they wait for (or the other
  process) needs, and a ``tiny`` training step slowed from 2.7 s to 16–80 s. With
  ``OMP_WAIT_POLICY=PASSIVE`` (workers sleep at once) the same step took 4–7 s. Idle, spinning
  is faster (the demo's step 1.11–1.30× in alternated runs), but choosing it from the load at
  start failed the busy case: a competitor arriving mid-run held the minimum window at 32.6 % of
  idle until the controller reacted (docs/TRAINING_SPEED.md). :func:`configure_openmp` sets
  PASSIVE; libgomp reads the variable once, when torch loads it, so it
  must run before ``import torch`` (``k3.train`` calls it first thing). A user's own
  ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is kept.
* **One OpenMP team per process.** libgomp gives every thread that opens a parallel region its
  own worker team, and once the workers of all teams outnumber the CPUs it cuts every worker's
  spin to ~100 iterations, so each parallel region wakes its workers through the kernel. A model
  built or warmed in the main thread and then stepped by ``Engine``'s thread is that case: a
  ``small`` decode step took 17 ms in the main thread and 22–34 ms in the engine thread on 2
  cores. :func:`release_openmp_team` ends the calling thread's team (OpenMP 5.0
  ``omp_pause_resource_all``); the engine calls it in the threads that hand it work, and in
  its own thread whenever it goes idle.
* **Thread count from what is free.** :class:`CpuMeter` measures how many of this process's
  usable cores other processes keep busy over a window: the busy time of those CPUs in
  ``/proc/stat`` minus this process's own CPU time. :class:`ThreadController` starts at the
  free-core count and, every ``interval`` steps (or at once when a step runs at less than half
  the rate of the last decision, or when the free-core count over a step changes), runs
  ``probe_steps`` steps at another count — the free-core count when it differs, else one thread
  fewer or more — and keeps whichever ran more tokens/s (the other only when faster by
  ``margin``). Its decisions are logged in the run's metrics.

Numerics: the thread count can change a result's last bits (reductions split differently). The
golden ``nano`` losses are equal at 1 and 2 threads, but 3 ``tiny`` steps at B4 T256 differ in the
sixth digit of the third loss. So ``auto`` runs are reproducible only as far as their per-step
thread counts (logged as ``threads`` in each train record) repeat; a run that must resume
bit-exactly, or be compared bit for bit, pins ``threads = N`` (the resume and golden tests do).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from k3.errors import ConfigError

__all__ = ["configure_openmp", "passive_wait_policy", "usable_cpus", "CpuMeter", "ThreadController",
           "parse_threads", "threads_for_free", "thread_control", "WAIT_POLICY_VARS",
           "release_openmp_team"]

WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def configure_openmp(environ: dict | None = None) -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set a wait policy or torch is loaded.

    Returns what is in effect for this process: ``"PASSIVE (set by k3)"``, ``"<VAR>=<value>
    (user)"``, or ``"libgomp default (torch was loaded first)"``.
    """
    env = os.environ if environ is None else environ
    for var in WAIT_POLICY_VARS:
        if var in env:
            return f"{var}={env[var]} (user)"
    if "torch" in sys.modules:  # libgomp has read its environment already
        return "libgomp default (torch was loaded first)"
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE (set by k3)"


def passive_wait_policy(environ: dict | None = None) -> bool:
    """Whether OpenMP workers sleep at once (``OMP_WAIT_POLICY=PASSIVE`` or ``GOMP_SPINCOUNT=0``)."""
    env = os.environ if environ is None else environ
    return env.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE" or env.get("GOMP_SPINCOUNT", "").strip() == "0"


_GOMP = None   # ctypes handle of the libgomp torch loaded (False: none found)


def _libgomp():
    global _GOMP
    if _GOMP is None:
        import ctypes
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "/libgomp" in line}
        except OSError:
            paths = set()
        _GOMP = False
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                _GOMP = lib
                break
            except (OSError, AttributeError):
                continue
    return _GOMP


def release_openmp_team() -> bool:
    """End the calling thread's libgomp worker team, if it has one (``omp_pause_resource_all``
    with ``omp_pause_soft``; its workers exit and a later parallel region in this thread builds a
    new team). Returns whether libgomp accepted; False where torch runs no libgomp or the call is
    made inside a parallel region. Only the calling thread's team is touched: results and other
    threads' teams are unaffected."""
    lib = _libgomp()
    return bool(lib) and lib.omp_pause_resource_all(1) == 0


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 ``cpu.max`` quota."""
    n = len(os.sched_getaffinity(0))
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def parse_threads(value, where: str = "threads"):
    """A ``threads`` setting: ``"auto"``, or a count (a string of digits becomes an int).

    Another string raises ConfigError naming ``where``; a non-string is returned as it is (its
    type and range are TrainConfig.validate's to check).
    """
    if not isinstance(value, str):
        return value
    if value.strip().isdigit():
        return int(value)
    if value == "auto":
        return value
    raise ConfigError(f"{where} must be 'auto' or a thread count (an integer >= 0; 0: torch's "
                      f"default), got {value!r}")


def threads_for_free(free: float, max_threads: int) -> int:
    """Thread count for ``free`` free cores: rounded half up (a core more than half taken counts
    as taken), in [1, max_threads]."""
    return max(1, min(max_threads, math.floor(free + 0.5)))


@dataclass
class CpuSample:
    wall: float        # time.monotonic() seconds
    busy: float        # busy CPU-seconds of the watched CPUs since boot (/proc/stat)
    own: float         # this process's CPU-seconds (all threads, user + system)


class CpuMeter:
    """Cores that other processes keep busy, between consecutive :meth:`window` calls.

    Busy = user + nice + system + irq + softirq + steal of the watched CPUs (this process's
    affinity) in ``/proc/stat``; others = (Δbusy − Δown) / Δwall, clamped to [0, cpus]; free =
    cpus − others. Needs ``/proc/stat`` (Linux); elsewhere :attr:`available` is False and the
    controller decides by step times alone.
    """

    def __init__(self, cpus: set[int] | None = None):
        self.cpus = set(os.sched_getaffinity(0)) if cpus is None else set(cpus)
        self.hz = os.sysconf("SC_CLK_TCK")
        self.available = self._busy() is not None
        self.last = self.sample() if self.available else None

    def _busy(self) -> float | None:
        try:
            lines = open("/proc/stat").read().splitlines()
        except OSError:
            return None
        total = 0
        for line in lines:
            name, *vals = line.split()
            if name.startswith("cpu") and name != "cpu" and int(name[3:]) in self.cpus:
                v = [int(x) for x in vals]
                total += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
        return total / self.hz

    def sample(self) -> CpuSample:
        t = os.times()
        return CpuSample(time.monotonic(), self._busy() or 0.0, t.user + t.system)

    def window(self) -> dict[str, float]:
        """``{"seconds", "others", "own", "free"}`` (cores, averaged) since the last call."""
        s, prev = self.sample(), self.last
        self.last = s
        dt = max(s.wall - prev.wall, 1e-9)
        own = (s.own - prev.own) / dt
        others = min(max((s.busy - prev.busy) / dt - own, 0.0), float(len(self.cpus)))
        return {"seconds": dt, "others": others, "own": own, "free": len(self.cpus) - others}

    def measure(self, seconds: float = 0.3) -> dict[str, float]:
        """A fresh window of ``seconds`` (sleeping meanwhile)."""
        self.window()
        time.sleep(seconds)
        return self.window()


@dataclass
class _Probe:
    count: int               # thread count being tried
    base_rate: float         # median tokens/s of the last steps at the kept count
    base_tokens: int         # tokens per step those were measured at
    reason: str
    rates: list[float] = field(default_factory=list)


class ThreadController:
    """Chooses the thread count of each training step (see the module docstring).

    Per step: ``n = before_step()`` (applies the count), train, ``after_step(seconds, tokens)``
    (returns a decision record when a probe ended, else None). ``meter`` may be None (decide by
    step times alone); ``apply`` is ``torch.set_num_threads`` unless given.
    """

    def __init__(self, max_threads: int, interval: int = 25, probe_steps: int = 2, margin: float = 0.05,
                 meter: CpuMeter | None = None, apply: Callable[[int], None] | None = None,
                 start: int | None = None, probe_above_free: bool = True):
        if max_threads < 1 or interval < 1 or probe_steps < 1:
            raise ValueError("max_threads, interval and probe_steps must be >= 1")
        self.max_threads, self.interval, self.probe_steps, self.margin = max_threads, interval, probe_steps, margin
        self.meter, self.probe_above_free = meter, probe_above_free
        if apply is None:
            import torch
            apply = torch.set_num_threads
        self._apply, self._applied = apply, None
        self.free = None
        if start is None:
            start = max_threads
            if meter is not None and meter.available:
                self.free = meter.measure()["free"]
                start = threads_for_free(self.free, max_threads)
        self.count = start
        self.free_count = threads_for_free(self.free, max_threads) if self.free is not None else None
        self.recent: deque[tuple[int, float]] = deque(maxlen=probe_steps)  # (tokens, rate) at count
        self.ref_rate: float | None = None      # rate at the last decision (collapse detector)
        self.since = 0                           # steps since the last decision
        self.probe: _Probe | None = None
        self.current = start

    # ------------------------------------------------------------------------------- steps
    def before_step(self) -> int:
        """The thread count for the next step (applied)."""
        n = self.probe.count if self.probe is not None else self.count
        if n != self._applied:
            self._apply(n)
            self._applied = n
        self.current = n
        return n

    def after_step(self, seconds: float, tokens: int) -> dict | None:
        rate = tokens / max(seconds, 1e-12)
        if self.probe is not None:
            return self._probe_step(rate, tokens)
        self.recent.append((tokens, rate))
        self.since += 1
        if self.ref_rate is None and len(self.recent) == self.recent.maxlen:
            self.ref_rate = statistics.median(r for _, r in self.recent)
        if self.meter is not None and self.meter.available:
            self.free = self.meter.window()["free"]
        collapsed = self.ref_rate is not None and rate < 0.5 * self.ref_rate
        load = (self.free is not None and self.since >= 3 and self.max_threads > 1
                and threads_for_free(self.free, self.max_threads) != self.free_count)
        if self.max_threads > 1 and (self.since >= self.interval or collapsed or load):
            self._start_probe("collapse" if collapsed else "load" if load else "interval")
        return None

    # ------------------------------------------------------------------------------- logic
    def _candidate(self) -> tuple[int | None, float | None]:
        """(count to try or None, free cores over the last step or None).

        The free-core count when it differs from the kept count, else one fewer (one more at 1).
        Without a passive wait policy a count above the free cores is never tried: spinning
        workers on a taken core are what collapses a step (10x slower), so one such probe costs
        more than it can find.
        """
        free = self.free
        want = threads_for_free(free, self.max_threads) if free is not None else self.count
        self.free_count = want
        cand = want if want != self.count else (self.count - 1 if self.count > 1 else self.count + 1)
        if free is not None and not self.probe_above_free and cand > want:
            return None, free
        return cand, free

    def _start_probe(self, reason: str) -> None:
        """Compare against the kept count's recent median (after a collapse: its last step)."""
        tokens, last = self.recent[-1]
        base = last if reason == "collapse" else statistics.median(r for t, r in self.recent if t == tokens)
        cand, free = self._candidate()
        if cand is None:
            self.since, self.ref_rate = 0, base
            return
        self.probe = _Probe(cand, base, tokens, reason)

    def _probe_step(self, rate: float, tokens: int) -> dict | None:
        p = self.probe
        if tokens != p.base_tokens:       # the step shape changed (curriculum): no comparison
            return self._end_probe(keep=True, rate=None)
        p.rates.append(rate)
        if len(p.rates) < self.probe_steps:
            return None
        tried = statistics.median(p.rates)
        return self._end_probe(keep=tried <= p.base_rate * (1 + self.margin), rate=tried)

    def _end_probe(self, keep: bool, rate: float | None) -> dict:
        p, old = self.probe, self.count
        self.probe, self.since = None, 0
        if not keep:
            self.count = p.count
            self.recent.clear()
            self.recent.append((p.base_tokens, rate))
        self.ref_rate = rate if not keep else p.base_rate
        return {"threads": self.count, "previous": old, "tried": p.count, "reason": p.reason,
                "rate_kept_before": p.base_rate, "rate_tried": rate,
                "free_cores": None if self.free is None else round(self.free, 2)}


def thread_control(setting, device_type: str, interval: int = 25) -> ThreadController | None:
    """What a run's ``threads`` setting means: N > 0 fixes N threads (returns None), 0 leaves
    torch's default (None), ``"auto"`` on CPU returns a ThreadController over the usable cores
    (on other devices: None, the host threads only feed the device). Under torchrun with several
    processes on this machine (``LOCAL_WORLD_SIZE`` > 1) each rank would count the others as load
    and they wait for each other every step, so ``"auto"`` fixes an equal share of the cores."""
    import os

    import torch

    if setting == "auto":
        if device_type != "cpu":
            return None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        if local > 1:
            torch.set_num_threads(max(1, usable_cpus() // local))
            return None
        return ThreadController(usable_cpus(), interval=interval, meter=CpuMeter(),
                                probe_above_free=passive_wait_policy())
    if setting:
        torch.set_num_threads(int(setting))
    return None
