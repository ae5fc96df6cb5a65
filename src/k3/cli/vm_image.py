"""``python -m k3.cli.vm_image install``: fetch the VM backend's parts from Debian's registry (a
kernel, busybox, QEMU's firmware: ``k3.env.vm_image.install``) and probe KVM once (``make
install`` runs it)."""

from __future__ import annotations

import json
import sys

from k3.env.backends.vm import choose_accel
from k3.env.vm_image import install


def main(argv: list[str]) -> int:
    if argv != ["install"]:
        print("usage: python -m k3.cli.vm_image install", file=sys.stderr)
        return 2
    print(json.dumps(install(), indent=1))
    print("accelerator:", choose_accel())   # the KVM probe, cached for the test runs
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
