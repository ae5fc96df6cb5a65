"""``python -m k3`` (what ``torchrun -m k3 train ...`` runs): the ``k3`` command."""

import sys

from k3.cli import main

if __name__ == "__main__":
    sys.exit(main())
