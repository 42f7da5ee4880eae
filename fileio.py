"""Files that are never half written (`atomic_writer`), directories one process owns (`hold_lock`), and the one
policy every entry point follows for filesystem errors (`exits_on_filesystem_errors`, docs/runs.md#filesystem-errors):
the I/O every tool shares. Standard library only; importing this module has no side effects."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TextIO, TypeVar

FILESYSTEM_ERROR_EXIT = 2  # every entry point's exit code for a filesystem error


@contextlib.contextmanager
def doing(operation: str, path: str | os.PathLike) -> Iterator[None]:
    """Name the operation ("write", "create the directory", ...) and the path of an OSError raised inside, for
    filesystem_error_line; an error that already names an operation (raised by an inner `doing`) keeps it. The
    exception keeps its type (a PermissionError stays one)."""
    try:
        yield
    except OSError as exc:
        if exc.errno is not None and getattr(exc, "operation", None) is None:  # a system call's error
            exc.operation = operation
            exc.filename = str(path)
        raise


def make_directory(path: str | os.PathLike) -> Path:
    """`path` and its parents, created where missing (an OSError names the directory and the operation)."""
    path = Path(path)
    with doing("create the directory", path):
        path.mkdir(parents=True, exist_ok=True)
    return path


def _free_mib(path: Path) -> str:
    for folder in (path, *path.parents):
        with contextlib.suppress(OSError):
            return f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free there"
    return "free space unknown"


def filesystem_error_line(exc: OSError, where: str = "location") -> str:
    """One line for an OSError: the path, the operation that failed (see `doing`), the system's reason with its
    errno name, and what to do; `where` is what chooses where the tool writes (its flag: --out, --run-dir), named in
    the advice (docs/runs.md#filesystem-errors)."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, "")
    operation = getattr(exc, "operation", None)
    if code == errno.EPIPE and exc.filename is None:
        return ("could not write to the output: the pipe it goes to was closed (a reader such as `| head` ended "
                "before the tool did); let the output go to a terminal or a file")
    path = Path(exc.filename) if exc.filename else None
    reason = exc.strerror or str(exc) or type(exc).__name__
    if code in (errno.ENOSPC, errno.EDQUOT):
        advice = f"the filesystem is full ({_free_mib(path or Path.cwd())}): free space, or choose another {where}"
    elif code == errno.EROFS:
        advice = f"the filesystem is mounted read-only: choose another {where}, on a writable filesystem"
    elif code in (errno.EACCES, errno.EPERM):
        access = "read" if operation and operation.startswith("read") else "write"
        advice = f"no permission: choose another {where}, or get {access} access to it"
    elif code == errno.ENAMETOOLONG:
        advice = "a name in the path is longer than the filesystem allows (255 bytes): choose a shorter one"
    elif code in (errno.EEXIST, errno.ENOTDIR):
        advice = f"a file is in the way of a directory there: choose another {where}, or move the file"
    elif code == errno.EISDIR:
        advice = "it is a directory: give a file"
    elif code == errno.ENOENT:
        advice = "it does not exist: check the path"
    elif code == errno.EFBIG:
        advice = "the file exceeds the file-size limit (`ulimit -f`) or the filesystem's largest file: raise the limit"
    elif code == errno.EIO:
        advice = "the device reported an input/output error: check the disk or the network filesystem"
    else:
        advice = f"check the path and its filesystem, or choose another {where}"
    what = f"could not {operation} {path}" if operation and path else str(path or "a system call failed")
    return f"{what}: {reason}{f' ({name})' * bool(name)}; {advice}"


class DamagedFile(ValueError):
    """A file whose contents are damaged (a log line that is no record, say): the message names the file, what is
    wrong and what to do, and an entry point says it in one line (exits_on_filesystem_errors)."""


Main = TypeVar("Main", bound=Callable)


def exits_on_filesystem_errors(where: str = "location") -> Callable[[Main], Main]:
    """The policy of every entry point (a tool's main) for filesystem errors: an OSError that reaches it (a full
    disk, a read-only filesystem, no permission, a name too long, a closed output pipe) ends the tool with
    filesystem_error_line on stderr, "error: " in front, and exit code FILESYSTEM_ERROR_EXIT, never a traceback; so
    does a DamagedFile, with its message. What it wrote is whole or absent: its writes go through atomic_writer or a
    staging directory."""
    def decorate(main: Main) -> Main:
        @functools.wraps(main)
        def guarded(*args, **kwargs):
            try:
                result = main(*args, **kwargs)
                sys.stdout.flush()  # here, not at exit: an output pipe closed early is said below
                return result
            except (OSError, DamagedFile) as exc:
                print_error(filesystem_error_line(exc, where) if isinstance(exc, OSError) else str(exc))
                raise SystemExit(FILESYSTEM_ERROR_EXIT) from None
        return guarded
    return decorate


def print_error(line: str) -> None:
    """`error: line` on stderr. A standard output whose pipe was closed (its reader ended) is pointed at /dev/null
    first, so that flushing it at exit adds no second error."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    print(f"error: {line}", file=sys.stderr)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file whose contents replace `path` only when the block ends without error: written to a temporary
    file (its name carries the process id, so concurrent writers never share it), synced, then renamed. Readers
    and a crash mid-write see the old file or the whole new one; on an error the temporary file is removed."""
    path = Path(path)
    make_directory(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with doing("write", path), open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        with doing("write", path):
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
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
    with doing("create the lock file", path):
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
    try:
        with doing("write the lock file", path):
            handle.seek(0)
            handle.truncate()
            handle.write(holder + "\n")
            handle.flush()
    except OSError:
        with contextlib.suppress(OSError):  # what did not fit is dropped with the handle, and so is the lock
            handle.truncate(0)
            handle.close()
        raise
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
