"""The three filesystems a tool must fail on in one line (docs/runs.md#filesystem-errors), made for a test: a full
disk (a small tmpfs, filled), a read-only mount (a bind mount remounted read-only) and a folder the process may not
write to (mode bits; as root, with the capabilities that override them dropped from the calling thread for the
block). Mounting needs root and a kernel that lets this process mount (a container may not): `mount_problem` says
why not, in one line, for the test to skip with. Every mount is unmounted when its block ends, also on failure."""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

PAGE = 4096  # tmpfs allocates file data by pages


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60)


def _unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True, timeout=60).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=60)  # still busy: detach it


@contextlib.contextmanager
def _mounted(path: Path, *args: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    result = _mount(*args, str(path))
    assert result.returncode == 0, f"mount {' '.join(args)} {path}: {result.stderr.strip()}"
    try:
        yield path
    finally:
        _unmount(path)


def mount_problem() -> str | None:
    """Why this process cannot make the test filesystems (not root, no mount command, mounting refused); None when
    it can. Tried once: a small tmpfs, mounted and unmounted."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount command on this machine"
    with tempfile.TemporaryDirectory() as folder:
        result = _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", folder)
        if result.returncode:
            return f"mounting a tmpfs is not permitted here ({result.stderr.strip() or result.returncode})"
        _unmount(Path(folder))
    return None


@contextlib.contextmanager
def full_disk(path: Path, size: int = 1 << 20, free: int = 0, fill: Path | None = None) -> Iterator[Path]:
    """`path`, a tmpfs of `size` bytes holding a copy of the folder `fill` (if given) and a file that leaves `free`
    bytes (rounded down to whole pages) for anything else."""
    with _mounted(path, "-t", "tmpfs", "-o", f"size={size}", "tmpfs"):
        if fill is not None:
            shutil.copytree(fill, path, dirs_exist_ok=True)
        filler = path / ".filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(bytes(PAGE * 16))
                f.flush()
        os.truncate(filler, max(0, filler.stat().st_size - free // PAGE * PAGE))
        yield path


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path` (a folder, with what it holds) mounted read-only over itself for the block."""
    with _mounted(path, "--bind", str(path)):
        result = _mount("-o", "remount,ro,bind", str(path))
        assert result.returncode == 0, f"remounting {path} read-only: {result.stderr.strip()}"
        yield path


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


OVERRIDES = (1 << 1) | (1 << 2) | (1 << 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


@contextlib.contextmanager
def bound_by_mode_bits() -> Iterator[None]:
    """As root: the calling thread without the capabilities that override mode bits (capset, restored after), so
    that they bind it as they bind any user. Other users are bound already."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3, this thread
    assert libc.capget(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    saved = data[0].effective
    data[0].effective &= ~OVERRIDES
    assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())


@contextlib.contextmanager
def no_permission(path: Path) -> Iterator[Path]:
    """`path` (a folder, with what it holds) that this process may read but not write for the block."""
    modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")] if not p.is_symlink()}
    for p, mode in modes.items():
        p.chmod(mode & ~0o222)
    try:
        with bound_by_mode_bits():
            yield path
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
