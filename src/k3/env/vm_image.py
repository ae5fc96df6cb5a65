"""Guest parts of the ``vm`` backend: a Debian kernel and a busybox initramfs.

Recipe (``make vm-deps`` runs :func:`install`; nothing is downloaded at run time):

* ``apt-get download`` of the package ``linux-image-amd64`` depends on (``linux-image-<ver>-amd64``)
  and of ``busybox-static``; ``dpkg-deb -x`` unpacks both into a scratch directory;
* the cache (``$K3_VM_CACHE``, default ``~/.cache/k3/vm``) keeps ``vmlinux`` (the ELF kernel, taken
  out of the bzImage's xz payload: QEMU boots it through its PVH entry, which spares TCG the
  in-guest decompression, about two thirds of the boot), the four modules the
  virtio console needs (``virtio_ring virtio virtio_mmio virtio_console``, built as modules in
  Debian's kernel) and ``busybox``, plus ``recipe.json`` naming the package versions;
* :func:`build_initramfs` writes an uncompressed ``newc`` cpio: ``/init`` (``k3.env.guest.INIT``),
  ``/bin/busybox``, ``/lib/modules/*.ko`` and ``/dev/console``. The guest runs from that RAM
  filesystem only (no disk), so a migration stream holds the whole machine.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from k3.env.guest import INIT
from k3.env.sandbox import SandboxError

MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console")
MAKE_HINT = "run `make vm-deps` (installs qemu-system-x86 and fetches the guest kernel and busybox)"


def cache_dir() -> Path:
    """Where the guest parts live: ``$K3_VM_CACHE`` or ``~/.cache/k3/vm``."""
    env = os.environ.get("K3_VM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "k3" / "vm"


def qemu_binary() -> str:
    exe = shutil.which("qemu-system-x86_64")
    if exe is None:
        raise SandboxError(f"vm backend: qemu-system-x86_64 not found on PATH; {MAKE_HINT}")
    return exe


def parts(root: Path | None = None) -> dict[str, Path]:
    """Paths of the guest parts; ``SandboxError`` naming the make target when one is missing."""
    root = root or cache_dir()
    need = {"kernel": root / "vmlinux", "busybox": root / "busybox"}
    need.update({m: root / "modules" / f"{m}.ko" for m in MODULES})
    missing = [str(p) for p in need.values() if not p.is_file()]
    if missing:
        raise SandboxError(f"vm backend: guest parts missing ({', '.join(missing)}); {MAKE_HINT}")
    return need


def _cpio_entry(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0),
                ino: int = 0) -> bytes:
    """One ``newc`` record: 110-byte ASCII header, name (NUL, padded to 4), data (padded to 4)."""
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0]
    head = b"070701" + b"".join(b"%08X" % f for f in fields)
    rec = head + name.encode() + b"\0"
    rec += b"\0" * (-len(rec) % 4)
    return rec + data + b"\0" * (-len(data) % 4)


def initramfs_bytes(p: dict[str, Path]) -> bytes:
    """The whole initramfs as bytes (a few MB: busybox + four modules + the init script)."""
    out, ino = [], 1
    dirs = ["bin", "dev", "lib", "lib/modules", "proc", "sys", "tmp", "run", "root", "workspace"]
    for d in dirs:
        out.append(_cpio_entry(d, 0o040755, ino=ino)); ino += 1
    out.append(_cpio_entry("dev/console", 0o020600, rdev=(5, 1), ino=ino)); ino += 1
    out.append(_cpio_entry("init", 0o100755, INIT.encode(), ino=ino)); ino += 1
    out.append(_cpio_entry("bin/busybox", 0o100755, p["busybox"].read_bytes(), ino=ino)); ino += 1
    for m in MODULES:
        out.append(_cpio_entry(f"lib/modules/{m}.ko", 0o100644, p[m].read_bytes(), ino=ino)); ino += 1
    out.append(_cpio_entry("TRAILER!!!", 0))
    return b"".join(out)


def build_initramfs(root: Path | None = None) -> tuple[Path, Path]:
    """(kernel, initramfs) paths; the initramfs is rebuilt into the cache when its inputs change
    (its file name carries the sha256 of its bytes, so concurrent builders never clash)."""
    p = parts(root)
    blob = initramfs_bytes(p)
    digest = hashlib.sha256(blob).hexdigest()[:16]
    path = (root or cache_dir()) / f"initramfs-{digest}.cpio"
    if not path.is_file():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    return p["kernel"], path


def vmlinux_from_bzimage(bz: bytes) -> bytes:
    """The ELF kernel inside a bzImage: the boot protocol's ``payload_offset``/``payload_length``
    (at 0x248/0x24c, counted from the protected-mode code after ``setup_sects`` + 1 sectors) frame
    the compressed kernel; Debian compresses it with xz."""
    setup_sects = bz[0x1F1] or 4
    off, length = struct.unpack_from("<II", bz, 0x248)
    start = (setup_sects + 1) * 512 + off
    payload = bz[start:start + length]
    if not payload.startswith(b"\xfd7zXZ\x00"):
        raise SandboxError(f"vm: the kernel payload is not xz (starts {payload[:6]!r}); cannot extract vmlinux")
    elf = lzma.LZMADecompressor().decompress(payload)
    if not elf.startswith(b"\x7fELF"):
        raise SandboxError("vm: the decompressed kernel payload is not an ELF image")
    return elf


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    print("+", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout


def install(root: Path | None = None) -> dict:
    """Fetch the guest parts into the cache (``make vm-deps``); a no-op when they are present."""
    root = root or cache_dir()
    try:
        parts(root)
        return json.loads((root / "recipe.json").read_text())
    except (SandboxError, OSError, ValueError):
        pass
    try:
        deps = _run(["apt-cache", "depends", "linux-image-amd64"])
    except subprocess.CalledProcessError:  # a fresh machine without package lists
        _run(([] if os.geteuid() == 0 else ["sudo"]) + ["apt-get", "update", "-q"])
        deps = _run(["apt-cache", "depends", "linux-image-amd64"])
    kpkg = next(w.split()[1] for w in deps.splitlines() if w.strip().startswith("Depends: linux-image-"))
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        os.chmod(t, 0o755)  # apt's download user must be able to write here
        _run(["apt-get", "download", kpkg, "busybox-static"], cwd=t)
        debs = sorted(t.glob("*.deb"))
        for deb in debs:
            _run(["dpkg-deb", "-x", str(deb), str(t / "x")])
        x = t / "x"
        (root / "modules").mkdir(parents=True, exist_ok=True)
        kernel = next((x / "boot").glob("vmlinuz-*"))
        (root / "vmlinux").write_bytes(vmlinux_from_bzimage(kernel.read_bytes()))
        shutil.copy(x / "bin" / "busybox", root / "busybox")
        moddir = next((x / "lib" / "modules").iterdir())
        for m in MODULES:
            shutil.copy(next(moddir.rglob(f"{m}.ko")), root / "modules" / f"{m}.ko")
        recipe = {"kernel_package": kpkg, "kernel": kernel.name, "modules": list(MODULES),
                  "debs": [d.name for d in debs]}
    (root / "recipe.json").write_text(json.dumps(recipe, indent=1))
    parts(root)
    return recipe
