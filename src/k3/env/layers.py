"""Materialize overlay-format layers into a plain directory (for backends without overlayfs).

Applying layers bottom to top reproduces what overlayfs shows: a 0:0 character device is a
whiteout (the name is deleted), a directory with ``trusted.overlay.opaque = y`` hides everything
below it, everything else replaces what lower layers had. Files are copied, not linked: the
target directory is writable and must never write through to the store.
"""

from __future__ import annotations

import os
import shutil
import stat

__all__ = ["apply_layer", "materialize"]


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def apply_layer(layer: str, dst: str) -> None:
    for name in os.listdir(layer):
        s, d = os.path.join(layer, name), os.path.join(dst, name)
        st = os.lstat(s)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            _remove(d)
        elif stat.S_ISDIR(st.st_mode):
            opaque = False
            try:
                opaque = os.getxattr(s, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
            except OSError:
                pass
            if opaque or (os.path.lexists(d) and not os.path.isdir(d)) or os.path.islink(d):
                _remove(d)
            os.makedirs(d, exist_ok=True)
            apply_layer(s, d)
            os.chmod(d, stat.S_IMODE(st.st_mode))
        else:
            _remove(d)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISREG(st.st_mode):
                shutil.copy2(s, d)


def materialize(layer_dirs: list[str], dst: str) -> None:
    """Apply ``layer_dirs`` (bottom -> top) onto ``dst``."""
    os.makedirs(dst, exist_ok=True)
    for d in layer_dirs:
        apply_layer(d, dst)
