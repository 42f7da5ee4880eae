"""The run directory (docs/runs.md#run-directories): chosen, claimed by one trainer at a time (a lock the operating
system releases when its process ends), cleared of what crashed writers left, and opened with the run's code, config
and logs. Importing this module has no side effects.

    <run>/config.json   what ran: flags, batch layout, data record, preset report
    <run>/log.txt       the trainer's code (once), then every printed line;   <run>/log.jsonl   one record per log step
    <run>/code/         the source as it ran;   <run>/checkpoints/latest.pt (and step_XXXXXX.pt)
    <run>/.lock         held by the trainer that owns the run while it runs
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import json
import os
import socket
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fileio import LockHeldError, atomic_write, dead_temporaries, doing, hold_lock, lock_holder, make_directory
from run.log import RunLog, open_trackers

if TYPE_CHECKING:
    from run.process import Runtime

REPO_ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "symgpt"  # pyproject.toml's project name
RUN_LOCK = ".lock"  # held by the trainer that owns the run while it runs


class RunInUseError(RuntimeError):
    """Another live trainer owns the run directory."""


NAME_MAX = 255  # bytes in one file name: the limit of Linux's filesystems (ext4, xfs, tmpfs, NFS, Lustre)


def directory_name_problem(flag: str, name: str) -> str | None:
    """Why `name`, given as `flag`, cannot name one directory inside its parent (empty, a path separator, '.' or
    '..', which would write elsewhere, or longer than a file name may be); None when it can."""
    if name in ("", ".", "..") or "/" in name or (os.altsep and os.altsep in name):
        return f"{flag} {name!r}: one directory name, without '/' and not '.' or '..' (the parent is --run-dir)"
    if len(name.encode()) > NAME_MAX:
        return (f"{flag} {name[:40]}...: {len(name.encode())} bytes, and a file name holds at most {NAME_MAX}; choose "
                "a shorter one")
    return None


def run_holder(run_dir: Path) -> str | None:
    """Who holds the run directory (its trainer: "pid N on host H"), None when no live process does."""
    return lock_holder(run_dir / RUN_LOCK)


def run_holds_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.glob("*.pt"))


def existing_run_problem(run_dir: Path) -> str | None:
    """An error when a new run named --run-name would write into an earlier run's directory (one that holds a
    checkpoint; a directory an earlier run left without any is reused, see RunDirectory.claim) or into a directory
    that holds other files (no run's .lock)."""
    if run_holds_checkpoint(run_dir):
        return (f"--run-name {run_dir.name}: {run_dir} already holds a run; continue it with --resume {run_dir}, or "
                "choose another --run-name")
    if run_dir.is_dir() and not (run_dir / RUN_LOCK).exists() and any(run_dir.iterdir()):
        return (f"--run-name {run_dir.name}: {run_dir} exists and holds files that are not a run's; choose another "
                "--run-name or --run-dir")
    return None


class RunDirectory:
    """The directory of the run this process owns (rank 0 only): created or reopened, locked while the run lasts
    (<run>/.lock, see fileio.hold_lock), with the leftovers of earlier crashes cleared."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = None

    @classmethod
    def choose(cls, parent: str, name: str, kind: str, continue_in: Path | None) -> tuple[RunDirectory, str | None]:
        """The resumed run's own directory (continue_in), parent/--run-name, or a fresh parent/TIMESTAMP-kind
        (claimed with an atomic mkdir; -2, -3, ... when taken, with a note saying so)."""
        if continue_in is not None or name:
            return cls(continue_in or Path(parent) / name), None
        stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}"
        make_directory(parent)
        for n in range(1, 10_000):
            path = Path(parent) / (stem if n == 1 else f"{stem}-{n}")
            try:
                with doing("create the directory", path):
                    path.mkdir()
            except FileExistsError:
                continue
            note = None if n == 1 else f"run directory {Path(parent) / stem} exists: using {path.name} instead"
            return cls(path), note
        raise RuntimeError(f"no free run directory name {stem}-N under {parent}")

    def claim(self, new_run: bool) -> list[str]:
        """Take the lock (RunInUseError naming the owner when another live process holds it), remove the temporary
        files that writers which no longer run left beside the trainer's files (fileio.dead_temporaries of the
        directory and checkpoints/), and for a new run in a directory an earlier run left without a checkpoint, move
        that run's files aside. Returns what was done, for the log."""
        make_directory(self.path)
        if new_run and (problem := existing_run_problem(self.path)):  # another run's, or not a run's at all
            raise RunInUseError(problem)
        try:
            self._lock = hold_lock(self.path / RUN_LOCK, f"pid {os.getpid()} on host {socket.gethostname()}")
        except LockHeldError as exc:
            raise RunInUseError(f"{self.path} is in use by {exc.holder}: wait for it to finish or stop it, or choose "
                                "another --run-name") from None
        notes = []
        for stale in dead_temporaries(self.path) + dead_temporaries(self.path / "checkpoints"):
            size = stale.stat().st_size
            stale.unlink(missing_ok=True)
            notes.append(f"removed {stale} ({size / 2**20:,.1f} MiB), left by an interrupted write")
        if new_run and (problem := existing_run_problem(self.path)):  # a checkpoint written before we locked
            self.release()
            raise RunInUseError(problem)
        leftovers = [p for p in self.path.iterdir() if p.name != RUN_LOCK and not p.name.startswith("failed-")]
        if new_run and leftovers:
            stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
            while (aside := self.path / (f"failed-{stamp}" + f"-{n}" * (n > 1))).exists():  # two in one second
                n += 1
            with doing("move aside the files of an earlier attempt into", aside):
                aside.mkdir()
                for item in leftovers:
                    item.rename(aside / item.name)
            notes.append(f"{self.path} held an earlier run that wrote no checkpoint: its files are kept in "
                         f"{aside.name}/ and this run starts in the directory")
        return notes

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the lock
            self._lock = None

    def copy_code(self) -> None:
        """<run>/code: the trainer and its modules as they run (trainer_sources; a resumed run refreshes it), each
        written atomically."""
        for source in trainer_sources():
            atomic_write(self.path / "code" / source.relative_to(REPO_ROOT), source.read_bytes())


def imported_names(path: Path) -> frozenset[str]:
    """The dotted names the imports of source file `path` name, at the top and inside functions: its import
    statements (for `from a import b`, a and a.b: b may be a module) and its calls of `importlib.import_module` or
    `__import__` with a literal name (a name computed at run time cannot be read from the source). The repository
    writes every import absolute. Each version of a file (its modification time and size) is parsed once per process:
    a process that opens many runs (a notebook, the test suite) does not parse the tree again for each."""
    stat = path.stat()
    return _imported_names(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _imported_names(path: Path, mtime_ns: int, size: int) -> frozenset[str]:
    """imported_names of one version of the file (the cache's key: its path, modification time and size)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        dynamic = dynamic_import(node)
        if (isinstance(node, ast.ImportFrom) and node.level) or (dynamic or "").startswith("."):
            raise ValueError(f"{path}:{node.lineno}: a relative import; write it absolute")
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        elif dynamic:
            names.add(dynamic)
    return frozenset(names)


def dynamic_import(node: ast.AST) -> str | None:
    """The module a call `importlib.import_module("a.b")`, `import_module("a.b")` or `__import__("a.b")` imports,
    when its name is a literal string; None for any other node."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    return node.args[0].value if called in ("import_module", "__import__") else None


def module_file(name: str) -> Path | None:
    """The source file of module `name` in the source tree (a package's __init__.py), None if it has none there."""
    base = REPO_ROOT.joinpath(*name.split("."))
    return next((path for path in (base.with_suffix(".py"), base / "__init__.py") if path.is_file()), None)


def trainer_sources(entry: str = "train_gpt") -> list[Path]:
    """The source files a training process runs, derived from the tree: the entry module and every module of the
    source tree that its import statements reach (imported_names, transitively), with the __init__.py of each
    package on the way. Installed as a wheel, the tree is site-packages: the modules of other distributions there
    (torch, numpy, ...) are not followed."""
    in_site_packages = REPO_ROOT == Path(sysconfig.get_paths()["purelib"]).resolve()
    foreign = {name for name, owners in importlib.metadata.packages_distributions().items()
               if DISTRIBUTION not in owners} if in_site_packages else set()
    found, todo = set(), [entry]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        modules = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # each package on the way, then the module
        for path in filter(None, map(module_file, modules)):
            if parts[0] not in foreign and path not in found:
                found.add(path)
                todo.extend(imported_names(path))
    return sorted(found)


def open_run_directory(run_config, rt: Runtime, log: RunLog, *, config_record: dict, code: str,
                       step: int) -> RunDirectory:
    """The directory of the run `run_config` (config.RunConfig) describes, on every rank (a collective under
    torchrun). Rank 0 chooses it (the resumed run's own, --run-dir/--run-name, or a new TIMESTAMP-PRESET-OPTIMIZER),
    claims it (see RunDirectory.claim), copies the code, writes config.json (`config_record`), opens log.txt (which
    starts with `code`) and log.jsonl, opens the optional trackers at `step` and logs the header; the other ranks get
    its path."""
    import torch.distributed  # here: what reads a run directory (its lock, its checkpoints) imports no torch

    hp, continue_in, run_dir, refusal = run_config.train, run_config.continue_in, None, None
    if rt.is_master:
        try:
            kind = f"{run_config.preset or 'custom'}-{hp.optimizer}"
            run_dir, note = RunDirectory.choose(hp.run_dir, hp.run_name, kind, continue_in)
            notes = [note] * bool(note) + run_dir.claim(new_run=continue_in is None)
        except RunInUseError as exc:
            refusal = str(exc)
    box = [run_dir.path if run_dir else None, refusal]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(box)  # every rank names the run in its messages, or exits with rank 0's refusal
    if box[1]:
        raise RunInUseError(box[1])
    if rt.is_master:
        run_dir.copy_code()
        atomic_write(run_dir.path / "config.json", json.dumps(config_record, indent=2).encode())
        log.attach(run_dir.path, code)
        log.trackers = open_trackers(hp, run_dir.path, config_record, step)
        for line in notes:
            log.line(line)
        gpu = f" ({torch.cuda.get_device_name(rt.device)})" if rt.device.type == "cuda" else ""
        log.line(f"python {sys.version.split()[0]} | torch {torch.__version__} | device {rt.device}{gpu} | "
                 f"{rt.dtype_name} | world {rt.world}")
        log.line(f"run directory {run_dir.path} | code in code/ (train_gpt.py sha256 "
                 f"{hashlib.sha256(code.encode()).hexdigest()[:16]})")
    return run_dir or RunDirectory(box[0])
