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
           "split_of", "check_seed", "read_meta"]

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
