"""The ``chain`` workload (``k3 eval sustain``): one long episode of many small dependent steps.

``steps/step_001.txt`` … ``steps/step_NNN.txt`` each say: take the previous step's result (step 0
is a given start value), add a small number, write the new result to ``results/step_NNN.txt``.
The goal asks for all of them in order, then one ``submit``. Every step depends on the one
before, so the work must be carried across the whole episode (in the context, or read back from
the agent's own result files once old tool outputs are compacted away): about 2·N tool calls.

Tools: ``read``, ``write``, ``list``, ``submit`` — no shell and no edit, so every change to the
workspace is a recorded ``write`` and the suite measures progress exactly from the trajectory
after each call. The hidden verifier gives a partial
reward: the share of the N result files holding the right number. The scripted solver reads and
writes each step (one call per turn, its arithmetic in the reasoning) and submits; the hacks
(zeros everywhere; the start value everywhere) score 0.

Not in ``FAMILIES`` (the SFT / RL families the demos run whole): the suite builds ``Chain(steps)``,
and ``get_family("chainN")`` gives ``Chain(N)`` (e.g. ``k3 synth chain8:0:300`` for SFT on short chains).
"""

from __future__ import annotations

import json
import random

from k3.errors import ConfigError
from k3.tasks.families.base import Family, TaskFiles

__all__ = ["Chain", "chain_values", "step_file", "result_file"]


def step_file(k: int) -> str:
    return f"steps/step_{k:03d}.txt"


def result_file(k: int) -> str:
    return f"results/step_{k:03d}.txt"


def chain_values(spec: dict) -> list[int]:
    """The right result of every step 1..N (the start value, then running sums of the adds)."""
    v, out = spec["start"], []
    for d in spec["adds"]:
        v += d
        out.append(v)
    return out


class Chain(Family):
    name = "chain"
    domain = "general_agent"
    about = "N dependent steps, each read, computed from the previous result and written; one long episode"
    solution_effort = "low"

    def __init__(self, steps: int = 100):
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 999:
            raise ConfigError(f"chain steps must be an int in 1..999, got {steps!r}")
        self.steps = steps
        self.name = f"chain{steps}"

    def build(self, seed: int, rng: random.Random) -> TaskFiles:
        n = self.steps
        spec = {"steps": n, "start": rng.randint(10, 99), "adds": [rng.randint(1, 9) for _ in range(n)]}
        workspace = {step_file(k): (f"Step {k} of {n}. Take the result of step {k - 1}"
                                    + (f" (step 0 is {spec['start']})" if k == 1 else "")
                                    + f", add {d}, and write the new result to {result_file(k)}.\n")
                     for k, d in enumerate(spec["adds"], 1)}
        goal = (f"Work through {step_file(1)} to {step_file(n)} in order. Each file says how to get its "
                f"result from the previous one; write each result (just the number) to its results file. "
                "Submit once at the end.")
        hacks = {"zeros": ("writes 0 for every step without reading", _write_all([0] * n)),
                 "start-everywhere": ("writes the start value for every step", _write_all([spec["start"]] * n))}
        return TaskFiles(kind="data", goal=goal, submit=["results/*.txt"], tools=["read", "write", "list", "submit"],
                         spec=spec, workspace=workspace, verifier=_verifier(spec), hacks=hacks,
                         budget={"steps": 2 * n + 10, "tokens": 10 ** 9, "wall_seconds": 120 + 10 * n,
                                 "submissions": 1})

    def turns(self, spec: dict, effort: str) -> list[dict]:
        values, prev, out = chain_values(spec), spec["start"], []
        for k, (d, v) in enumerate(zip(spec["adds"], values), 1):
            out.append({"reasoning": "", "content": "",
                        "tool_calls": [{"name": "read", "arguments": {"path": step_file(k)}}]})
            out.append({"reasoning": f"Step {k}: {prev} + {d} = {v}.", "content": "",
                        "tool_calls": [{"name": "write", "arguments": {"path": result_file(k), "content": f"{v}\n"}}]})
            prev = v
        out.append({"reasoning": "", "content": "", "tool_calls": [{"name": "submit", "arguments": {}}]})
        out.append({"reasoning": "", "content": f"All {len(values)} steps are written and submitted."})
        return out

    def expected_outputs(self, spec: dict, effort: str) -> list[str | None]:
        return [None] * (2 * spec["steps"] + 1)


def _write_all(values: list[int]) -> list[dict]:
    calls = [{"name": "write", "arguments": {"path": result_file(k), "content": f"{v}\n"}}
             for k, v in enumerate(values, 1)]
    return [{"reasoning": "", "tool_calls": calls + [{"name": "submit", "arguments": {}}]}]


def _verifier(spec: dict) -> str:
    values = chain_values(spec)
    return f'''"""Hidden verifier: the share of results/step_NNN.txt holding the right number."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

VALUES = {json.dumps(values)}


def check(ctx):
    right = 0
    for k, v in enumerate(VALUES, 1):
        try:
            got = vharness.read_text(ctx.workspace, "results/step_%03d.txt" % k).strip()
        except vharness.Fail:
            continue
        right += got == str(v)
    return right / len(VALUES), "%d of %d steps right" % (right, len(VALUES))


if __name__ == "__main__":
    vharness.main(check, __file__)
'''
