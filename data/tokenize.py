"""Raw text corpora (data/documents.py) -> GPT-2 token shards (docs/data.md#shard-format), on all cores; what it
writes, and that a failed run leaves earlier outputs as they were: docs/data.md#other-corpora.

Layout, as in llm.c's `fineweb.py` (so our shards mix with the published FineWeb-Edu ones): every document is
<|endoftext|> followed by its tokens; the stream is cut into consecutive shards, `<prefix>_val_000000.bin` first,
then `<prefix>_train_%06d.bin` (a document may straddle two shards); the manifest `<prefix>_manifest.json` is last.

    python -m data.tokenize 'notes/**/*.md' --out data/notes --prefix notes
    python -m data.tokenize corpus/*.txt --out data/mycorpus --prefix mycorpus --val-tokens 1000000
    python -m data.tokenize dump.jsonl --text-field content --out data/dump
    python -m data.tokenize --hub-repo HuggingFaceFW/fineweb-edu --hub-pattern 'sample/10BT/*.parquet' --out data/fwe
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import multiprocessing
import os
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from cli import ArgumentParser, progress_bar
from data.documents import CorpusStats, TokenizeError, fetch_hub_files, iter_documents, resolve_sources
from data.shards import EOT_TOKEN, HEADER_BYTES, MAX_SHARD_TOKENS, shard_globs, shard_name, write_shard
from data.tokenizer import GPT2_RANKS_SHA256, ensure_gpt2_ranks, gpt2_tokenizer
from fileio import (LockHeldError, atomic_write, doing, exits_on_filesystem_errors, filesystem_error_line, hold_lock,
                    make_directory, process_alive, sha256_file)

DEFAULT_SHARD_TOKENS = 100_000_000
BATCH_CHARS = 1 << 20  # text per worker task: large enough to amortise IPC, small enough to keep all cores busy
SMALL_CORPUS_VAL_FRACTION = 0.1  # the default validation share of a corpus smaller than one shard


# -----------------------------------------------------------------------------
# Parallel, ordered, bounded map (shared with data/embedded.py)


def parallel_map(fn: Callable, items: Iterable, workers: int) -> Iterator:
    """`map(fn, items)` over `workers` processes, results in input order, at most 2*workers tasks in flight.

    Unlike `Pool.imap`, the input is consumed lazily, so a corpus larger than memory streams through.
    """
    if workers <= 1:
        yield from map(fn, items)
        return
    # spawned, not forked: a fork copies the locks other threads of the caller hold (a test runner's, a library's)
    # into a worker that has no thread left to release them, and that worker waits forever
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending = collections.deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# -----------------------------------------------------------------------------
# Documents -> shards


def encode_batch(texts: list[str]) -> np.ndarray:
    """<|endoftext|> + tokens for each text, concatenated (uint16)."""
    enc = gpt2_tokenizer()
    pieces = [np.array([EOT_TOKEN, *enc.encode_ordinary(text)], dtype=np.uint16) for text in texts]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch, chars = [], 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class _ShardWriter:
    """Cuts a token stream into `<prefix>_val_000000.bin` (val_tokens) and train shards (shard_tokens each).
    val_tokens None: one shard's worth, or SMALL_CORPUS_VAL_FRACTION of a stream that ends before that."""

    def __init__(self, out_dir: Path, prefix: str, shard_tokens: int, val_tokens: int | None, destination: Path):
        self.out_dir, self.prefix, self.destination = out_dir, prefix, destination  # written to, then moved to
        self.shard_tokens, self.val_tokens, self.val_share = shard_tokens, val_tokens or shard_tokens, not val_tokens
        self.buffer = np.empty(max(shard_tokens, self.val_tokens), dtype=np.uint16)
        self.fill = 0
        self.records: list[dict] = []

    def _capacity(self) -> int:
        return self.val_tokens if not self.records else self.shard_tokens

    def add(self, tokens: np.ndarray) -> None:
        while tokens.size:
            take = min(self._capacity() - self.fill, tokens.size)
            self.buffer[self.fill:self.fill + take] = tokens[:take]
            self.fill += take
            tokens = tokens[take:]
            if self.fill == self._capacity():
                self._flush()

    def _flush(self) -> None:
        index = len(self.records)
        split = "val" if index == 0 else "train"
        path = self.out_dir / shard_name(self.prefix, split, index)
        size_flag = "--val-tokens or --val-fraction" if split == "val" else "--shard-tokens"
        with named_write_errors(self.destination / path.name, size_flag, self.fill):
            write_shard(path, self.buffer[:self.fill])
        self.records.append({"name": path.name, "split": split, "tokens": self.fill, "sha256": sha256_file(path)})
        self.fill = 0

    def close(self) -> list[dict]:
        if self.val_share and not self.records and self.fill >= 2:  # a small corpus: a share of it validates
            total = self.fill
            self.val_tokens = min(total - 1, max(1, round(SMALL_CORPUS_VAL_FRACTION * total)))
            rest = self.buffer[self.val_tokens:total].copy()
            self.fill = self.val_tokens
            self._flush()
            self.buffer[:rest.size], self.fill = rest, rest.size
        if self.fill:
            self._flush()
        return self.records


@contextlib.contextmanager
def named_write_errors(path: Path, size_flag: str | None = None, tokens: int = 0) -> Iterator[None]:
    """Turn an OSError while writing `path` (a full disk, the file-size limit of `ulimit -f`, no permission) into a
    TokenizeError: the line of every tool's policy (fileio.filesystem_error_line) with the file it was to become,
    for a file too large the shard size that data.tokenize's `size_flag` sets (this shard's `tokens`), and that
    earlier outputs are untouched."""
    try:
        with doing("write", path):
            yield
    except OSError as exc:
        exc.filename = str(path)  # the file it was to become, not its copy in the staging directory
        line = filesystem_error_line(exc, "--out")
        if exc.errno == errno.EFBIG and size_flag:
            line += (f", or make smaller shards with data.tokenize's {size_flag} (this one: {tokens:,} tokens, "
                     f"{HEADER_BYTES + 2 * tokens:,} bytes)")
        raise TokenizeError(f"{line}; earlier outputs in --out are untouched") from exc


def existing_outputs(out_dir: Path, prefix: str) -> list[Path]:
    """Shards and manifest of an earlier run with this prefix in `out_dir`."""
    names = [f"{prefix}_val_*.bin", f"{prefix}_train_*.bin", f"{prefix}_manifest.json"]
    return sorted(p for name in names for p in out_dir.glob(name))


def claim_output(out_dir: Path, prefix: str):
    """Lock the outputs of `prefix` in `out_dir` for this process (`<out>/.<prefix>.lock`, released when it ends,
    however it ends): two data.tokenize writing one prefix into one directory would replace each other's shards
    (docs/data.md#other-corpora). TokenizeError naming the live holder when another process has it."""
    make_directory(out_dir)
    try:
        return hold_lock(out_dir / f".{prefix}.lock", f"data.tokenize pid {os.getpid()} on host {socket.gethostname()}")
    except LockHeldError as exc:
        raise TokenizeError(f"{out_dir}: another data.tokenize is writing '{prefix}' shards there ({exc.holder}); "
                            "wait for it to finish, or choose another --out/--prefix") from None


def _staging_dir(out_dir: Path, prefix: str) -> Path:
    """Where this process writes the shards of `prefix` before they replace the outputs in `out_dir`; staging
    directories of processes that no longer run (killed mid-run) are removed."""
    for stale in out_dir.glob(f".{prefix}.*.tmp"):
        pid = stale.name.removeprefix(f".{prefix}.").removesuffix(".tmp")
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    staging = out_dir / f".{prefix}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    return make_directory(staging)


def _replace_outputs(staging: Path, out_dir: Path, prefix: str, records: list[dict], manifest: dict) -> None:
    """Move the finished shards from `staging` into `out_dir` in place of the prefix's earlier outputs, and write
    the manifest last. The old manifest goes first, so a crash between the renames leaves a directory that reads as
    interrupted (no manifest), never one whose manifest describes other shards."""
    old = existing_outputs(out_dir, prefix)
    (out_dir / f"{prefix}_manifest.json").unlink(missing_ok=True)
    for record in records:
        os.replace(staging / record["name"], out_dir / record["name"])
    new = {record["name"] for record in records}
    for path in old:
        if path.name not in new:
            path.unlink(missing_ok=True)
    path = out_dir / f"{prefix}_manifest.json"
    with named_write_errors(path):
        atomic_write(path, (json.dumps(manifest, indent=1) + "\n").encode())


def documents_to_shards(
    documents: Iterable[str],
    out_dir: str | os.PathLike,
    prefix: str,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_tokens: int | None = None,
    val_fraction: float | None = None,
    workers: int | None = None,
    metadata: Callable[[], dict] | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> dict:
    """Tokenize `documents` into shards in `out_dir` and write `<prefix>_manifest.json`; return the manifest.

    The validation shard holds the first `val_tokens` tokens (default: see _ShardWriter), or `val_fraction` of all
    tokens (the whole stream in memory: small corpora only). `metadata()`, called after the last document, goes into
    the manifest. Earlier outputs with this prefix are an error unless `overwrite` (replaced once the new shards are
    complete; a failed run leaves them untouched and removes what it wrote), and so is another process writing this
    prefix into `out_dir` at the same time (claim_output).
    """
    out_dir = Path(out_dir)
    if shard_tokens < 1:
        raise TokenizeError(f"shard_tokens must be >= 1 (got {shard_tokens})")
    if val_tokens is not None and val_fraction is not None:
        raise TokenizeError("give val_tokens or val_fraction, not both")
    if val_fraction is not None and not 0.0 < val_fraction < 1.0:
        raise TokenizeError(f"val_fraction must be in (0, 1) (got {val_fraction})")
    if val_tokens is not None and val_tokens < 1:
        raise TokenizeError(f"val_tokens must be >= 1 (got {val_tokens}); the first shard is always validation")
    for flag, tokens in (("--shard-tokens", shard_tokens), ("--val-tokens", val_tokens or 0)):
        if tokens > MAX_SHARD_TOKENS:
            raise TokenizeError(f"{flag} {tokens:,}: a shard holds at most {MAX_SHARD_TOKENS:,} tokens (its header "
                                "counts them in an int32); give fewer")
    created = not out_dir.exists()
    lock, staging = claim_output(out_dir, prefix), None  # from here on, this process's outputs
    try:
        old = existing_outputs(out_dir, prefix)
        if old and not overwrite:
            raise TokenizeError(
                f"{out_dir} already holds {len(old)} '{prefix}' shard/manifest files (e.g. {old[0].name}); "
                "choose another --out/--prefix or pass --overwrite to replace them"
            )
        ensure_gpt2_ranks()  # fetch once here, not in every worker
        workers = workers or default_workers()
        staging = _staging_dir(out_dir, prefix)
        chunks = parallel_map(encode_batch, _batches(documents), workers)
        bar = progress_bar(unit="tok", unit_scale=True, desc=f"tokenizing {prefix}", disable=not progress)
        chunks = _counted(chunks, bar)
        if val_fraction is not None:
            chunks = list(chunks)
            total = sum(c.size for c in chunks)
            val_tokens = max(1, round(total * val_fraction))
        writer = _ShardWriter(staging, prefix, shard_tokens, val_tokens, out_dir)
        try:
            for chunk in chunks:
                writer.add(chunk)
            records = writer.close()
        finally:
            bar.close()
        total = sum(r["tokens"] for r in records)
        if len(records) < 2:
            raise TokenizeError(_too_small(total, writer.val_tokens, val_fraction))
        manifest = {
            "prefix": prefix,
            "tokenizer": "r50k_base",
            "tokenizer_sha256": GPT2_RANKS_SHA256,
            "shard_tokens": shard_tokens,
            "val_tokens": writer.val_tokens,
            "tokens": total,
            "shards": records,
            **(metadata() if metadata else {}),
        }
        _replace_outputs(staging, out_dir, prefix, records, manifest)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if created and [p.name for p in out_dir.iterdir()] == [Path(lock.name).name]:
            Path(lock.name).unlink()  # a failed run into a new directory leaves none
            out_dir.rmdir()
        lock.close()
    return manifest


def _too_small(total: int, val_tokens: int, val_fraction: float | None) -> str:
    """Why a corpus of `total` tokens made no training shard, and a fix that works (none when no split can)."""
    if total == 0:
        return "no documents to tokenize: every input file was empty or every document in it was skipped"
    if total < 2:
        return f"the corpus has {total} token: a validation and a training shard need at least 2"
    if val_fraction is not None:
        return (f"the corpus has only {total:,} tokens and --val-fraction {val_fraction} puts all of them in the "
                f"validation shard; pass a smaller --val-fraction (e.g. {1 / total:.2g}) or more text")
    return (f"the corpus has only {total:,} tokens, all of which went to the validation shard (--val-tokens "
            f"{val_tokens:,}); pass a smaller --val-tokens (e.g. {max(1, total // 10):,}) or more text")


def _counted(chunks: Iterator[np.ndarray], bar) -> Iterator[np.ndarray]:
    for chunk in chunks:
        bar.update(chunk.size)
        yield chunk


# -----------------------------------------------------------------------------
# CLI


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="data.tokenize",
                            description="Tokenize text corpora into GPT-2 token shards (docs/data.md).")
    parser.add_argument("inputs", nargs="*", help="local files or globs (quote globs): .jsonl and .parquet records, "
                        "any other file as UTF-8 text (.txt, .md, .py, no extension, ...)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--prefix", default="corpus", help="shard name prefix: <prefix>_val_000000.bin, ...")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per training shard")
    parser.add_argument("--val-tokens", type=int, default=None,
                        help="tokens in the val shard (default: --shard-tokens, or a tenth of a corpus smaller "
                        "than that)")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="instead of --val-tokens: this fraction of all tokens (held in memory: small corpora)")
    parser.add_argument("--text-field", default="text", help="jsonl key / parquet column holding the text")
    parser.add_argument("--txt-split", choices=("file", "line"), default="file",
                        help="a text file's documents: the whole file, or each non-blank line")
    parser.add_argument("--utf8-errors", choices=("replace", "skip"), default="replace",
                        help="invalid UTF-8: replace bad bytes with U+FFFD, or skip the document (both counted)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace earlier shards with this prefix in --out (once the new ones are complete)")
    parser.add_argument("--hub-repo", default=None,
                        help="Hub dataset repo to fetch files from, e.g. HuggingFaceFW/fineweb-edu")
    parser.add_argument("--hub-pattern", default="*.parquet",
                        help="glob over the repo's file names, e.g. 'sample/10BT/*.parquet'")
    parser.add_argument("--hub-max-files", type=int, default=None, help="only the first N matching files")
    parser.add_argument("--hub-revision", default=None, help="branch, tag or commit of --hub-repo (default: main)")
    parser.add_argument("--hub-endpoint", default=None, help="default: $HF_ENDPOINT or huggingface.co")
    args = parser.parse_args(argv)
    if Path(args.prefix).name != args.prefix or args.prefix.strip(".") == "":
        parser.error(f"--prefix {args.prefix!r}: a name for the shard files, without '/' (put the directory in --out, "
                     "e.g. --out data/mine --prefix mine)")
    stats = CorpusStats()
    try:
        paths = resolve_sources(args.inputs, stats)
        sources = [str(p) for p in paths]
        if args.hub_repo:
            hub = fetch_hub_files(args.hub_repo, args.hub_pattern, args.hub_max_files, revision=args.hub_revision,
                                  endpoint=args.hub_endpoint)
            paths += [path for _, path in hub]
            sources += [f"hf://datasets/{args.hub_repo}/{name}" for name, _ in hub]
        if not paths:
            parser.error("give input files/globs or --hub-repo")
        docs = iter_documents(paths, stats, text_field=args.text_field, utf8_errors=args.utf8_errors,
                              txt_split=args.txt_split)
        manifest = documents_to_shards(
            docs, args.out, args.prefix, shard_tokens=args.shard_tokens, val_tokens=args.val_tokens,
            val_fraction=args.val_fraction,
            workers=args.workers, overwrite=args.overwrite, progress=True,
            metadata=lambda: {"sources": sources, "counts": dataclasses.asdict(stats)},
        )
    except TokenizeError as e:
        e.exit(stats.dropped())
    print(f"{manifest['tokens']:,} tokens from {stats.documents:,} documents in {len(manifest['shards'])} shards "
          f"-> {args.out}")
    print(f"read: {stats.summary()}")
    train_glob, val_glob = shard_globs(args.out, args.prefix)
    print(f"train files: {train_glob}\nval files:   {val_glob}")


if __name__ == "__main__":
    main()
