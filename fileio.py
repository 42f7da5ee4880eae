"""Files that are never half written (`atomic_writer`) and directories one process owns (`hold_lock`): the I/O
every tool shares. Standard library only; importing this module has no side effects."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file whose contents replace `path` only when the block ends without error: written to a temporary
    file (its name carries the process id, so concurrent writers never share it), synced, then renamed. Readers
    and a crash mid-write see the old file or the whole new one; on an error the temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, *chunks: bytes) -> None:
    """Write `chunks` to `path` atomically (see atomic_writer)."""
    with atomic_writer(path) as f:
        f.writelines(chunks)


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def dead_temporaries(folder: str | os.PathLike) -> list[Path]:
    """The temporary files of `atomic_writer` in `folder` (NAME.<pid>.tmp) whose writer no longer runs on this
    host: what a writer killed mid-write leaves. Files of live writers, and other *.tmp files, are not listed."""
    found = []
    for path in sorted(Path(folder).glob("*.tmp")):
        pid = path.name.removesuffix(".tmp").rpartition(".")[2]
        if path.is_file() and pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            found.append(path)
    return found


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


class LockHeldError(RuntimeError):
    """Another live process holds the lock; `holder` is what it wrote into the lock file."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder}")
        self.holder = holder


def hold_lock(path: str | os.PathLike, holder: str) -> TextIO:
    """Take the exclusive advisory lock on `path` (created if missing) and write `holder` into it; the lock lasts
    while the returned handle is open, and the operating system releases it when the process ends, however it ends,
    so a dead holder leaves no stale lock. LockHeldError names the live holder (given a moment to write its name,
    which it does just after taking the lock)."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        found = ""
        for _ in range(40):
            handle.seek(0)
            found = handle.read().strip()
            if found:
                break
            time.sleep(0.05)
        handle.close()
        raise LockHeldError(Path(path), found or "another process") from None
    handle.seek(0)
    handle.truncate()
    handle.write(holder + "\n")
    handle.flush()
    return handle


def lock_holder(path: str | os.PathLike) -> str | None:
    """Who holds the lock on `path` (what it wrote), or None when no live process holds it."""
    if not Path(path).is_file():
        return None
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "another process"
        return None
