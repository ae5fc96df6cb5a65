"""The logprobs a rollout records are the ones a trainer recomputes (SPEC §10, the ground of RL's
importance ratios): an episode sampled at temperature 1 through the engine (prefill, cached decode
steps) and the harness, then the plain model forward over each turn's prompt + sampled tokens."""

import torch

from k3.agent.providers import LocalEngine
from k3.infer.engine import Engine
from k3.rl.rollout import run_episode
from k3.rl.trajectory import TrajectoryWriter, read_trajectory
from k3.tasks.families import get_family

TEXT = "Write the answer. What is 12 + 30? The answer is 42. grep -c ERROR data.txt\n"


def recomputed(model, prompt, out):
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(out) - 1)
    return lp[pos, torch.tensor(out)]


def test_recorded_logprobs_equal_the_forward_of_the_same_weights(tmp_path, make_nano_checkpoint, sandboxes):
    ckpt, model, _ = make_nano_checkpoint(tmp_path / "nano", TEXT)
    task = get_family("files").generate(1_000_003, tmp_path / "tasks")
    w = TrajectoryWriter(tmp_path / "t.jsonl")
    provider = LocalEngine(Engine(ckpt))
    try:
        run_episode(task, provider, w, temperature=1.0, seed=5, max_tokens=48, effort="high", sandboxes=sandboxes)
    finally:
        w.close()
        provider.close()
    turns = [r for r in read_trajectory(tmp_path / "t.jsonl") if r["type"] == "turn"]
    assert turns and all("sample" in t["metadata"] for t in turns)
    worst, n = 0.0, 0
    for t in turns:
        s = t["metadata"]["sample"]
        assert len(s["token_ids"]) == len(s["logprobs"]) == t["metadata"]["usage"]["completion_tokens"] > 0
        want = recomputed(model, s["prompt_ids"], s["token_ids"])
        worst = max(worst, (want - torch.tensor(s["logprobs"])).abs().max().item())
        n += len(s["token_ids"])
    print(f"{n} sampled tokens over {len(turns)} turns: max |recorded - recomputed| = {worst:.2e}")
    assert n >= 40 and worst <= 1e-4, worst
    # control: other weights give other logprobs for the same tokens
    other = make_nano_checkpoint(tmp_path / "other", TEXT + " ")[1]
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    s = turns[0]["metadata"]["sample"]
    assert (recomputed(other, s["prompt_ids"], s["token_ids"]) - torch.tensor(s["logprobs"])).abs().max() > 1e-3
