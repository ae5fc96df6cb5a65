"""``k3 rl`` end to end (SPEC §10): a policy SFT'd to answer "A" or "B" at random learns, from the
hidden verifier's reward alone, that "A" is right, and does not with the rewards shuffled; what
it trains on is exactly what it sampled, at the logprobs the engine recorded; a run killed with
SIGKILL mid-step resumes to the same weights and rewards; a forgeable reward refuses the run;
every starter task's hacks score 0 under the loop's own verification path (its solutions, the
control, score 1); bad input is one line."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from k3.data.chat import ChatFormat
from k3.data.packing import IGNORE_INDEX
from k3.rl import grpo
from k3.rl.grpo import GRPOObjective, RLConfig, episode_sequences, replay_hacks
from k3.cli.rl import rl_main
from k3.cli.train import sft_main
from k3.rl.trajectory import read_trajectory
from k3.tasks.format import find_tasks, load_task
from k3.train.metrics import read_metrics
from taskdirs import make_letter_task

pytestmark = pytest.mark.slow

TEXT = "Pick a letter. A or B. The answer is A. The answer is B.\n"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def letters(tmp_path_factory, make_nano_checkpoint, env_root):
    """A nano model fine-tuned to end its thinking at once and answer "A" or "B", half each; the
    letter task (reward 1 for "A")."""
    d = tmp_path_factory.mktemp("grpo")
    ckpt = make_nano_checkpoint(d / "nano", TEXT)[0]
    rows = [{"messages": [{"role": "user", "content": "Pick a letter."},
                          {"role": "assistant", "reasoning_content": "", "content": "AB"[i % 2]}]}
            for i in range(40)]
    (d / "ab.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sft_main(["--from", str(ckpt), "--data", str(d / "ab.jsonl"), "--out", str(d / "sft"), "--steps", "40",
                     "--batch-size", "8", "--seq-len", "64", "--threads", "1", "--no-plot", "--val-percent", "0",
                     "--lr", "3e-3"]) == 0
    task = make_letter_task(d / "tasks")
    return d, d / "sft", task


def rl_argv(ckpt, task, out, *extra, steps=12, group=8, lr="6e-4"):
    return ["--from", str(ckpt), "--tasks", str(task), "--out", str(out), "--group", str(group),
            "--tasks-per-step", "1", "--steps", str(steps), "--max-tokens", "16", "--threads", "1",
            "--lr", lr, "--no-plot", "--ckpt-interval", "1", *extra]


def rl_records(run):
    return [r for r in read_metrics(run) if r["kind"] == "rl"]


@pytest.fixture(scope="module")
def learned(letters):
    d, sft, task = letters
    assert rl_main(rl_argv(sft, task, d / "rl")) == 0
    return d / "rl"


def test_reward_rises_to_the_right_token_and_shuffled_rewards_do_not(letters, learned, monkeypatch, sandboxes):
    d, sft, task = letters
    rewards = [r["reward_mean"] for r in rl_records(learned)]
    print("rewards:", rewards)
    assert len(rewards) == 12 and rewards[0] < 0.9
    assert sum(rewards[-3:]) / 3 >= 0.9, rewards
    # control: the same run with each step's rewards permuted across its episodes before the
    # advantages: what is rewarded no longer follows what was sampled
    real = grpo.group_advantages
    gen = torch.Generator().manual_seed(0)

    def shuffled(rewards, groups, scale_std=False, eps=1e-6):
        return real(rewards[torch.randperm(len(rewards), generator=gen)], groups, scale_std, eps)

    monkeypatch.setattr(grpo, "group_advantages", shuffled)
    assert rl_main(rl_argv(sft, task, d / "shuffled")) == 0
    control = [r["reward_mean"] for r in rl_records(d / "shuffled")]
    print("shuffled:", control)
    assert sum(control[-3:]) / 3 < 0.8, control


def test_the_learner_trains_the_sampled_tokens_at_the_recorded_logprobs(letters, learned, sandboxes):
    d, sft, task = letters
    recs = rl_records(learned)
    assert all(r["sampler_max_abs_diff"] <= 1e-4 for r in recs), [r["sampler_max_abs_diff"] for r in recs]
    # independently of the objective's loss: the plain forward of the weights that sampled step 1
    # (the SFT checkpoint) over the packed micro-batches, at the targets
    obj = GRPOObjective(RLConfig(tasks=[str(task)]))
    obj.fmt = ChatFormat(_tokenizer(sft))
    model = _model(sft)
    eps = []
    for f in sorted((learned / "rollouts" / "step-000001").glob("*.jsonl")):
        records = read_trajectory(f)
        end = next(r for r in records if r["type"] == "end")
        eps.append({"slot": 0, "task": "letter", "family": "letter", "effort": None, "reward": end["score"],
                    "harness": records[0]["conditions"]["harness"]["seed"], "records": records})
    assert len(eps) == 8 and 0 < sum(e["reward"] for e in eps) < 8     # a group with something to learn
    micros, stats = obj._micro_batches(eps)
    worst, shifted, n = 0.0, 0.0, 0
    for x, y, old, adv in micros:
        with torch.no_grad():
            lp = torch.log_softmax(model(x).logits.float(), -1)
        m = y != IGNORE_INDEX
        got = lp.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        worst = max(worst, float((got - old)[m].abs().max()))
        off = lp[:, 1:].gather(-1, y[:, :-1].clamp_min(0).unsqueeze(-1)).squeeze(-1)  # one position late
        shifted = max(shifted, float((off - old[:, :-1])[m[:, :-1]].abs().max()))
        n += int(m.sum())
        assert bool((adv[m] != 0).all()) and bool((adv[~m] == 0).all())
    print(f"{n} trained tokens: max |recorded - recomputed| {worst:.2e}, one position off {shifted:.2e}")
    assert n == stats["sampled_tokens"] and worst <= 1e-4 and shifted > 1e-2


def test_zero_advantage_episodes_are_left_out_without_changing_the_gradient(letters, learned):
    """A degenerate group (all rewards equal) has advantage 0 at every token: without the KL
    penalty its surrogate's gradient is exactly 0, so the learner skips its forward. Checked
    against the full batch's gradient, computed with the loss formula directly; the control is
    beta > 0, where the same episodes carry the KL gradient and stay in the step."""
    from k3.ops.policy_loss import clipped_policy_loss
    d, sft, task = letters
    eps = []
    for f in sorted((learned / "rollouts" / "step-000001").glob("*.jsonl")):
        records = read_trajectory(f)
        end = next(r for r in records if r["type"] == "end")
        for slot, reward in ((0, end["score"]), (1, 1.0)):     # slot 1: the same episodes, all passed
            eps.append({"slot": slot, "task": "letter", "family": "letter", "effort": None, "reward": reward,
                        "harness": None, "records": records})
    assert 0 < sum(e["reward"] for e in eps[0::2]) < 8          # slot 0 has something to learn
    fmt = ChatFormat(_tokenizer(sft))
    skip, keep = GRPOObjective(RLConfig(tasks=[str(task)])), GRPOObjective(RLConfig(tasks=[str(task)], beta=0.1))
    skip.fmt = keep.fmt = fmt
    (m_skip, st_skip), (m_keep, st_keep) = skip._micro_batches([dict(e) for e in eps]), keep._micro_batches(
        [dict(e) for e in eps])
    per_ep = len(episode_sequences(eps[0]["records"]))
    assert st_skip["groups_degenerate"] == st_keep["groups_degenerate"] == 1
    assert st_skip["sequences"] == 8 * per_ep and st_skip["sequences_zero_advantage"] == 8 * per_ep
    assert st_keep["sequences"] == 16 * per_ep and st_keep["sequences_zero_advantage"] == 0
    assert sum(x.shape[0] for x, *_ in m_skip) == 8 * per_ep and sum(x.shape[0] for x, *_ in m_keep) == 16 * per_ep
    model = _model(sft)

    def grad(micros):   # Σ over the micro-batches of the token-summed surrogate, by the formula
        model.zero_grad(set_to_none=True)
        total = 0.0
        for x, y, old, adv in micros:
            m = y != IGNORE_INDEX
            lp = torch.log_softmax(model(x).logits.float(), -1).gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            loss, st = clipped_policy_loss(lp, old, adv, m.float())
            (loss * st["tokens"]).backward()
            total += st["tokens"]
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), total
    g_skip, n_skip = grad(m_skip)
    g_keep, n_keep = grad(m_keep)
    assert n_keep == 2 * n_skip and float(g_skip.norm()) > 0
    assert torch.allclose(g_skip, g_keep, atol=1e-6, rtol=1e-4), float((g_skip - g_keep).abs().max())


def _harness_seeds(run, step):
    """slot -> the harness seeds recorded in the trajectory headers of a step's episodes."""
    out: dict[int, list] = {}
    for f in sorted((run / "rollouts" / f"step-{step:06d}").glob("*.jsonl")):
        head = read_trajectory(f)[0]
        out.setdefault(int(f.name.split("-")[0]), []).append(head["conditions"]["harness"]["seed"])
    return out


def test_canonical_groups_sample_on_the_canonical_harness(letters, learned, tmp_path, sandboxes):
    """--canonical 0.5 with two groups a step: the second group of every step runs on the
    canonical harness (seed None in its trajectories' headers, the record ``run_episode`` writes),
    the first on one randomized harness per episode; the step logs the pass rate of each kind.
    The control: the default run (``learned``) recorded a randomized harness for every episode."""
    d, sft, task = letters
    run = tmp_path / "run"
    assert rl_main(rl_argv(sft, task, run, "--canonical", "0.5", "--tasks-per-step", "2", "--ckpt-interval", "0",
                           steps=2, group=2)) == 0   # the later flag of a repeated one wins
    for step in (1, 2):
        seeds = _harness_seeds(run, step)
        assert seeds[1] == [None, None], seeds
        assert len(seeds[0]) == 2 and all(isinstance(s, int) for s in seeds[0]) and seeds[0][0] != seeds[0][1]
    for r in rl_records(run):
        assert r["pass_rate_canonical"] is not None and r["pass_rate_randomized"] is not None
    control = _harness_seeds(learned, 1)[0]
    assert len(control) == 8 and all(isinstance(s, int) for s in control)
    assert all(r["pass_rate_canonical"] is None for r in rl_records(learned))


def _tokenizer(run):
    from k3.data.tokenizer import Tokenizer
    return Tokenizer.load(run / "checkpoint" / "tokenizer.json")


def _model(run):
    from k3.checkpoint.training import load_model_weights
    from k3.config import K3Config
    from k3.model.decoder import K3ForCausalLM
    from k3.checkpoint.training import find_checkpoint, load_trainer_state

    ckpt = find_checkpoint(run)
    model = K3ForCausalLM(K3Config.from_dict(load_trainer_state(ckpt)["model_config"]))
    load_model_weights(model, ckpt / "model")
    return model.eval()


def test_masks_train_only_what_the_policy_wrote(letters):
    """Against the renderer's own spans: a two-turn episode with a tool call and its result. The
    tokens the learner trains are exactly the assistant bodies ``render_for_training`` marks, turn
    by turn; the tool result and user text are in prompts only."""
    tok = _tokenizer(letters[1])
    fmt = ChatFormat(tok)
    result = "exit code 0\nRESULT-TEXT 12345"
    msgs = [{"role": "user", "content": "Count the lines."},
            {"role": "assistant", "reasoning_content": "use wc", "content": "",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "shell", "arguments": json.dumps({"command": "wc -l f"})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": result},
            {"role": "assistant", "reasoning_content": "it said", "content": "12345 lines."}]
    ids, mask = fmt.render_for_training(msgs)
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assert len(spans) == 2
    records = []
    for i, (upto, body) in enumerate(((1, spans[0]), (3, spans[1]))):
        prompt = fmt.render(msgs[:upto])
        records.append({"type": "turn", "index": i, "metadata": {"sample": {
            "prompt_ids": prompt, "token_ids": body, "logprobs": [-1.0] * len(body), "forced": []}}})
    obj = GRPOObjective(RLConfig(tasks=["x"]))
    obj.fmt = fmt
    micros = obj._pack([(s, 1.0, 0) for s in episode_sequences(records)])
    trained = []
    for x, y, _, _ in micros:
        for row in y:
            trained.append([int(t) for t in row if t != IGNORE_INDEX])
    assert sorted(trained) == sorted(spans)
    text = " ".join(tok.decode(t) for t in trained)
    assert "RESULT-TEXT" not in text and "Count the lines" not in text and "12345 lines." in text
    assert "RESULT-TEXT" in tok.decode(records[1]["metadata"]["sample"]["prompt_ids"])   # control: it is there
    # a forced token (the thinking cap's </think>) is not trained
    records[0]["metadata"]["sample"]["forced"] = [0]
    seqs = episode_sequences(records)
    assert seqs[0]["train"][0] == 0 and sum(seqs[0]["train"]) == len(spans[0]) - 1


def test_resume_after_sigkill_mid_step_gives_the_same_weights_and_rewards(letters, tmp_path, sandboxes):
    d, sft, task = letters
    argv = rl_argv(sft, task, tmp_path / "straight", steps=3, group=4)
    assert rl_main(argv) == 0
    killed = tmp_path / "killed"
    step2 = killed / "rollouts" / "step-000002"
    proc = _start_rl_until(rl_argv(sft, task, killed, steps=3, group=4),   # step 1 saved, step 2 sampling
                           lambda: step2.is_dir() and any(step2.glob("*.jsonl")), "step 2")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert [r["step"] for r in rl_records(killed)] == [1]
    assert rl_main(["--resume", str(killed), "--threads", "1"]) == 0
    a, b = rl_records(tmp_path / "straight"), rl_records(killed)
    keys = ("step", "reward_mean", "pass_rate", "sampled_tokens", "loss")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    wa, wb = _model(tmp_path / "straight").state_dict(), _model(killed).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["lm_head.weight"], _model(sft).state_dict()["lm_head.weight"])  # it did train
    # SIGKILL can land while a sandbox is being made: the resumed run closes this run's sandboxes,
    # half-made (no state yet) ones included; `k3 env gc` stays the fallback for what it could not
    # close (the fixture then checks that nothing is left)
    sandboxes.manager.gc()


def test_sigterm_during_the_hack_replay_closes_its_sandboxes_and_exits_143(letters, tmp_path, sandboxes):
    """SIGTERM while the run replays its tasks' hack transcripts, before the first step (a
    sandbox of the replay is up): the run closes it and exits 143 with one line. Under the default
    action the process died with that sandbox left running, which ``k3 env gc`` does not close
    (its processes are alive). The control: the same run, not signalled, replays them all and
    trains its step."""
    d, sft, _ = letters
    mgr = sandboxes.manager
    argv = rl_argv(sft, "arith:0:40", tmp_path / "run", steps=1, group=2)
    proc = _start_rl_until(argv, lambda: bool(mgr.list()), "a sandbox of the hack replay")
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    err = err.decode().strip()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "k3 rl: interrupted (SIGTERM)" and "Traceback" not in err, err
    assert mgr.list() == [] and not list(mgr.unmade())
    assert rl_main(argv[:argv.index("--out") + 1] + [str(tmp_path / "ok")] + argv[argv.index("--out") + 2:]) == 0
    assert [r["step"] for r in rl_records(tmp_path / "ok")] == [1]
    assert [r["hacks"] for r in read_metrics(tmp_path / "ok") if r["kind"] == "hacks"][0] >= 40


def test_a_sandbox_an_earlier_start_left_that_cannot_be_closed_does_not_stop_the_run(letters, tmp_path, capsys,
                                                                                   sandboxes):
    """An earlier start of the run, killed, left a half-made sandbox whose cgroup cannot be removed
    yet (it holds a child cgroup: rmdir is EBUSY). The new start logs a line naming ``k3 env gc``
    and trains; control: once the cgroup can go, the next start (the resume) closes it."""
    from k3.env import Limits
    from k3.env.cgroups import Cgroup

    d, sft, task = letters
    run = tmp_path / "run"
    run.mkdir()
    obj = GRPOObjective(RLConfig(tasks=[str(task)]))
    obj.run_dir = run
    mgr = sandboxes.manager
    sid = mgr._new_id(f"{obj._owner()}-r0-0123456789ab")
    cg = Cgroup(mgr.cgroup_name(sid))
    cg.create(Limits())
    held = os.path.join(cg.dirs[0], "held")
    os.mkdir(held)
    try:
        assert rl_main(rl_argv(sft, task, run, steps=1, group=2)) == 0
        out = capsys.readouterr().out
        assert "could not close every sandbox an earlier, interrupted start of this run left" in out
        assert "`k3 env gc` removes them" in out and sid in out
        assert [r["step"] for r in rl_records(run)] == [1] and os.path.isdir(mgr.sandbox_dir(sid))
    finally:
        os.rmdir(held)
    assert rl_main(["--resume", str(run), "--steps", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "closed 1 sandboxes an earlier, interrupted start of this run left" in out
    assert not os.path.exists(mgr.sandbox_dir(sid)) and not any(os.path.isdir(x) for x in cg.dirs)
    assert [r["step"] for r in rl_records(run)] == [1, 2]


def test_a_forgeable_reward_refuses_the_run(letters, tmp_path, capsys, sandboxes):
    d, sft, _ = letters
    loose = make_letter_task(tmp_path / "tasks", "letter-loose", accept=("A", "B"))
    assert rl_main(rl_argv(sft, loose, tmp_path / "run", steps=1)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reply-b.json scored 1.0" in err and "forgeable" in err
    assert not list((tmp_path / "run").glob("checkpoint*"))


def test_every_starter_hack_scores_zero_under_the_rl_path(sandboxes):
    tasks = [load_task(t) for t in find_tasks(os.path.join(REPO, "tasks"))]
    hacks = replay_hacks(tasks, sandboxes)
    assert len(hacks) >= len(tasks) and all(score == 0.0 for _, _, score, _ in hacks), \
        [h for h in hacks if h[2] != 0.0]
    solved = replay_hacks(tasks, sandboxes, solutions=True)      # control: the path can pay
    assert [s for _, _, s, _ in solved] == [1.0] * len(tasks), [h for h in solved if h[2] != 1.0]


def test_lost_episodes_and_crashing_verifiers_are_counted_not_fatal(letters, tmp_path, monkeypatch, sandboxes):
    d, sft, task = letters
    crash = make_letter_task(tmp_path / "tasks", "letter-crash",
                             verify="import sys\nsys.exit(3)\n")
    from k3.rl import rollout
    orig = rollout.run_episode
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:   # the hack replay is call 1: the second episode of step 1 dies
            raise OSError("sandbox vanished")
        return orig(*a, **kw)

    monkeypatch.setattr(rollout, "run_episode", flaky)
    assert rl_main(rl_argv(sft, crash, tmp_path / "run", steps=2, group=3)) == 0
    recs = rl_records(tmp_path / "run")
    assert [r["lost"] for r in recs] == [1, 0] and [r["episodes"] for r in recs] == [3, 3]
    assert [r["verifier_failed"] for r in recs] == [2, 3] and [r["reward_mean"] for r in recs] == [0.0, 0.0]
    assert [r["groups_degenerate"] for r in recs] == [1, 1]


def test_every_episode_lost_for_three_steps_stops_the_run_and_two_do_not(letters, tmp_path, monkeypatch, capsys,
                                                                         sandboxes):
    """A rollout path that fails on every episode (a broken task setup, a broken worker) would only
    log empty steps: the run stops after three such steps in a row with one line naming the last
    failure (exit 1). The control: two such steps, then episodes that run: the run goes on (exit 0)."""
    d, sft, task = letters
    from k3.rl import rollout
    orig = rollout.run_episode
    calls = {"n": 0}

    def broken(until):
        def run(*a, **kw):
            calls["n"] += 1
            if 1 < calls["n"] <= until:    # the hack replay is call 1
                raise OSError(f"sandbox vanished (call {calls['n']})")
            return orig(*a, **kw)
        return run

    monkeypatch.setattr(rollout, "run_episode", broken(1 + 2 * 2))    # steps 1 and 2 lost, then fine
    assert rl_main(rl_argv(sft, task, tmp_path / "ok", steps=3, group=2)) == 0
    recs = rl_records(tmp_path / "ok")
    assert [r["lost"] for r in recs] == [2, 2, 0] and recs[2]["reward_mean"] is not None
    capsys.readouterr()
    calls["n"] = 0
    monkeypatch.setattr(rollout, "run_episode", broken(10 ** 6))
    assert rl_main(rl_argv(sft, task, tmp_path / "lost", steps=6, group=2)) == 1
    err = capsys.readouterr().err.strip()    # the trainer's progress lines, then the error's one line
    last = err.splitlines()[-1]
    assert last.startswith("k3 rl: every episode of 3 steps in a row was lost (steps 1-3") and "Traceback" not in err
    assert "sandbox vanished (call 7)" in last, err
    assert calls["n"] == 7    # the replay and 3 steps of 2: no fourth step was sampled


@pytest.mark.parametrize("extra, message", [
    (["--group", "1"], "--group must be an int >= 2"),
    (["--tasks", "nope:0:4"], "nope"),
    (["--tasks", "files:999990:1000002"], "held out"),
    (["--tasks", "files:3"], "not a path, nor FAMILY:A:B"),
    (["--tasks", "files:5:5"], "empty"),
    (["--backend", "local"], "does not isolate"),
    (["--nproc", "0"], "--nproc must be > 0"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--canonical", "1.5"], "--canonical must be a fraction in [0, 1]"),
    (["--canonical", "0.5", "--no-randomize"], "--canonical has no effect with --no-randomize"),
])
def test_bad_input_is_one_line(letters, tmp_path, capsys, extra, message):
    d, sft, task = letters
    argv = rl_argv(sft, task, tmp_path / "run", steps=1)
    if extra[0] == "--tasks":
        i = argv.index("--tasks")
        argv[i + 1] = extra[1]
        extra = []
    assert rl_main(argv + extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_resume_refusals_are_one_line(letters, learned, tmp_path, capsys):
    d, sft, task = letters
    assert rl_main(["--resume", str(learned), "--group", "4"]) == 2
    assert "only trainer flags" in capsys.readouterr().err
    assert rl_main(["--resume", str(learned), "--seed", "3"]) == 2
    assert "got seed" in capsys.readouterr().err
    assert rl_main(["--resume", str(sft)]) == 2          # an SFT run is not an RL run
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not of an RL run" in err, err
    old = tmp_path / "old-tok"
    _, model, _ = _old_tokenizer_checkpoint(old)
    assert rl_main(rl_argv(old, task, tmp_path / "run", steps=1)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "chat tokens" in err, err


def _old_tokenizer_checkpoint(d):
    from k3.checkpoint import save_pretrained
    from k3.config import get_preset
    from k3.data.tokenizer import train_tokenizer
    from k3.model.decoder import K3ForCausalLM

    model = K3ForCausalLM(get_preset("nano"))
    save_pretrained(model, d)
    old = ["<|endoftext|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
           "<|im_end|>", "<think>", "</think>"]
    tok = train_tokenizer([TEXT * 30], 300, old)
    tok.save(d)
    return d, model, tok


def test_a_stop_signal_while_sampling_drops_the_step_and_resumes(letters, tmp_path, monkeypatch, sandboxes):
    d, sft, task = letters
    from k3.rl import rollout
    orig, seen, box = rollout.run_episode, [], {}

    def stop_on_second(*a, **kw):
        seen.append(1)
        if len(seen) == 3:   # call 1 is the hack replay; the signal lands in step 1's second episode
            box["trainer"].stop_signal = signal.SIGINT
        return orig(*a, **kw)

    monkeypatch.setattr(rollout, "run_episode", stop_on_second)
    run = tmp_path / "run"
    rc = rl_main(rl_argv(sft, task, run, steps=2, group=4), trainer_hook=lambda t: box.update(trainer=t))
    assert rc == 128 + signal.SIGINT and len(seen) == 3          # no episode after the signal
    assert rl_records(run) == []                                 # the step was dropped, not trained
    monkeypatch.setattr(rollout, "run_episode", orig)
    assert rl_main(["--resume", str(run), "--threads", "1"]) == 0
    assert [r["step"] for r in rl_records(run)] == [1, 2] and rl_records(run)[0]["episodes"] == 4


def test_episodes_in_worker_processes_are_the_ones_sampled_in_process(letters, tmp_path, sandboxes):
    """--workers 2: each episode runs in a worker process from the step's saved weights, alone in
    its engine; the step's rollouts (tokens, logprobs, rewards) equal those sampled in process."""
    d, sft, task = letters
    runs = {}
    for w in (1, 2):   # two steps: the workers, kept from step 1, must sample step 2 with its new weights
        runs[w] = tmp_path / f"w{w}"
        assert rl_main(rl_argv(sft, task, runs[w], "--workers", str(w), steps=2, group=4)) == 0

    def samples(run, step=1):
        out = []
        for f in sorted((run / "rollouts" / f"step-{step:06d}").glob("*.jsonl")):
            recs = read_trajectory(f)
            out.append(([r["metadata"]["sample"] for r in recs if r["type"] == "turn"],
                        next(r["score"] for r in recs if r["type"] == "end")))
        return out

    for step in (1, 2):
        a, b = samples(runs[1], step), samples(runs[2], step)
        assert len(a) == 4 and a == b, step
        ra, rb = rl_records(runs[1])[step - 1], rl_records(runs[2])[step - 1]
        assert (ra["reward_mean"], ra["loss"], ra["lost"]) == (rb["reward_mean"], rb["loss"], rb["lost"])
        assert rb["lost"] == 0 and rb["sampler_max_abs_diff"] <= 1e-4
    # control: step 2's weights differ from step 1's, so a worker that kept step 1's engine would
    # have recorded other logprobs for the same tokens
    first = next(r for r in read_metrics(runs[1]) if r["kind"] == "train")
    assert "no_update" not in first and first["grad_norm"] > 0


def _start_rl_until(argv, ready, what: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """``k3 rl argv`` in a session of its own, once ``ready()`` holds (polled for at most 240 s;
    a run that exits or takes longer fails the test and is killed)."""
    cmd = [sys.executable, "-m", "k3", "rl", *argv]
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while not ready():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"the run did not reach {what}"
            time.sleep(0.02)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        raise
    return proc


def _group_members(pgid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.getpgid(int(p)) == pgid:
                    out.append(int(p))
            except ProcessLookupError:
                pass
    return out


def test_ctrl_c_stops_a_run_with_kept_workers_and_leaves_no_process(letters, tmp_path, sandboxes):
    """Ctrl-C (SIGINT to the terminal's process group) reaches the kept rollout workers too: the
    run still ends with 130, its saved steps intact, and no worker or sandbox outlives it (the
    ``sandboxes`` fixture checks the latter). The control is the same run's worker processes alive
    between steps before the signal."""
    d, sft, task = letters
    run = tmp_path / "run"
    proc = _start_rl_until(rl_argv(sft, task, run, "--workers", "2", steps=40, group=4),   # steps 1 and 2 trained
                           lambda: (run / "rollouts" / "step-000003").is_dir(), "step 3")
    try:
        assert len(_group_members(proc.pid)) >= 3            # the run and its two workers
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 128 + signal.SIGINT, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_members(proc.pid) == []
    assert [r["step"] for r in rl_records(run)][:2] == [1, 2]


def _spawned_workers(pid: int) -> list[int]:
    """The multiprocessing worker processes (spawn) among ``pid``'s children."""
    out = []
    for c in open(f"/proc/{pid}/task/{pid}/children").read().split():
        try:
            cmd = open(f"/proc/{c}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(int(c))
    return out


def test_a_rollout_worker_killed_mid_run_counts_its_episodes_lost_and_the_run_goes_on(letters, tmp_path,
                                                                                      sandboxes):
    """A kept worker process killed (SIGKILL) while the run samples: the episodes its pool had not
    returned are counted lost in that step's record, never silently dropped, and the next step
    starts fresh workers whose episodes are all kept (the control: lost 0 after, and before); the
    sandbox the killed worker was using is closed by the run, or left to ``k3 env gc`` with a
    line saying so (the ``sandboxes`` fixture checks that nothing remains)."""
    d, sft, task = letters
    run = tmp_path / "run"
    with open(tmp_path / "stdout.txt", "w") as out:
        proc = _start_rl_until(rl_argv(sft, task, run, "--workers", "2", steps=5, group=4),
                               lambda: (run / "rollouts" / "step-000002").is_dir(), "step 2", stdout=out)
        try:
            workers = _spawned_workers(proc.pid)
            assert workers, "no rollout worker process to kill"
            os.kill(workers[0], signal.SIGKILL)
            assert proc.wait(timeout=240) == 0, proc.stderr.read().decode()[-2000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
    recs = rl_records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    lost = [r["lost"] for r in recs]
    hit = next(i for i, n in enumerate(lost) if n > 0)        # the step the kill reached (2 or 3)
    assert lost[0] == 0 and hit in (1, 2) and lost[hit] <= 4 and all(n == 0 for n in lost[hit + 1:]), lost
    assert recs[hit]["episodes"] == 4                         # lost ones are in the count, not dropped
    # the run closes the sandboxes of its killed worker; one whose cgroup was still busy is left
    # to `k3 env gc` (the run says so), after which nothing may remain (the fixture checks)
    if "k3 env gc" in (tmp_path / "stdout.txt").read_text() + proc.stderr.read().decode():
        print("the run left a sandbox to k3 env gc")
        sandboxes.manager.gc()


def test_a_worker_keeps_one_engine_per_weights_version(letters):
    """job_provider: the jobs of one step (one version) share the engine a worker loaded; a new
    version (the next step's weights) loads the checkpoint again and closes the old engine; a
    spec without a version is the job's own, as before."""
    from k3.rl import rollout
    sft = letters[1]
    opened = []
    try:
        a, owned_a = rollout.job_provider({"kind": "local", "ckpt": str(sft), "version": "run-1"})
        b, owned_b = rollout.job_provider({"kind": "local", "ckpt": str(sft), "version": "run-1"})
        opened.append(a)
        assert a is b and not owned_a and not owned_b
        c, _ = rollout.job_provider({"kind": "local", "ckpt": str(sft), "version": "run-2"})
        opened.append(c)
        assert c is not a and not a.engine._thread.is_alive() and c.engine._thread.is_alive()
        d, owned_d = rollout.job_provider({"kind": "local", "ckpt": str(sft)})
        opened.append(d)
        assert d is not c and owned_d
    finally:
        for p in opened:
            p.close()
        rollout._KEPT.clear()


def test_the_kl_penalty_is_to_the_starting_weights_kept_in_the_run(letters, tmp_path, sandboxes):
    """--beta: the reference is the weights the run starts from, saved in OUT/reference: the KL to
    it is 0 at step 1 (the policy is still the reference) and > 0 once the policy moved; a resume
    reads it from the run dir."""
    d, sft, task = letters
    run = tmp_path / "kl"
    assert rl_main(rl_argv(sft, task, run, "--beta", "0.5", steps=2, group=4)) == 0
    kl = [r["kl_ref"] for r in rl_records(run)]
    assert abs(kl[0]) < 1e-6 and kl[1] > 1e-6, kl
    ref = run / "reference" / "model"
    assert ref.is_dir()
    assert rl_main(["--resume", str(run), "--steps", "3", "--threads", "1"]) == 0
    assert [r["step"] for r in rl_records(run)] == [1, 2, 3] and rl_records(run)[2]["kl_ref"] > 1e-6
    # control: without --beta no reference is kept and no KL is reported
    assert rl_main(rl_argv(sft, task, tmp_path / "nokl", steps=1, group=4)) == 0
    assert not (tmp_path / "nokl" / "reference").exists() and rl_records(tmp_path / "nokl")[0]["kl_ref"] is None


def test_the_learner_under_torchrun_takes_the_one_process_step(letters, tmp_path, sandboxes):
    """--nproc 2: each process samples half of the step's episodes and trains half of its
    micro-batches (the distributed Trainer, FSDP2); the episodes (tokens, logprobs, rewards), the step's loss
    and the updated weights are the one-process run's (float rounding aside). Control: the same
    comparison against a run at another lr finds the weights apart."""
    from k3.checkpoint.dcp import read_dcp

    d, sft, task = letters
    one, two, other = tmp_path / "one", tmp_path / "two", tmp_path / "other"
    # sign balancing: the distributed Trainer's quantile balancing histograms the margins (1024 bins), a
    # different (documented) approximation of the one-process exact quantiles
    same = ("--balance", "sign", "--ns-dtype", "fp32")
    assert rl_main(rl_argv(sft, task, one, *same, steps=1, group=4)) == 0
    assert rl_main(rl_argv(sft, task, two, *same, "--nproc", "2", steps=1, group=4)) == 0
    assert rl_main(rl_argv(sft, task, other, *same, steps=1, group=4, lr="3e-4")) == 0

    def samples(run):
        out = {}
        for f in sorted((run / "rollouts" / "step-000001").glob("*.jsonl")):
            recs = read_trajectory(f)
            out[f.name] = ([r["metadata"]["sample"] for r in recs if r["type"] == "turn"],
                           next(r["score"] for r in recs if r["type"] == "end"))
        return out

    a, b = samples(one), samples(two)
    assert len(a) == 4 and a == b
    ra, rb = rl_records(one)[0], rl_records(two)[0]
    for k in ("reward_mean", "episodes", "sampled_tokens", "trained_tokens", "sequences"):
        assert ra[k] == rb[k], k
    assert 0 < ra["reward_mean"] < 1                     # a group with something to learn
    assert abs(ra["loss"] - rb["loss"]) <= 1e-5 * max(1.0, abs(ra["loss"])), (ra["loss"], rb["loss"])
    assert abs(ra["entropy"] - rb["entropy"]) <= 1e-4 and rb["sampler_max_abs_diff"] <= 1e-4
    wa, wo = _model(one).state_dict(), _model(other).state_dict()
    wb = read_dcp(two / "checkpoint")["model"]
    start = _model(sft).state_dict()
    assert set(wa) == set(wb)
    moved = max(float((wa[k] - start[k]).abs().max()) for k in wa)
    apart = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    control = max(float((wa[k] - wo[k]).abs().max()) for k in wa)
    print(f"update {moved:.2e}; one vs two processes {apart:.2e}; one vs another lr {control:.2e}")
    assert moved > 1e-4 and apart <= 1e-5 and control > 1e-4
    # the sharded checkpoint resumes under torchrun (its options from the checkpoint)
    assert rl_main(["--resume", str(two), "--steps", "2", "--threads", "1", "--nproc", "2"]) == 0
    assert [r["step"] for r in rl_records(two)] == [1, 2] and rl_records(two)[1]["episodes"] == 4
