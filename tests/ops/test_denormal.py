"""Flush-to-zero of fp32 denormals is an entry point's choice (CLI, trainer), not an import effect."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import torch
def flushes():
    x = torch.tensor([1e-39], dtype=torch.float32)     # a denormal (below 1.18e-38)
    return (x * 1.0).item() == 0.0
before = flushes()
{body}
print(before, flushes())
"""


def _run(body: str) -> tuple[bool, bool]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(body=body)], capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    return out[-2] == "True", out[-1] == "True"


def test_importing_k3_leaves_denormals_alone():
    body = ("import k3, k3.ops.kda, k3.model.decoder, k3.model.kda, k3.train.loop, k3.train.optim, "
            "k3.cli")
    assert _run(body) == (False, False)


def test_cli_entry_point_and_control_flush_denormals():
    # Positive controls: the probe sees flushing when it is on (set directly, or by `k3 params`).
    assert _run("torch.set_flush_denormal(True)") == (False, True)
    body = "import contextlib, io\nfrom k3.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n    main(['params', '--preset', 'nano'])"
    assert _run(body) == (False, True)
