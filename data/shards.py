"""Token shard files (docs/data.md#shard-format), compatible with llm.c and modded-nanogpt.

A shard is a header of 256 little-endian int32 — [0] magic 20240520, [1] version 1, [2] token count N —
followed by N little-endian uint16 token ids. Every reader here validates the header, the file length and
(optionally) the id range, and names the file and the problem in its error.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from pathlib import Path

import numpy as np

from cli import progress_bar
from fileio import atomic_write, sha256_file

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_SHARD_TOKENS = 2**31 - 1  # the header's int32 token count
EOT_TOKEN = 50256  # <|endoftext|>, the document separator
GPT2_VOCAB = 50257
DIGEST_CACHE = "shard_sha256.json"  # sha256_shards' cache, in cache_root()
REPO_ROOT = Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    """Root of our caches (tokenizer ranks, embedded corpus, shard digests): `$SYMGPT_CACHE` if set, else
    `<repo>/data/cache`."""
    env = os.environ.get("SYMGPT_CACHE")
    return Path(env) if env else REPO_ROOT / "data" / "cache"


class ShardError(ValueError):
    """A token shard is missing, malformed or holds ids outside the vocabulary."""


def read_shard_header(path: str | os.PathLike) -> int:
    """Validate the header and size of `path`; return its token count."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: no such shard file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: truncated header ({size} bytes, need {HEADER_BYTES}); re-download or re-tokenize it")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise ShardError(f"{path}: bad magic {int(header[0])} (expected {SHARD_MAGIC}); not a token shard "
                         "(docs/data.md#shard-format)")
    if header[1] != SHARD_VERSION:
        raise ShardError(f"{path}: unsupported version {int(header[1])} (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        raise ShardError(
            f"{path}: header says {num_tokens} tokens ({expected} bytes) but the file has {size} bytes; "
            "the file is truncated or corrupt — re-download or re-tokenize it"
        )
    return num_tokens


def open_shard(path: str | os.PathLike, vocab_size: int | None = None) -> np.memmap:
    """Memory-map the tokens of a validated shard (read-only uint16 array); with `vocab_size`, every id is checked
    to be < vocab_size (one pass over the file)."""
    num_tokens = read_shard_header(path)
    tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(num_tokens,))
    if vocab_size is not None and num_tokens > 0:
        largest = int(tokens.max())
        if largest >= vocab_size:
            position = int(np.argmax(tokens >= vocab_size))
            raise ShardError(
                f"{path}: token id {largest} at position {position} is >= vocab_size {vocab_size}; "
                "the shard was made with another tokenizer or is corrupt"
            )
    return tokens


def write_shard(path: str | os.PathLike, tokens: np.ndarray | list[int]) -> None:
    """Write `tokens` as a shard atomically (temporary file, then rename)."""
    path = Path(path)
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"write_shard({path}): tokens must be 1-D, got shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() >= 2**16):
        raise ValueError(f"write_shard({path}): token ids must fit in uint16 (0..65535)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, array.size
    atomic_write(path, header.tobytes(), array.astype("<u2", copy=False).tobytes())


def shard_globs(directory: str | os.PathLike, prefix: str) -> tuple[str, str]:
    """(train_glob, val_glob) of the shards named `shard_name(prefix, split, i)` in `directory`."""
    return str(Path(directory) / f"{prefix}_train_*.bin"), str(Path(directory) / f"{prefix}_val_*.bin")


def _stat_key(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _read_digests(cache_file: str | os.PathLike) -> dict[str, list]:
    """The digest cache {absolute path: [size, mtime_ns, sha256]}; empty when absent or unreadable."""
    try:
        cache = json.loads(Path(cache_file).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_digests(cache_file: str | os.PathLike, cache: dict[str, list]) -> None:
    """Write the cache atomically, dropping entries of files that are gone; an unwritable cache only costs time."""
    live = {path: entry for path, entry in cache.items() if Path(path).is_file()}
    with contextlib.suppress(OSError):
        atomic_write(cache_file, json.dumps(live, indent=1, sort_keys=True).encode())


def remember_sha256(path: str | os.PathLike, sha256: str, cache_file: str | os.PathLike) -> None:
    """Store a digest computed elsewhere (e.g. a verified download) in the cache of `sha256_shards`."""
    path = Path(path).resolve()
    cache = _read_digests(cache_file)
    cache[str(path)] = [*_stat_key(path), sha256]
    _write_digests(cache_file, cache)


def sha256_shards(paths: list[Path], cache_file: str | os.PathLike, progress: bool = True) -> list[str]:
    """The sha256 of each file. A file whose size and mtime_ns match its entry in `cache_file` (JSON: absolute path
    -> [size, mtime_ns, sha256]) is not read again; the others are hashed (with a progress bar on stderr) and added,
    so a run hashes a 200 MB shard once, not at every start."""
    cache = _read_digests(cache_file)
    keys = [str(Path(p).resolve()) for p in paths]
    stale = [(path, key) for path, key in zip(paths, keys)
             if not (isinstance(entry := cache.get(key), list) and entry[:2] == _stat_key(Path(path)))]
    for path, key in progress_bar(stale, desc="sha256 of new or changed shards", unit="shard",
                                  disable=not progress or not stale):
        cache[key] = [*_stat_key(Path(path)), sha256_file(path)]
        _write_digests(cache_file, cache)  # after every file: an interrupted first start keeps what it did
    return [cache[key][2] for key in keys]


def describe_shards(pattern: str, cache_file: str | os.PathLike, progress: bool = True) -> dict:
    """What a glob of shards holds: {"pattern", "files": [{"path", "tokens", "bytes", "sha256"}], "tokens"}, the
    token counts from the headers (read_shard_header) and the digests from sha256_shards."""
    paths = find_shards(pattern)
    tokens = [read_shard_header(p) for p in paths]
    digests = sha256_shards(paths, cache_file, progress)
    files = [{"path": str(p.resolve()), "tokens": n, "bytes": p.stat().st_size, "sha256": d}
             for p, n, d in zip(paths, tokens, digests)]
    return {"pattern": pattern, "files": files, "tokens": sum(tokens)}


def shard_name(prefix: str, split: str, index: int) -> str:
    """`<prefix>_<split>_<index:06d>.bin` (docs/data.md#shard-format)."""
    return f"{prefix}_{split}_{index:06d}.bin"


def find_shards(pattern: str) -> list[Path]:
    """Sorted shard paths matching a glob `pattern`; an error naming the pattern when none match."""
    paths = sorted(Path(p) for p in glob.glob(pattern))
    if not paths:
        raise ShardError(f"no shard files match {pattern!r}; check --train-files/--val-files or create shards first")
    return paths
