"""``k3 distill`` (SPEC §10): multi-teacher on-policy distillation into one student.

The student samples episodes exactly as ``k3 rl`` does (``GRPOObjective``: the same tasks, groups,
seeds, harness randomization, sandboxes, verifier, masks, packing, resume and torchrun split), and
a teacher scores every token the student wrote; the per-token reverse KL KL(π_s ‖ π_t) is the loss
(``k3.ops.distill_loss``), on the student's sampled tokens only.

**Teachers** come from a TOML file mapping a tag to a teacher::

    ["coding_agent/max"]
    checkpoint = "runs/teacher-code-max"    # a k3 run, checkpoint folder or model directory

    ["general/low"]
    url = "http://127.0.0.1:8000/v1"        # an OpenAI-compatible server that scores given tokens
    model = "k3"                            # (k3 serve: /v1/completions with echo and logprobs)
    api_key_env = "TEACHER_KEY"             # optional: the variable holding its key
    timeout = 60                            # optional: seconds per request (3 tries, then the step fails)

A tag is ``DOMAIN/EFFORT`` (domains ``general``, ``general_agent``, ``coding_agent``; efforts
``low``, ``high``, ``max``). An episode's tag is its task's domain (``family.json`` of a generated
task, else ``domain`` in ``task.toml``) and the effort of its group, which the system turn renders
(SPEC §6.3), so the student learns to follow it. Every (task, effort) of the run must have a
teacher: a missing tag, a task without a domain, a teacher whose tokenizer differs from the
student's (vocabulary or ids; a remote teacher is probed: the token strings it returns for the
student's ids must be the student's) are errors before the first step, naming them. Each row of a
micro-batch is scored by its own tag's teacher only (a sample never reaches another teacher).
A local teacher runs in the learner's process, on its device, frozen; a remote one gives only the
logprobs of given tokens, so it needs ``--estimator sampled``. The table is kept in the run's
checkpoint, so ``k3 distill --resume DIR`` needs nothing else (the teachers must still be there).

**Estimators** (``--estimator``): ``exact`` (default; the KL over the whole vocabulary, or over
the student's top ``--top-k`` tokens and one tail bucket) or ``sampled`` (the teacher's logprob of
the sampled token only, a score-function gradient; what a remote teacher that returns only the
logprobs of given tokens allows). ``--forward-weight w`` (exact only) trains (1 − w) × the reverse
KL + w × the forward KL(π_t ‖ π_s) on the same sampled positions, whose gradient does not vanish
where the student is confidently wrong (``k3.ops.distill_loss``); the logged KL stays the reverse
one. ``--reward-weight W`` > 0 adds W × the ``k3 rl`` clipped
policy loss on the group-relative verifier rewards (groups of ``--group`` >= 2 then).

Logged per step besides ``k3 rl``'s figures: per tag, the KL (estimate) per token, the student's
pass rate and its reasoning tokens per episode (``kl_by_tag``, ``pass_by_tag``, ``reasoning_by_tag``).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.data.packing import IGNORE_INDEX
from k3.errors import ConfigError, K3Error
from k3.ops.distill_loss import mixed_kl_exact, reverse_kl_sampled
from k3.ops.policy_loss import clipped_policy_loss
from k3.rl.grpo import GRPOObjective, RLConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["DistillConfig", "DistillObjective", "read_teachers", "task_domain", "ESTIMATORS"]

ESTIMATORS = ("exact", "sampled")


def read_teachers(path: str | Path) -> dict[str, dict]:
    """teachers.toml -> {tag: {"checkpoint": absolute path} | {"url", "model", ...}}, checked."""
    from k3.tasks.families import DOMAINS, EFFORTS

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--teachers {path}: no such file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    if not raw:
        raise ConfigError(f"{path}: no teachers (a table per tag, e.g. [\"general/high\"] checkpoint = ...)")
    out = {}
    for tag, t in raw.items():
        domain, _, effort = tag.partition("/")
        if domain not in DOMAINS or effort not in EFFORTS:
            raise ConfigError(f"{path}: tag {tag!r} is not DOMAIN/EFFORT with a domain of {DOMAINS} "
                              f"and an effort of {EFFORTS}")
        if not isinstance(t, dict):
            raise ConfigError(f"{path}: [{tag!r}] must be a table")
        remote = {"url", "model", "api_key_env", "timeout", "concurrency"}
        unknown = sorted(set(t) - {"checkpoint"} - remote)
        if unknown:
            raise ConfigError(f"{path}: [{tag!r}]: unknown key {unknown[0]!r} (allowed: checkpoint, or "
                              f"{', '.join(sorted(remote))})")
        if "checkpoint" in t and set(t) & remote:
            raise ConfigError(f"{path}: [{tag!r}]: give checkpoint or url, not both")
        if "checkpoint" not in t:
            for k in ("url", "model"):
                if not isinstance(t.get(k), str) or not t[k]:
                    raise ConfigError(f"{path}: [{tag!r}]: a remote teacher needs {k} (a string)")
            if not t["url"].startswith(("http://", "https://")):
                raise ConfigError(f"{path}: [{tag!r}]: url must be http(s)://..., got {t['url']!r}")
            to = t.get("timeout", 60)
            if isinstance(to, bool) or not isinstance(to, (int, float)) or not to > 0:
                raise ConfigError(f"{path}: [{tag!r}]: timeout must be a number of seconds > 0, got {to!r}")
            if "api_key_env" in t and not isinstance(t["api_key_env"], str):
                raise ConfigError(f"{path}: [{tag!r}]: api_key_env must be a variable name")
            conc = t.get("concurrency", RemoteTeacher.CONCURRENCY)
            if isinstance(conc, bool) or not isinstance(conc, int) or not 1 <= conc <= 256:
                raise ConfigError(f"{path}: [{tag!r}]: concurrency must be an int in 1..256 (requests in "
                                  f"flight), got {conc!r}")
            out[tag] = {"url": t["url"].rstrip("/"), "model": t["model"], "timeout": float(to), "concurrency": conc,
                        **({"api_key_env": t["api_key_env"]} if "api_key_env" in t else {})}
            continue
        if not isinstance(t.get("checkpoint"), str) or not t["checkpoint"]:
            raise ConfigError(f"{path}: [{tag!r}]: checkpoint (a k3 run, checkpoint or model dir) is required")
        ckpt = Path(t["checkpoint"])
        ckpt = (ckpt if ckpt.is_absolute() else path.parent / ckpt).resolve()
        if not ckpt.is_dir():
            raise ConfigError(f"{path}: [{tag!r}]: checkpoint {ckpt} does not exist")
        out[tag] = {"checkpoint": str(ckpt)}
    return out


def task_domain(task) -> str:
    """A task's domain: ``family.json``'s for a generated task, else ``domain`` of its task.toml."""
    from k3.tasks.families import META_FILE
    from k3.tasks.families.base import read_meta

    if (task.root / META_FILE).is_file():
        return read_meta(task.root)["domain"]
    if task.domain is None:
        raise ConfigError(f"task {task.id} ({task.root}) has no domain: k3 distill picks its teacher by "
                          "DOMAIN/EFFORT (set domain = \"...\" in its task.toml)")
    return task.domain


@dataclass
class DistillConfig(RLConfig):
    """``RLConfig`` (the sampling) and the distillation's own options."""

    group: int = 4
    efforts: list[str | None] = field(default_factory=lambda: ["low", "high", "max"])
    teachers: dict[str, dict] = field(default_factory=dict)   # tag -> read_teachers' entry
    estimator: str = "exact"
    top_k: int | None = None
    forward_weight: float = 0.0   # w: the loss is (1 − w) · reverse KL + w · forward KL (exact only)
    reward_weight: float = 0.0

    def min_group(self) -> int:
        return 2 if self.reward_weight else 1    # advantages are relative to a group

    def validate(self) -> "DistillConfig":
        if self.beta:
            raise ConfigError("--beta is k3 rl's KL to the starting weights; k3 distill's anchor is the teacher "
                              "(not both)")
        w = self.reward_weight
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 and math.isfinite(w)):
            raise ConfigError(f"--reward-weight must be a number >= 0, got {w!r}")
        f = self.forward_weight
        if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f <= 1):
            raise ConfigError(f"--forward-weight must be a number in [0, 1], got {f!r}")
        super().validate()
        if None in self.efforts:
            raise ConfigError("k3 distill: every group needs an effort (its tag is DOMAIN/EFFORT): "
                              "--effort low|high|max|all")
        if not self.teachers:
            raise ConfigError("k3 distill: no teachers (--teachers FILE)")
        if self.estimator not in ESTIMATORS:
            raise ConfigError(f"--estimator must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}")
        if self.top_k is not None:
            if self.estimator != "exact":
                raise ConfigError("--top-k applies to --estimator exact (the sampled one reads one token)")
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
                raise ConfigError(f"--top-k must be an int >= 1, got {self.top_k!r}")
        if f and self.estimator != "exact":
            raise ConfigError("--forward-weight needs the teacher's whole row (--estimator exact); the sampled "
                              "estimator reads the teacher's logprob of the sampled token only")
        remote = sorted(t for t, v in self.teachers.items() if "url" in v)
        if remote and self.estimator != "sampled":
            raise ConfigError(f"teacher {remote[0]!r} is remote: it gives the logprobs of given tokens only, "
                              "not whole rows (--estimator sampled)")
        return self


class DistillObjective(GRPOObjective):
    """The Trainer objective of ``k3 distill`` (module doc)."""

    KIND, WHAT, CONFIG = "distill", "a distillation", DistillConfig
    TAGGED = True

    def __init__(self, rl: DistillConfig | None, log=print):
        super().__init__(rl, log)
        self.tags: list[str] = []
        self.teacher_models: list = []   # per tag: a model, a RemoteTeacher, or None (not used by the run)
        self.task_tags: dict[tuple[str, str], int] = {}

    # ------------------------------------------------------------------ setup
    def build_data(self, trainer, ckpt, saved) -> None:
        super().build_data(trainer, ckpt, saved)
        rl = self.rl
        self.tags = sorted(rl.teachers)
        need: dict[str, list[str]] = {}
        for task in trainer.corpus.tasks:
            dom = task_domain(task)
            for e in dict.fromkeys(rl.efforts):
                tag = f"{dom}/{e}"
                if tag not in rl.teachers:
                    need.setdefault(tag, []).append(task.id)
                else:
                    self.task_tags[(task.id, e)] = self.tags.index(tag)
        if need:
            tag, ids = sorted(need.items())[0]
            raise ConfigError(f"k3 distill: no teacher for tag {tag!r} (tasks {', '.join(ids[:3])}"
                              f"{', ...' if len(ids) > 3 else ''}); teachers: {', '.join(self.tags)}")
        used = set(self.task_tags.values())   # only the teachers this run's tasks and efforts need
        self.teacher_models = [self._load_teacher(trainer, tag) if i in used else None
                               for i, tag in enumerate(self.tags)]

    def _load_teacher(self, trainer, tag: str):
        from k3.infer.run_model import load_run_model

        spec = self.rl.teachers[tag]
        if "url" in spec:
            return RemoteTeacher(tag, spec, trainer.tokenizer)
        path = spec["checkpoint"]
        try:
            model, tok = load_run_model(path)
        except (OSError, K3Error) as e:
            raise ConfigError(f"teacher {tag!r} ({path}): {e}") from None
        mine, theirs = _vocab_digest(trainer.tokenizer), _vocab_digest(tok)
        if mine != theirs or model.config.vocab_size != trainer.model_config.vocab_size:
            raise ConfigError(f"teacher {tag!r} ({path}) has another tokenizer or vocabulary than the student "
                              f"({tok.vocab_size} ids, model vocab {model.config.vocab_size}; the student: "
                              f"{trainer.tokenizer.vocab_size} ids, model vocab {trainer.model_config.vocab_size}); "
                              "distillation compares token by token and needs the same ids")
        return model.to(trainer.device).eval().requires_grad_(False)

    # ------------------------------------------------------------------ seams of GRPOObjective
    def min_group(self) -> int:
        return self.rl.min_group()

    def uses_rewards(self) -> bool:
        return self.rl.reward_weight > 0

    def trains_zero_advantage(self) -> bool:
        return True    # the teacher KL is on every sampled token, whatever its advantage

    def tag_id(self, episode: dict) -> int:
        return self.task_tags[(episode["task"], episode["effort"])]

    def episode_stats(self, kept: list[dict], reasoning: list[int]) -> dict:
        by: dict[str, list[tuple[float, int]]] = {}
        for e, r in zip(kept, reasoning):
            by.setdefault(self.tags[self.tag_id(e)], []).append((e["reward"], r))
        return {"pass_by_tag": {t: sum(x >= 1.0 for x, _ in v) / len(v) for t, v in sorted(by.items())},
                "reasoning_by_tag": {t: sum(r for _, r in v) / len(v) for t, v in sorted(by.items())},
                "episodes_by_tag": {t: len(v) for t, v in sorted(by.items())}}

    def update_stats(self, trainer) -> dict:
        t = torch.tensor([float(self.step_stats.get(f"kl:{i}", 0.0)) for i in range(len(self.tags))]
                         + [float(self.step_stats.get(f"tokens:{i}", 0.0)) for i in range(len(self.tags))],
                         dtype=torch.float64, device=trainer.device)
        trainer.reduce_(t)
        n = len(self.tags)
        return {"kl_by_tag": {self.tags[i]: float(t[i]) / float(t[n + i]) for i in range(n) if t[n + i] > 0},
                "kl_teacher": float(t[:n].sum()) / max(float(t[n:].sum()), 1.0)}

    # ------------------------------------------------------------------ loss
    def loss(self, trainer, x, y, old, adv, tags) -> torch.Tensor:
        """Σ over the micro-batch's trained tokens of the reverse KL to each row's teacher
        (+ reward_weight × the clipped policy loss)."""
        rl, dev = self.rl, trainer.device
        x, y, old, adv, tags = (t.to(dev) for t in (x, y, old, adv, tags))
        logits, logp_all, mask, tgt, logp = self.policy_logprobs(trainer, x, y)
        total = logits.sum() * 0.0   # a graph through the model even when no row trains (FSDP's backward)
        acc = self.step_stats
        for i in torch.unique(tags).tolist():
            rows = (tags == i).nonzero().squeeze(-1)
            m = mask[rows]
            if not bool(m.any()):
                continue
            teacher = self.teacher_models[i]
            if isinstance(teacher, RemoteTeacher):   # the sampled tokens' logprobs, from the server
                t_tok = teacher.token_logprobs(x[rows], y[rows]).to(dev)
            else:
                with torch.no_grad():     # this tag's teacher, on its rows only
                    t_all = torch.log_softmax(teacher(x[rows]).logits.float(), -1)
                t_tok = t_all.gather(-1, tgt[rows]).squeeze(-1)
            if rl.estimator == "exact":
                part, st = mixed_kl_exact(logits[rows], t_all, m.float(), rl.top_k, rl.forward_weight)
            else:
                part, st = reverse_kl_sampled(logp[rows], old[rows], t_tok, m.float())
            total = total + part
            acc[f"kl:{i}"] = acc.get(f"kl:{i}", 0.0) + st["kl"]
            acc[f"tokens:{i}"] = acc.get(f"tokens:{i}", 0.0) + st["tokens"]
        n = self.record_sampler_stats(logp_all, logp, old, mask)
        if rl.reward_weight > 0:
            pl, _ = clipped_policy_loss(logp, old, adv, mask.float(), rl.eps_low, rl.eps_high)
            total = total + rl.reward_weight * pl * n
        return total


class RemoteTeacher:
    """A teacher behind an OpenAI-compatible ``/v1/completions`` that scores given token ids
    (``echo`` + ``logprobs``, ``max_tokens`` 0: what ``k3 serve`` answers), one row per request,
    up to ``concurrency`` requests in flight (a server that batches requests scores them together;
    ``k3 serve`` prefills each scoring request alone, so there they interleave). Each request is
    tried 3 times (1 s, 2 s apart); then the step fails with an error naming the teacher."""

    TRIES = 3
    CONCURRENCY = 4     # requests in flight, unless teachers.toml says otherwise

    def __init__(self, tag: str, spec: dict, tokenizer):
        import os

        self.tag, self.url, self.model, self.timeout = tag, spec["url"], spec["model"], spec["timeout"]
        self.concurrency = spec.get("concurrency", self.CONCURRENCY)   # a run saved before the key: the default
        key = os.environ.get(spec["api_key_env"], "") if spec.get("api_key_env") else ""
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.probe(tokenizer)

    def _score(self, ids: list[int]) -> dict:
        import time

        import httpx

        body = {"model": self.model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                "temperature": 0}
        last = None
        for attempt in range(self.TRIES):
            try:
                r = httpx.post(self.url + "/completions", json=body, headers=self.headers, timeout=self.timeout)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code < 500 and r.status_code != 429:
                    raise K3Error(f"teacher {self.tag!r} ({self.url}): {last}")
            if attempt + 1 < self.TRIES:
                time.sleep(2 ** attempt)
        else:
            raise K3Error(f"teacher {self.tag!r} ({self.url}) failed {self.TRIES} times: {last}")
        try:
            lp = r.json()["choices"][0]["logprobs"]
            toks, vals = lp["tokens"], lp["token_logprobs"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise K3Error(f"teacher {self.tag!r} ({self.url}) returned no logprobs (completions with echo "
                          "and logprobs)") from None
        if len(vals) != len(ids) or any(v is None for v in vals[1:]):
            raise K3Error(f"teacher {self.tag!r} ({self.url}) returned {len(vals)} logprobs for {len(ids)} "
                          "tokens")
        return {"tokens": toks, "logprobs": vals}

    def probe(self, tokenizer) -> None:
        """The teacher's token strings for some of the student's ids must be the student's."""
        ids = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i])][:: max(1, tokenizer.vocab_size // 64)]
        got = self._score(ids)["tokens"]
        want = [tokenizer.decode([i]) for i in ids]
        if got != want:
            k = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else 0
            raise ConfigError(f"teacher {self.tag!r} ({self.url}, model {self.model}) has another tokenizer than "
                              f"the student: token id {ids[k]} is {got[k]!r} there and {want[k]!r} here; "
                              "distillation compares token by token and needs the same ids")

    def token_logprobs(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[B, T]: the teacher's logprob of each target y (0 where y is IGNORE_INDEX), one request
        per row (its ids up to its last target), ``concurrency`` at a time; the first row that fails
        fails the call (the requests in flight are let finish, none new is sent)."""
        from concurrent.futures import ThreadPoolExecutor

        out = torch.zeros(y.shape, dtype=torch.float32)
        rows = []
        for b in range(y.shape[0]):
            pos = (y[b] != IGNORE_INDEX).nonzero().squeeze(-1)
            if pos.numel():
                last = int(pos[-1])
                rows.append((b, pos.tolist(), x[b, :last + 1].tolist() + [int(y[b, last])]))
        if not rows:
            return out
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(rows)),
                                thread_name_prefix=f"teacher-{self.tag}") as pool:
            futures = [pool.submit(self._score, ids) for _, _, ids in rows]
            try:
                for (b, pos, _), fut in zip(rows, futures):
                    vals = fut.result()["logprobs"]
                    for k in pos:
                        out[b, k] = vals[k + 1]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        return out


def _vocab_digest(tok) -> str:
    """The token ids' strings (what 'the same tokenizer' means for comparing logprobs id by id)."""
    return hashlib.sha256(json.dumps(tok.hf.get_vocab(), sort_keys=True).encode()).hexdigest()

