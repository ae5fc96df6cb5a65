"""Guest parts and accelerator choice of the ``vm`` backend (no VM is booted here)."""

import lzma
import struct

import pytest

from k3.env import vm_image
from k3.env.backends import vm
from k3.env.sandbox import Limits, SandboxError


def test_missing_parts_fail_naming_the_make_target(tmp_path):
    with pytest.raises(SandboxError, match="make vm-deps"):
        vm_image.parts(tmp_path)                      # an empty cache
    p = vm_image.parts()                              # control: the cache `make vm-deps` filled
    assert p["kernel"].read_bytes()[:4] == b"\x7fELF"
    assert p["busybox"].stat().st_size > 100_000


def test_initramfs_is_a_newc_archive_with_init_and_busybox():
    blob = vm_image.initramfs_bytes(vm_image.parts())
    names, off = [], 0
    while True:                                       # walk the cpio records independently
        assert blob[off:off + 6] == b"070701"
        fields = [int(blob[off + 6 + 8 * i: off + 14 + 8 * i], 16) for i in range(13)]
        namesize, filesize = fields[11], fields[6]
        name = blob[off + 110: off + 110 + namesize - 1].decode()
        off = (off + 110 + namesize + 3) & ~3
        off = (off + filesize + 3) & ~3
        if name == "TRAILER!!!":
            break
        names.append(name)
    assert off == len(blob)
    assert {"init", "bin/busybox", "dev/console", "lib/modules/virtio_console.ko"} <= set(names)


def test_vmlinux_extraction_reads_the_boot_protocol_payload():
    elf = b"\x7fELF" + bytes(range(200)) * 50
    payload = lzma.compress(elf, format=lzma.FORMAT_XZ)
    setup_sects = 3
    bz = bytearray((setup_sects + 1) * 512 + 64 + len(payload))
    bz[0x1F1] = setup_sects
    struct.pack_into("<II", bz, 0x248, 64, len(payload))
    bz[(setup_sects + 1) * 512 + 64:] = payload
    assert vm_image.vmlinux_from_bzimage(bytes(bz)) == elf
    bz[(setup_sects + 1) * 512 + 64] = 0              # not xz any more
    with pytest.raises(SandboxError, match="not xz"):
        vm_image.vmlinux_from_bzimage(bytes(bz))


def test_limits_become_guest_cgroup_settings_or_are_refused(monkeypatch):
    monkeypatch.setenv("K3_VM_ACCEL", "tcg")
    cfg = vm.machine_config(Limits(memory_bytes=100 * 2**20, pids=7, cpus=0.5, disk_bytes=2**20))
    args = cfg.append.split()
    assert {"k3.mem=104857600", "k3.pids=7", "k3.cpu=50000", "k3.disk=1048576"} <= set(args)
    assert cfg.mem_mb == 100 + vm.OVERHEAD_MB and cfg.smp == 1 and cfg.accel == "tcg"
    with pytest.raises(SandboxError, match="network"):
        vm.machine_config(Limits(network=True))
    with pytest.raises(SandboxError, match="cpus"):
        vm.machine_config(Limits(cpus=10_000))
    monkeypatch.setenv("K3_VM_ACCEL", "xen")
    with pytest.raises(SandboxError, match="K3_VM_ACCEL"):
        vm.machine_config(Limits())
