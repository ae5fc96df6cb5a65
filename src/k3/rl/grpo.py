"""``k3 rl`` (SPEC §10): reinforcement learning from hidden verifiers on Autonomous Execution Tasks.

The learner is the one Trainer (``k3.train.loop``) with ``GRPOObjective`` as its objective: the
optimizer, lr schedule, checkpoints, bit-exact resume and signal handling are ``k3 train``'s.
What a step learns from:

1. **Rollouts.** The step's tasks are ``tasks_per_step`` consecutive entries of the task list
   (wrapping). Each gets a group of ``group`` episodes sampled by the current weights: a copy of
   the policy is loaded into an ``Engine`` and driven through ``LocalEngine`` and the real harness
   and sandboxes (``k3.rl.rollout.run_episode``, the path ``k3 task run`` takes). Every episode has
   its own seed (from the run seed, step, task slot and member), used for its sampling and, with
   ``randomize``, for its harness randomization. A group has one effort (the efforts cycle) and
   one harness kind: with ``canonical`` = f > 0, the fraction f of the run's groups (every 1/f-th)
   samples on the canonical harness and the rest randomized, so that a policy that passes only
   the canonical "exam room" still gets groups with unequal rewards to learn from.
2. **Rewards** come only from the clean-room verifier (the episode's score). A verifier that
   crashes scores 0 (``k3.tasks.verify``). An episode whose harness or sandbox failed is *lost*:
   counted, left out of its group; a group with fewer than 2 episodes left is dropped and counted.
   When every episode of ``MAX_LOST_STEPS`` steps in a row is lost, the run stops (``RolloutsLost``).
3. **Advantages** are group-relative (``k3.ops.policy_loss.group_advantages``: reward minus the
   group mean, ÷ std with ``scale_std``); a group whose rewards are all equal has advantage 0.
4. **Tokens.** Each assistant turn is one sequence: the prompt the engine saw (``prompt_ids``)
   followed by what it sampled (``token_ids``), as the engine recorded them. Loss falls only on
   the sampled tokens, minus those the engine forced (the thinking cap's ``</think>``); system,
   user and tool-result tokens are only ever in prompts, so they never carry loss.
5. **Loss**: the token-level clipped surrogate against the sampler's recorded logprobs, with the
   optional k3 KL penalty toward the frozen starting weights (``beta``); every trained token of
   the step weighs the same (the Trainer divides the summed loss by the step's trained tokens).

Sampling and training alternate (the rollouts of step s are sampled by exactly the weights step s
starts from), so the importance ratio of a step's update is 1 up to float rounding; the
``sampler_max_abs_diff`` of each step measures that rounding (recorded − recomputed logprob).

Resume: the rollouts of step s are a function of the weights at step s and the seeds, so a run
killed mid-step resumes from its last checkpoint and samples that step again, identically.
The RL options live in the checkpoint (``data`` state), so ``k3 rl --resume DIR`` needs nothing
else. Before the first step every hack transcript of every task is replayed through the same
episode and verification path and must score at most its ``expect_reward`` (else the reward is
forgeable and the run is refused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.data.packing import IGNORE_INDEX
from k3.errors import CheckpointError, ConfigError, K3Error
from k3.ops.policy_loss import clipped_policy_loss, group_advantages
from k3.train.loop import TrainingDiverged

__all__ = ["RLConfig", "GRPOObjective", "episode_sequences", "resolve_tasks", "replay_hacks", "FORMAT"]

FORMAT = 1            # of the data state an RL checkpoint holds
EFFORT_CHOICES = ("low", "high", "max")
MAX_LOST_STEPS = 3    # steps in a row whose every episode was lost: the run stops


class RolloutsLost(TrainingDiverged):
    """Raised when every episode of ``MAX_LOST_STEPS`` steps in a row was lost (the CLI: one line, exit 1)."""


@dataclass
class RLConfig:
    """The options of one RL run (saved in every checkpoint of it)."""

    tasks: list[str] = field(default_factory=list)   # task dirs / FAMILY:A:B; absolute dirs once resolved
    group: int = 8                  # episodes per task and step (G)
    tasks_per_step: int = 2
    efforts: list[str | None] = field(default_factory=lambda: [None])  # cycled over the step's groups
    temperature: float = 1.0
    max_tokens: int = 256           # completion tokens per model call
    context_tokens: int = 4096      # the harness's context budget
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0               # KL penalty toward the starting weights (0: off)
    scale_std: bool = False
    micro_tokens: int = 8192        # padded tokens per micro-batch (memory bound of one forward)
    randomize: bool = True          # harness randomization, seeded per episode
    canonical: float = 0.0          # with randomize: the fraction of groups on the canonical harness
    backend: str = "namespace"
    workers: int = 1                # episodes at once: >1 in worker processes (or Ray tasks), each
    ray: bool = False               # loading the step's weights from OUT/rollouts/policy
    seed: int = 0
    keep_rollouts: bool = True      # write each episode's trajectory under OUT/rollouts/

    def validate(self) -> "RLConfig":
        if not self.tasks:
            raise ConfigError("k3 rl: no tasks (--tasks DIR or FAMILY:A:B)")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < self.min_group():
            raise ConfigError(f"--group must be an int >= {self.min_group()} (advantages are relative to the group), "
                              f"got {self.group!r}")
        for name in ("tasks_per_step", "max_tokens", "context_tokens", "micro_tokens", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an int >= 1, got {v!r}")
        for e in self.efforts:
            if e is not None and e not in EFFORT_CHOICES:
                raise ConfigError(f"--effort must be one of {', '.join(EFFORT_CHOICES)} or all, got {e!r}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"--temperature must be > 0 (RL samples), got {self.temperature!r}")
        for name in ("eps_low", "eps_high", "beta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a number >= 0, got {v!r}")
        if self.backend == "local":
            raise ConfigError("--backend local does not isolate the agent; RL needs namespace or vm")
        c = self.canonical
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c <= 1:
            raise ConfigError(f"--canonical must be a fraction in [0, 1], got {c!r}")
        if c > 0 and not self.randomize:
            raise ConfigError("--canonical has no effect with --no-randomize (every group is canonical)")
        return self

    def is_canonical(self, group: int) -> bool:
        """Whether the run's ``group``-th group (step * tasks_per_step + slot) samples on the
        canonical harness: the groups where floor(n * canonical) steps up, so that any first n
        groups hold floor(n * canonical) canonical ones (1/2: every second; 1/3: every third)."""
        if not self.randomize:
            return True
        return math.floor((group + 1) * self.canonical + 1e-9) > math.floor(group * self.canonical + 1e-9)

    def harness_of(self, group: int, seed: int) -> int | None:
        """The harness seed of an episode of the run's ``group``-th group (None: canonical)."""
        return None if self.is_canonical(group) else seed

    def min_group(self) -> int:
        """Episodes a group needs (group-relative advantages: 2)."""
        return 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RLConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"RL options: unknown keys {unknown}")
        return cls(**d).validate()


def resolve_tasks(specs: list[str], out: Path | None, generate: bool = True, heldout: bool = False) -> list[str]:
    """Task directories (absolute, in the order given) from ``--tasks`` values; ``out`` None only
    checks the values (nothing is generated); ``generate`` False: a family's tasks are the ones
    already generated into ``out/tasks`` (by another process of the same run). A family's seeds
    must be training seeds (below ``HELDOUT_START``), or held-out ones with ``heldout`` (evaluation)."""
    from k3.tasks.families import HELDOUT_START, get_family
    from k3.tasks.format import find_tasks

    found: list[str] = []
    for spec in specs:
        if os.path.exists(spec):
            found += [str(p.resolve()) for p in find_tasks(spec)]
            continue
        parts = spec.split(":")
        if len(parts) != 3:
            raise ConfigError(f"--tasks {spec!r}: not a path, nor FAMILY:A:B")
        fam = get_family(parts[0])
        try:
            a, b = int(parts[1]), int(parts[2])
        except ValueError:
            raise ConfigError(f"--tasks {spec!r}: A and B of FAMILY:A:B must be ints") from None
        if not 0 <= a < b:
            raise ConfigError(f"--tasks {spec!r}: the seed range A..B-1 is empty or negative")
        if heldout and a < HELDOUT_START:
            raise ConfigError(f"--tasks {spec!r}: evaluation takes held-out seeds, from {HELDOUT_START:,} on "
                              "(seeds below are training seeds)")
        if not heldout and b > HELDOUT_START:
            raise ConfigError(f"--tasks {spec!r}: seeds from {HELDOUT_START:,} on are held out for evaluation; "
                              "RL trains on training seeds only")
        for seed in range(a, b):
            if out is None:
                found.append(f"{spec}#{seed}")
            elif generate:
                found.append(str(fam.generate(seed, out / "tasks", overwrite=True).resolve()))
            else:
                d = (out / "tasks" / fam.task_id(seed)).resolve()
                if not d.is_dir():
                    raise K3Error(f"{d}: the task was not generated (another process of this run makes it)")
                found.append(str(d))
    if len(set(found)) != len(found):
        raise ConfigError("--tasks names a task twice")
    return found


def episode_seed(seed: int, step: int, slot: int, member: int) -> int:
    """The seed of one episode: a hash of (run seed, step, task slot, group member), 62 bits."""
    h = hashlib.sha256(f"k3-rl:{seed}:{step}:{slot}:{member}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 2


def family_of(task_id: str) -> str:
    """``files-1000003`` -> ``files``; a task without a numeric suffix is its own family."""
    head, _, tail = task_id.rpartition("-")
    return head if head and tail.isdigit() else task_id


def episode_sequences(records: list[dict]) -> list[dict]:
    """The trainable sequences of one trajectory: per assistant turn with a recorded sample,
    ``ids`` (prompt + sampled tokens), ``start`` (index in ``ids`` of the first sampled token),
    ``logprobs`` (the sampler's, one per sampled token) and ``train`` (0/1 per sampled token: 0 for
    tokens the engine forced)."""
    out = []
    for r in records:
        if r.get("type") != "turn":
            continue
        s = (r.get("metadata") or {}).get("sample")
        if not s or not s.get("token_ids"):
            continue
        prompt, toks, lps = list(s["prompt_ids"]), list(s["token_ids"]), list(s["logprobs"])
        if len(lps) != len(toks):
            raise K3Error(f"turn {r.get('index')}: {len(toks)} sampled tokens but {len(lps)} logprobs")
        forced = set(s.get("forced") or [])
        out.append({"ids": prompt + toks, "start": len(prompt), "logprobs": lps,
                    "train": [0 if i in forced else 1 for i in range(len(toks))]})
    return out


def replay_hacks(tasks, sandboxes, context_tokens: int = 4096, solutions: bool = False) -> list[tuple]:
    """(task id, transcript path, score, expect_reward) of every hack transcript of ``tasks``
    (loaded ``Task`` objects), each replayed by the Scripted provider through ``run_episode`` and
    the clean-room verifier, as a rollout is; ``solutions``: the reference solutions instead (the
    positive control: the same path gives their reward)."""
    from k3.agent.providers import Scripted
    from k3.rl.rollout import run_episode
    from k3.rl.trajectory import TrajectoryWriter

    rows = []
    for task in tasks:
        for h in ([task.solution] if solutions else task.hacks):
            s = run_episode(task.root, Scripted(h.turns), TrajectoryWriter(None), sandboxes=sandboxes,
                            context_tokens=context_tokens)
            rows.append((task.id, str(h.path), float(s["score"]), float(h.expect_reward)))
    return rows


class TaskSet:
    """What the run trains on, as the Trainer's ``corpus``: a fingerprint of the tasks' digests."""

    def __init__(self, tasks: list[Path]):
        from k3.tasks.format import load_task

        self.tasks = [load_task(t, transcripts=True) for t in tasks]
        self.digests = {t.id: t.digest() for t in self.tasks}
        self.fingerprint = hashlib.sha256(json.dumps(self.digests, sort_keys=True).encode()).hexdigest()
        fams: dict[str, int] = {}
        for t in self.tasks:
            fams[family_of(t.id)] = fams.get(family_of(t.id), 0) + 1
        self.families = fams
        self.name = "tasks: " + ", ".join(f"{f} ({n})" for f, n in sorted(fams.items()))

    def counts(self) -> dict:
        return {"tasks": len(self.tasks), "families": dict(self.families),
                "hacks": sum(len(t.hacks) for t in self.tasks)}

    def doc_digests(self) -> dict:
        return dict(self.digests)


class RolloutData:
    """The Trainer's ``data`` for RL: the micro-batches of the coming step, sampled on demand."""

    def __init__(self, objective: "GRPOObjective"):
        self.obj = objective
        self.step: int | None = None
        self.micros: list[tuple[torch.Tensor, ...]] = []
        self.next = 0

    def state_dict(self) -> dict:
        return {"format": FORMAT, self.obj.KIND: self.obj.rl.to_dict()}

    def load_state_dict(self, d: dict) -> None:
        """(``build_data`` has read the RL options from ``d``.) Nothing else to restore: a step is
        sampled again from its weights."""
        self.step, self.next = None, 0

    def prepare(self, trainer) -> int:
        if self.step != trainer.step:
            self.micros = self.obj.sample_step(trainer)
            self.step = trainer.step
        self.next = 0
        return len(self.micros)

    def next_batch(self, seq_len: int):
        m = self.micros[self.next]
        self.next += 1
        return m


class GRPOObjective:
    """The Trainer objective of ``k3 rl`` (module doc). ``k3 distill`` (``k3.rl.distill``) is this
    objective with another loss: the sampling, rewards, masks, packing, logging and resume are
    these."""

    KIND, WHAT, CONFIG = "rl", "an RL", RLConfig
    TAGGED = False     # micro-batches carry each row's teacher tag (k3 distill)

    def __init__(self, rl: RLConfig | None, log=print):
        """``rl``: a fresh run's options (its ``tasks`` still as given on the command line); None
        when resuming (the options come from the checkpoint)."""
        self.rl, self.log = (rl.validate() if rl is not None else None), log
        self.sandboxes = None
        self.pool = None     # the rollout worker processes (--workers > 1), kept from step to step
        self._worker_owner: str | None = None   # the name prefix of their sandboxes
        self.run_dir: Path | None = None
        self.reference = None
        self.step_stats: dict = {}
        self.rollout_stats: dict = {}
        self.micros_trained: list = []   # this process's share of the step's micro-batches
        self.lost_steps = 0   # steps in a row whose every episode was lost (MAX_LOST_STEPS stops the run)

    # ------------------------------------------------------------------ Trainer protocol
    def build_data(self, trainer, ckpt, saved) -> None:
        from k3.data.chat import ChatFormat
        from k3.data.tokenizer import Tokenizer
        from k3.train.loop import token_byte_lengths

        tc = trainer.tc
        self.run_dir = trainer.run_dir
        if saved is not None:
            if not isinstance(saved.get("data"), dict) or self.KIND not in saved["data"]:
                raise CheckpointError(f"cannot resume {trainer.run_dir} with k3 {self.KIND}: its checkpoint is "
                                      f"not of {self.WHAT} run (resume it with the command that wrote it)")
            self.rl = self.CONFIG.from_dict(saved["data"][self.KIND])
        elif self.rl is None:
            raise ConfigError(f"k3 {self.KIND}: a fresh run needs its options")
        else:   # generated tasks go into the run dir, which the Trainer has claimed by now; under
            # torchrun rank 0 writes them before the other ranks get here (Trainer._build_data)
            self.rl.tasks = resolve_tasks(self.rl.tasks, trainer.run_dir, generate=trainer.rank == 0)
        tok_path = (ckpt / "tokenizer.json") if saved is not None else trainer.init_dir.tokenizer
        trainer.tokenizer = Tokenizer.load(tok_path)
        try:
            self.fmt = ChatFormat(trainer.tokenizer)
        except K3Error as e:
            raise ConfigError(f"k3 rl: {tok_path}: {e}") from None
        trainer.curriculum = tc.context_curriculum()
        trainer.schedule = tc.lr_schedule()
        trainer.corpus = TaskSet([Path(t) for t in self.rl.tasks])
        if saved is not None and saved["corpus_fingerprint"] != trainer.corpus.fingerprint:
            from k3.train.runinfo import corpus_difference
            raise CheckpointError(f"cannot resume {trainer.run_dir}: "
                                  + corpus_difference(saved.get("corpus_docs"), trainer.corpus))
        trainer.token_bytes = token_byte_lengths(trainer.tokenizer)
        trainer.data = RolloutData(self)
        trainer.on_step_end.append(self._log_step)
        if trainer.rank == 0:   # before any process of this start makes one (the others wait for rank 0)
            self._close_left(self._owner(), "an earlier, interrupted start of this run")

    def micro_batches(self, trainer) -> int:
        return trainer.data.prepare(trainer)

    def is_padding(self, trainer, i: int) -> bool:
        return i >= len(self.micros_trained)

    def loss(self, trainer, x, y, old, adv) -> torch.Tensor:
        """Σ over the micro-batch's trained tokens of the clipped surrogate (+ beta · k3 KL)."""
        x, y, old, adv = (t.to(trainer.device) for t in (x, y, old, adv))
        _, logp_all, mask, tgt, logp = self.policy_logprobs(trainer, x, y)
        ref = None
        if self.rl.beta > 0:
            with torch.no_grad():
                ref = torch.log_softmax(self.reference(x).logits.float(), -1).gather(-1, tgt).squeeze(-1)
        loss, st = clipped_policy_loss(logp, old, adv, mask.float(), self.rl.eps_low, self.rl.eps_high,
                                       self.rl.beta, ref)
        n = self.record_sampler_stats(logp_all, logp, old, mask)
        for k in ("clip_fraction", "kl"):
            self.step_stats[k] = self.step_stats.get(k, 0.0) + st[k] * n
        return loss * n

    def policy_logprobs(self, trainer, x, y):
        """The policy's forward on a micro-batch (on the device): fp32 logits, their log-softmax,
        the trained-token mask, the targets [.., 1] and the targets' logprobs."""
        dev = trainer.device
        with torch.autocast(dev.type, dtype=trainer.autocast_dtype or torch.bfloat16,
                            enabled=trainer.autocast_dtype is not None):
            logits = trainer.forward(x).logits.float()
        logp_all = torch.log_softmax(logits, -1)
        mask = y != IGNORE_INDEX
        tgt = y.clamp_min(0).unsqueeze(-1)
        return logits, logp_all, mask, tgt, logp_all.gather(-1, tgt).squeeze(-1)

    @torch.no_grad()
    def record_sampler_stats(self, logp_all, logp, old, mask) -> float:
        """Add the micro-batch's trained tokens, importance ratio, entropy and sampler gap to the
        step's sums; returns its trained-token count."""
        n = float(mask.sum())
        ent = -(logp_all.exp() * logp_all).sum(-1)
        d = (old - logp)[mask]
        acc = self.step_stats
        acc["tokens"] = acc.get("tokens", 0.0) + n
        acc["ratio"] = acc.get("ratio", 0.0) + float(torch.exp(-d).sum())
        acc["entropy"] = acc.get("entropy", 0.0) + float(ent[mask].sum())
        acc["sampler_kl"] = acc.get("sampler_kl", 0.0) + float((d.exp() - d - 1).sum())
        acc["sampler_max_abs_diff"] = max(acc.get("sampler_max_abs_diff", 0.0),
                                          float(d.abs().max()) if d.numel() else 0.0)
        return n

    # ------------------------------------------------------------------------ rollouts
    def _owner(self) -> str:
        """The name prefix of the run's sandboxes (each process adds ``-r<rank>``): a run killed
        mid-episode leaves live ones, which rank 0 of the next start closes (``build_data``)."""
        return "k3rl-" + hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:12]

    def _drop_pool(self) -> None:
        """Shut the rollout workers down, then close the sandboxes of theirs that a killed worker
        left (they are named after the run: ``_worker_owner``); none of theirs is in use by then."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = None
        self._close_left(self._worker_owner, "killed rollout workers")

    def _close_left(self, owner: str, who: str) -> None:
        """Close the sandboxes named after ``owner`` that ``who`` left (``Sandboxes.close_owned``);
        never fatal to the run: its own sandboxes have other names, and what cannot be closed now (a
        cgroup still busy) is ``k3 env gc``'s, which the log line names."""
        from k3.tasks.verify import Sandboxes

        try:
            left = Sandboxes(self.rl.backend, owner=owner).close_owned()
        except (K3Error, OSError) as e:
            self.log(f"could not close every sandbox {who} left ({e}); `k3 env gc` removes them")
            return
        if left:
            self.log(f"closed {len(left)} sandboxes {who} left")

    def _sandboxes(self, rank: int = 0):
        if self.sandboxes is None:
            from k3.tasks.verify import Sandboxes
            self.sandboxes = Sandboxes(self.rl.backend, owner=f"{self._owner()}-r{rank}")
        return self.sandboxes

    def _load_reference(self, trainer, state: dict) -> None:
        """The frozen starting weights (``state``: the policy's at this step, every process), kept
        whole in the run dir at the first step, so a resumed run needs no other folder."""
        from k3.model.decoder import K3ForCausalLM
        from k3.checkpoint.training import load_model_weights, save_model_weights

        where = trainer.run_dir / "reference"
        ref = K3ForCausalLM(trainer.model_config)
        if trainer.step == 0:
            ref.load_state_dict(state)
            if trainer.rank == 0:   # written whole, then renamed: a kill leaves none or all of it
                import shutil
                tmp = where / "model.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                save_model_weights(ref, tmp)
                os.replace(tmp, where / "model")
        elif (where / "model").exists():
            load_model_weights(ref, where / "model")
        else:
            raise K3Error(f"{where}: the reference weights of this run are missing (needed for --beta > 0)")
        self.reference = ref.to(trainer.device).eval().requires_grad_(False)

    def close(self) -> None:
        if self.pool is not None:
            self._drop_pool()
        if self.sandboxes is not None:
            self.sandboxes.close()
            self.sandboxes = None

    def check_hacks(self, trainer) -> dict:
        """Every hack transcript of every task through the rollouts' episode + verification path
        (``replay_hacks``); one that scores above its expect_reward refuses the run."""
        mine = trainer.corpus.tasks[trainer.rank::trainer.world]     # each process replays its share
        rows = [r for part in trainer.gather_objects(
            replay_hacks(mine, self._sandboxes(trainer.rank), self.rl.context_tokens)) for r in part]
        for task_id, path, score, expect in rows:
            if score > expect:
                raise ConfigError(f"k3 rl: hack {path} scored {score} (expected at most {expect}): the reward "
                                  f"of task {task_id} is forgeable; fix its verifier before training on it")
        worst = max((r[2] for r in rows), default=0.0)
        rec = trainer.metrics.log("hacks", step=trainer.step, hacks=len(rows), max_score=worst)
        self.log(f"hack suite: {len(rows)} hack transcripts replayed through the RL verification path, "
                 f"max score {worst}")
        return rec

    def sample_step(self, trainer) -> list[tuple[torch.Tensor, ...]]:
        """The rollouts of the coming step -> its micro-batches (x, y, old logprobs, advantages)."""
        from k3.agent.providers import LocalEngine
        from k3.infer.engine import Engine
        from k3.model.decoder import K3ForCausalLM
        from k3.rl.rollout import run_episode
        from k3.rl.trajectory import TrajectoryWriter

        rl, step = self.rl, trainer.step
        t0 = time.perf_counter()
        state = trainer.full_model_state()
        policy = K3ForCausalLM(trainer.model_config)
        policy.load_state_dict(state)
        if rl.beta > 0 and self.reference is None:
            self._load_reference(trainer, state)
        del state
        tasks = [trainer.corpus.tasks[(step * rl.tasks_per_step + j) % len(trainer.corpus.tasks)]
                 for j in range(rl.tasks_per_step)]
        plan = []   # (slot, task, member, effort, seed, harness seed, trajectory path)
        for slot, task in enumerate(tasks):
            effort = rl.efforts[(step * rl.tasks_per_step + slot) % len(rl.efforts)]
            for member in range(rl.group):
                path = (trainer.run_dir / "rollouts" / f"step-{step + 1:06d}" / f"{slot}-{task.id}-{member}.jsonl"
                        if rl.keep_rollouts else None)
                seed = episode_seed(rl.seed, step, slot, member)
                plan.append((slot, task, member, effort, seed, rl.harness_of(step * rl.tasks_per_step + slot, seed),
                             path))
        sampling = {"temperature": rl.temperature, "max_tokens": rl.max_tokens, "context_tokens": rl.context_tokens}
        rank, world = trainer.rank, trainer.world
        mine = plan[rank::world]                      # under torchrun each process samples its share
        if rl.workers > 1 or rl.ray:
            episodes = self._sample_in_workers(trainer, policy, mine, sampling)
        else:
            episodes = []
            provider = LocalEngine(Engine(policy.to(trainer.device), tokenizer=trainer.tokenizer),
                                   name=f"policy-step{step}")
            try:
                for slot, task, member, effort, seed, harness, path in mine:
                    if trainer.stop_requested() is not None:   # the trainer drops this step and saves
                        break
                    w = TrajectoryWriter(path)
                    try:
                        s = run_episode(task.root, provider, w, sandboxes=self._sandboxes(rank),
                                        harness=harness, seed=seed, effort=effort, **sampling)
                        episodes.append(_episode(slot, task, effort, harness, s, w.records))
                    except Exception as e:  # noqa: BLE001 - a lost episode is counted, never fatal
                        episodes.append(_episode(slot, task, effort, harness, lost=f"{type(e).__name__}: {e}"))
                    finally:
                        w.close()
            finally:
                provider.close()
        if world > 1:   # every process gets every episode, in plan order, and whether any was stopped
            parts = trainer.gather_objects((episodes, trainer.stop_requested()))
            stops = [sig for _, sig in parts if sig is not None]
            if stops:   # a distributed Trainer acts on a signal at a step boundary; this drops the step on every rank
                trainer.stop_signal = stops[0]
            episodes = [None] * len(plan)
            for r, (eps, _) in enumerate(parts):
                episodes[r::world] = eps if len(eps) == len(plan[r::world]) else [None] * len(plan[r::world])
            episodes = [e for e in episodes if e is not None]
        for ep in episodes:
            if ep["reward"] is None:
                self.log(f"step {step + 1}: an episode of {ep['task']} was lost: {ep['detail']}")
        self._count_lost(step, episodes)
        t_sample = time.perf_counter() - t0
        micros, stats = self._micro_batches(episodes)
        mb = micros[rank::world]   # the same micro-batches on every process: each trains its share,
        self.micros_trained = mb   # all as many (padded with ones that train nothing)
        micros = mb + [_empty_micro(self.TAGGED)] * (-(-len(micros) // world) - len(mb))
        stats["sample_s"] = t_sample
        stats["sampled_tokens_per_s"] = stats["sampled_tokens"] / max(t_sample, 1e-9)
        self.rollout_stats = stats
        self.step_stats = {}
        self._t_train = time.perf_counter()
        return micros

    def _sample_in_workers(self, trainer, policy, plan, sampling) -> list[dict]:
        """The step's episodes as ``k3.rl.rollout`` jobs (a process pool of ``workers``, or Ray
        tasks): the weights go to OUT/rollouts/policy once, and each worker loads them into one
        engine per step (``job_provider``: the job's ``version`` is the step) that runs its
        episodes one at a time, each alone in it, as the in-process path does. The pool is kept
        from step to step and shut down by ``close``."""
        import shutil
        import tempfile

        from k3.checkpoint import save_pretrained
        from k3.rl.rollout import run_jobs, worker_pool
        from k3.rl.trajectory import read_trajectory

        rl = self.rl
        wdir = trainer.run_dir / "rollouts" / "policy"
        if trainer.rank == 0:
            shutil.rmtree(wdir, ignore_errors=True)
            save_pretrained(policy, wdir)
            trainer.tokenizer.save(wdir)
        trainer.gather_objects(None)   # the weights are written before any process's jobs load them
        scratch = Path(tempfile.mkdtemp(prefix="k3rl-", dir=trainer.run_dir / "rollouts"))
        self._worker_owner = f"{self._owner()}-r{trainer.rank}w"   # its workers' sandboxes
        jobs = []
        for i, (slot, task, member, effort, seed, harness, path) in enumerate(plan):
            jobs.append({"task": str(task.root),
                         "provider": {"kind": "local", "ckpt": str(wdir), "version": f"{id(self)}-{trainer.step}"},
                         "seed": seed, "harness": harness, "backend": rl.backend, "owner": self._worker_owner,
                         "out": str(path or scratch / f"{i}.jsonl"), "sampling": {**sampling, "effort": effort},
                         "threads": torch.get_num_threads()})   # the numbers of the in-process path
        try:
            try:
                if not rl.ray and self.pool is None:
                    self.pool = worker_pool(rl.workers)
                results = run_jobs(jobs, rl.workers, rl.ray, pool=self.pool)
            except Exception as e:  # noqa: BLE001 - a pool that broke (a worker died): all counted lost
                results = [{"status": "error", "detail": f"the rollout workers failed: {type(e).__name__}: {e}"}
                           for _ in jobs]
                if self.pool is not None:   # the next step starts fresh workers
                    self._drop_pool()
            return [_episode(slot, task, effort, harness, lost=res.get("detail")) if res.get("status") == "error"
                    else _episode(slot, task, effort, harness, res, read_trajectory(job["out"]))
                    for (slot, task, member, effort, seed, harness, path), job, res in zip(plan, jobs, results)]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _count_lost(self, step: int, episodes: list[dict]) -> None:
        """Stop the run (``RolloutsLost``) when every episode of ``MAX_LOST_STEPS`` steps in a row
        was lost: nothing trains, and a run that went on would only log empty steps. Every process
        sees the same episodes, so all stop at the same step."""
        if not episodes or any(e["reward"] is not None for e in episodes):
            self.lost_steps = 0
            return
        self.lost_steps += 1
        if self.lost_steps >= MAX_LOST_STEPS:
            why = str(episodes[-1]["detail"]).strip().splitlines()
            raise RolloutsLost(f"every episode of {self.lost_steps} steps in a row was lost (steps "
                               f"{step + 2 - self.lost_steps}-{step + 1}; the last: {why[-1] if why else 'no detail'}); "
                               "nothing trained; check the tasks, sandboxes and rollout workers")

    def _micro_batches(self, episodes: list[dict]):
        rl = self.rl
        end_think = self.fmt.think_end_id
        lost = [e for e in episodes if e["reward"] is None]
        kept = [e for e in episodes if e["reward"] is not None]
        by_slot: dict[int, list[dict]] = {}
        for e in kept:
            by_slot.setdefault(e["slot"], []).append(e)
        dropped = [s for s, es in by_slot.items() if len(es) < self.min_group()]
        train_eps = [e for e in kept if e["slot"] not in dropped]
        degenerate = 0
        if not self.uses_rewards():
            for e in train_eps:
                e["advantage"] = 0.0
        elif train_eps:
            adv, degenerate = group_advantages(torch.tensor([e["reward"] for e in train_eps]),
                                               torch.tensor([e["slot"] for e in train_eps]), rl.scale_std)
            for e, a in zip(train_eps, adv.tolist()):
                e["advantage"] = a
        seqs, sampled, reasoning, calls, turns, idle = [], 0, [], [], 0, 0
        for e in kept:
            ts = [r for r in e["records"] if r.get("type") == "turn"]
            turns += len(ts)
            calls.append(sum(len(t.get("tool_calls") or []) for t in ts))
            r_tok = 0
            for t in ts:
                toks = ((t.get("metadata") or {}).get("sample") or {}).get("token_ids") or []
                sampled += len(toks)
                r_tok += toks.index(end_think) if end_think in toks else len(toks)
            reasoning.append(r_tok)
            if "advantage" in e:
                sqs = episode_sequences(e["records"])
                if e["advantage"] == 0.0 and not self.trains_zero_advantage():
                    idle += len(sqs)   # its gradient is exactly 0: not worth a forward and backward
                    continue
                for sq in sqs:
                    seqs.append((sq, e["advantage"], self.tag_id(e)))
        micros = self._pack(seqs)
        rewards = [e["reward"] for e in kept]
        fam: dict[str, list[float]] = {}
        for e in kept:
            fam.setdefault(e["family"], []).append(e["reward"])
        by_harness = {k: [e["reward"] >= 1.0 for e in kept if (e["harness"] is None) == (k == "canonical")]
                      for k in ("canonical", "randomized")}
        stats = {"episodes": len(episodes), "lost": len(lost), "groups_dropped": len(dropped),
                 "verifier_failed": sum(bool(e.get("verifier_failed")) for e in kept),
                 "groups_degenerate": degenerate,
                 "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                 "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else None,
                 "reward_by_family": {f: sum(v) / len(v) for f, v in sorted(fam.items())},
                 **{f"pass_rate_{k}": sum(v) / len(v) if v else None for k, v in by_harness.items()},
                 "reasoning_tokens": sum(reasoning) / len(reasoning) if reasoning else None,
                 "tool_calls": sum(calls) / len(calls) if calls else None,
                 "turns": turns, "sampled_tokens": sampled, "sequences": len(seqs),
                 "sequences_zero_advantage": idle}
        stats.update(self.episode_stats(kept, reasoning))
        return micros, stats

    # seams of k3 distill
    def min_group(self) -> int:
        """Episodes a group needs to be trained on."""
        return self.rl.min_group()

    def uses_rewards(self) -> bool:
        return True

    def trains_zero_advantage(self) -> bool:
        """Whether an episode of advantage 0 (every episode of a degenerate group) still has a
        gradient: only through the KL penalty. Without it, its clipped surrogate is 0 at every
        token whatever the ratio, so it is left out of the step (as DAPO's dynamic sampling does)."""
        return self.rl.beta > 0

    def tag_id(self, episode: dict) -> int:
        """The index of the teacher of an episode's tokens (RL: none)."""
        return 0

    def episode_stats(self, kept: list[dict], reasoning: list[int]) -> dict:
        """More per-step figures of the kept episodes (``reasoning``: each one's reasoning tokens)."""
        return {}

    def update_stats(self, trainer) -> dict:
        """More per-step figures of the update (collective: every process calls it)."""
        return {}

    def _pack(self, seqs: list[tuple[dict, float, int]]) -> list[tuple[torch.Tensor, ...]]:
        """Sequences (longest first) into micro-batches of at most ``micro_tokens`` padded tokens;
        one empty micro-batch when nothing is trained this step (its loss is 0). A micro-batch is
        (x, y, sampler logprobs, advantages) and, with ``TAGGED``, each row's teacher tag index."""
        order = sorted(seqs, key=lambda s: -len(s[0]["ids"]))
        groups: list[list[tuple[dict, float]]] = []
        for sq in order:   # a micro-batch's first sequence is its longest: rows x that length
            if groups and (len(groups[-1]) + 1) * (len(groups[-1][0][0]["ids"]) - 1) <= self.rl.micro_tokens:
                groups[-1].append(sq)
            else:
                groups.append([sq])
        if not groups:
            return [_empty_micro(self.TAGGED)]
        out = []
        for g in groups:
            T = len(g[0][0]["ids"]) - 1
            x = torch.zeros(len(g), T, dtype=torch.long)
            y = torch.full((len(g), T), IGNORE_INDEX, dtype=torch.long)
            old = torch.zeros(len(g), T)
            adv = torch.zeros(len(g), T)
            for b, (sq, a, _) in enumerate(g):
                ids, st = sq["ids"], sq["start"]
                x[b, :len(ids) - 1] = torch.tensor(ids[:-1])
                for m, (lp, tr) in enumerate(zip(sq["logprobs"], sq["train"])):
                    k = st - 1 + m           # the position whose next token is sampled token m
                    if tr:
                        y[b, k] = ids[st + m]
                        old[b, k] = lp
                        adv[b, k] = a
            tags = (torch.tensor([t for _, _, t in g], dtype=torch.long),) if self.TAGGED else ()
            out.append((x, y, old, adv, *tags))
        return out

    # ------------------------------------------------------------------------- logging
    def _log_step(self, trainer, rec: dict) -> None:
        if rec.get("kind") != "train":
            return
        keys = ("tokens", "ratio", "clip_fraction", "kl", "sampler_kl", "entropy")
        sums = trainer.reduce_(torch.tensor([float(self.step_stats.get(k, 0.0)) for k in keys],
                                            dtype=torch.float64, device=trainer.device))
        worst = trainer.reduce_(torch.tensor([float(self.step_stats.get("sampler_max_abs_diff", 0.0))],
                                             dtype=torch.float64, device=trainer.device), "max")
        acc = {**dict(zip(keys, sums.tolist())), "sampler_max_abs_diff": float(worst)}
        n = max(acc["tokens"], 1.0)
        t_train = time.perf_counter() - getattr(self, "_t_train", time.perf_counter())
        rs = self.rollout_stats
        row = {**rs, "trained_tokens": acc.get("tokens", 0.0),
               "ratio": acc.get("ratio", 0.0) / n, "clip_fraction": acc.get("clip_fraction", 0.0) / n,
               "kl_ref": acc.get("kl", 0.0) / n if self.rl.beta > 0 else None,
               "sampler_kl": acc.get("sampler_kl", 0.0) / n, "entropy": acc.get("entropy", 0.0) / n,
               "sampler_max_abs_diff": acc.get("sampler_max_abs_diff", 0.0),
               "train_s": t_train, "trained_tokens_per_s": acc.get("tokens", 0.0) / max(t_train, 1e-9),
               "loss": rec["loss"], **self.update_stats(trainer)}
        trainer.metrics.log("rl", step=rec["step"], **row)
        fam = "  ".join(f"{k} {v:.2f}" for k, v in rs.get("reward_by_family", {}).items())
        trainer.print(f"step {rec['step']}: reward {_f(rs.get('reward_mean'))}  pass {_f(rs.get('pass_rate'))}  "
                      f"[{fam}]  degenerate {rs.get('groups_degenerate')}/{self.rl.tasks_per_step}  "
                      f"lost {rs.get('lost')}  verifier failed {rs.get('verifier_failed')}  "
                      f"clip {row['clip_fraction']:.3f}  entropy {row['entropy']:.3f}  "
                      f"sampler diff {row['sampler_max_abs_diff']:.1e}")


def _episode(slot: int, task, effort, harness: int | None, summary: dict | None = None,
             records: list | None = None, lost: str | None = None) -> dict:
    """One sampled episode as the step uses it: its group (slot), harness seed (None: canonical),
    reward and records from the episode's summary, or lost (reward None, with why)."""
    from k3.tasks.verify import verifier_failed

    ep = {"slot": slot, "task": task.id, "family": family_of(task.id), "effort": effort, "harness": harness}
    if summary is None:
        return {**ep, "reward": None, "status": "lost", "detail": lost, "records": []}
    return {**ep, "reward": float(summary["score"]), "status": summary["status"], "records": records,
            "verifier_failed": any(verifier_failed(v["reason"]) for v in summary.get("verdicts", []))}


def _empty_micro(tagged: bool = False) -> tuple[torch.Tensor, ...]:
    """A micro-batch that trains nothing (its loss is 0): a step with nothing to train, and a
    process's padding so that every process runs as many forwards."""
    z = torch.zeros(1, 1)
    tags = (torch.zeros(1, dtype=torch.long),) if tagged else ()
    return (torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), IGNORE_INDEX), z, z, *tags)


def _f(v) -> str:
    return "-" if v is None else f"{v:.3f}"
