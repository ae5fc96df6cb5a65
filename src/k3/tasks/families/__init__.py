"""Procedurally generated task families (SPEC §7.2): seed -> task directory, with a scripted solver
per reasoning effort, for SFT data a tiny model can learn from (short goals, few tools, small files).

``FAMILIES``: name -> family object (``k3.tasks.families.base.Family``):

- ``arith`` (domain general, no tools; the reply is the answer): add or subtract 2-3 digit numbers;
- ``files`` (domain general_agent; shell, write, submit): count / find / extract in small files;
- ``code`` (domain coding_agent; write, shell, submit): implement a small function in solution.py.

``VISION_FAMILIES``: the families whose tool results carry images, so that only a model with a
vision tower can run them (a text-only ``ChatFormat`` refuses their conversations); kept out of
``FAMILIES``, which the text demos and their tests run whole, and found by ``get_family`` like the rest:

- ``page`` (domain coding_agent; write, screenshot, shell, submit; the ``browser`` image): write
  index.html with a coloured header and a round button, look at it, submit; pixels are verified.

``chainN`` (``k3.tasks.families.chain.Chain(N)``, the ``k3 eval sustain`` workload of N dependent
steps) is found by ``get_family`` too, for SFT data of short chains; it is in neither dict.

``CELL_PATTERN`` / ``cell_order`` / ``cell_task_list``: a task order for runs whose efforts cycle
per group (``k3 rl`` and ``k3 distill`` with ``--effort all``), so that each block of nine tasks
meets all nine (family, effort) cells instead of pairing each family with one effort.

``family.generate(seed, out_dir)`` writes ``out_dir/<family>-<seed>/`` deterministically;
``family.solve(task_dir_or_spec, effort)`` gives the scripted solver's transcript turns. Seeds
below ``HELDOUT_START`` are training seeds, the rest held out (``split_of``).
"""

from __future__ import annotations

import difflib

from k3.errors import ConfigError
from k3.tasks.families.arith import Arith
from k3.tasks.families.chain import Chain
from k3.tasks.families.base import (DOMAINS, EFFORTS, HELDOUT_START, META_FILE, SPLITS, Family, check_seed,
                                    read_meta, split_of)
from k3.tasks.families.code import Code
from k3.tasks.families.files import Files
from k3.tasks.families.page import Page

__all__ = ["FAMILIES", "VISION_FAMILIES", "get_family",
           "Family", "HELDOUT_START", "SPLITS", "DOMAINS", "EFFORTS", "META_FILE",
           "split_of", "check_seed", "read_meta", "CELL_PATTERN", "cell_pattern", "cell_order", "cell_task_list",
           "family_counts"]

FAMILIES: dict[str, Family] = {f.name: f for f in (Arith(), Files(), Code())}
VISION_FAMILIES: dict[str, Family] = {f.name: f for f in (Page(),)}


def get_family(name: str) -> Family:
    """The family called ``name`` (of ``FAMILIES`` or ``VISION_FAMILIES``, or ``chainN``: the
    sustain workload ``Chain(N)``); an unknown name is refused with the closest known one."""
    known = {**FAMILIES, **VISION_FAMILIES}
    if name in known:
        return known[name]
    if isinstance(name, str) and name.startswith("chain") and name[5:].isdigit() and name[5:] == str(int(name[5:])):
        return Chain(int(name[5:]))  # its steps are checked there (1..999)
    close = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown task family {name!r} (known: {', '.join(known)}, chainN for N in 1..999){hint}")


def cell_pattern(families) -> tuple[str, ...]:
    """The 9-position task pattern of ``families`` (a subset of ``FAMILIES``, in that order):
    position p = 3·b + r runs at effort EFFORTS[r] and holds family ``families[(b + r) % k]``, a
    Latin square, so that for 1 or 3 families every (family, effort) cell sits in it equally often,
    and for 2 every cell at least once. Unknown or repeated families are refused."""
    fams = list(families)
    bad = [f for f in fams if f not in FAMILIES]
    if bad or not fams or len(set(fams)) != len(fams):
        raise ConfigError(f"families must be distinct names of {', '.join(FAMILIES)}, got {', '.join(fams) or 'none'}")
    fams = [f for f in FAMILIES if f in fams]
    return tuple(fams[(p // 3 + p % 3) % len(fams)] for p in range(9))


# Position p of the pattern runs at effort EFFORTS[p % 3]; each family sits once at each residue.
CELL_PATTERN = cell_pattern(FAMILIES)


def cell_order(pattern=CELL_PATTERN) -> list[tuple[str, str]]:
    """(family, effort) of each position of ``pattern`` (effort = EFFORTS[p % 3])."""
    return [(f, EFFORTS[p % len(EFFORTS)]) for p, f in enumerate(pattern)]


def cell_task_list(made: dict[str, list], blocks: int, pattern=CELL_PATTERN) -> list[tuple[str, object]]:
    """(family, task) of ``blocks`` repetitions of ``pattern``, each family's tasks (``made[family]``)
    taken in order; a family with too few tasks is refused, naming it."""
    need = {f: blocks * pattern.count(f) for f in set(pattern)}
    short = sorted(f for f, n in need.items() if len(made.get(f, ())) < n)
    if short:
        raise ConfigError(", ".join(f"{f}: {len(made.get(f, ()))} tasks, {need[f]} needed" for f in short)
                          + f" ({blocks} blocks of the cell pattern)")
    nxt = {f: 0 for f in need}
    out = []
    for _ in range(blocks):
        for f in pattern:
            out.append((f, made[f][nxt[f]]))
            nxt[f] += 1
    return out


def family_counts(spec: str, minimum: int) -> dict[str, int]:
    """``FAMILY:N,...`` -> {family: N} for exactly the families of ``FAMILIES``, each N >= ``minimum``;
    anything else is refused with one line naming what is expected."""
    try:
        counts = {f: int(n) for f, n in (x.split(":") for x in spec.split(","))}
    except ValueError:
        counts = {}
    if sorted(counts) != sorted(FAMILIES) or min(counts.values()) < minimum:
        raise ConfigError(f"--seeds must give each of {', '.join(FAMILIES)} at least {minimum} "
                          f"seed{'s' * (minimum != 1)} (FAMILY:N,...), got {spec}")
    return counts
