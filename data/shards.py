"""Token shard files (SPEC §10), compatible with llm.c and modded-nanogpt.

A shard is a header of 256 little-endian int32 — [0] magic 20240520, [1] version 1, [2] token count N —
followed by N little-endian uint16 token ids. Every reader here validates the header, the file length and
(optionally) the id range, and names the file and the problem in its error.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
EOT_TOKEN = 50256  # <|endoftext|>, the document separator
GPT2_VOCAB = 50257


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
        raise ShardError(f"{path}: bad magic {int(header[0])} (expected {SHARD_MAGIC}); not a token shard (SPEC §10)")
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
    """Memory-map the tokens of a validated shard (read-only uint16 array).

    With `vocab_size`, every id is checked to be < vocab_size (one pass over the file).
    """
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
        for chunk in chunks:
            f.write(chunk)


def shard_globs(directory: str | os.PathLike, prefix: str) -> tuple[str, str]:
    """(train_glob, val_glob) of the shards named `shard_name(prefix, split, i)` in `directory`."""
    return str(Path(directory) / f"{prefix}_train_*.bin"), str(Path(directory) / f"{prefix}_val_*.bin")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_name(prefix: str, split: str, index: int) -> str:
    """`<prefix>_<split>_<index:06d>.bin` (SPEC §10)."""
    return f"{prefix}_{split}_{index:06d}.bin"


def find_shards(pattern: str) -> list[Path]:
    """Sorted shard paths matching a glob `pattern`; an error naming the pattern when none match."""
    import glob

    paths = sorted(Path(p) for p in glob.glob(pattern))
    if not paths:
        raise ShardError(f"no shard files match {pattern!r}; check --train-files/--val-files or create shards first")
    return paths
