"""benchmarks/rl_demo.py refuses a bad ``--only`` / ``--efforts`` in one line (exit 2) before the
minutes-long "before" evaluation; the control: valid values pass that check and stop at the next
one (no SFT checkpoint in the given folder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rl_demo.py"), "--sft", str(tmp_path / "none"),
                        "--out", str(tmp_path / "out"), *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stderr.strip()


@pytest.mark.parametrize("args,message", [
    (("--only", "arith"), "--only must be FAMILY:N"),
    (("--only", "nope:3"), "--only must be FAMILY:N"),
    (("--only", "arith:0"), "--only must be FAMILY:N"),
    (("--efforts", "high,hi"), "--efforts must be all or a comma list"),
    (("--efforts", "high,high"), "--efforts must be all or a comma list"),
])
def test_bad_focus_options_are_one_line(tmp_path, args, message):
    rc, err = _run(tmp_path, *args)
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err


def test_valid_focus_options_pass_to_the_checkpoint_check(tmp_path):
    rc, err = _run(tmp_path, "--only", "arith:3", "--efforts", "high,max")
    assert rc == 2 and len(err.splitlines()) == 1 and "holds no checkpoint" in err, err
    assert not (tmp_path / "out").exists()
