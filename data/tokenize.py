"""Raw text corpora -> GPT-2 token shards (docs/data.md#shard-format), on all cores.

Sources: local `.txt` / `.jsonl` / `.parquet` files or globs, or the files of a Hugging Face Hub dataset repo (e.g.
FineWeb-Edu's `sample/10BT/*.parquet`). Layout, as in llm.c's `fineweb.py` (so our shards mix with the published
FineWeb-Edu ones): every document is <|endoftext|> followed by its tokens; the stream is cut into consecutive shards,
the first `val_tokens` tokens being `<prefix>_val_000000.bin` and then `shard_tokens` per `<prefix>_train_%06d.bin`
(a document may straddle two shards). Output depends only on the input (not on the number of workers), and a manifest
`<prefix>_manifest.json` (sources, counts, tokenizer, sha256 of every shard) is written last: a directory without it
is an interrupted run. Shards are written to a staging directory inside the output directory and replace earlier
outputs of the prefix (--overwrite) only once the whole corpus is tokenized: a failed run leaves them as they were.

Bad input is never dropped silently: empty files, invalid UTF-8 (`--utf8-errors replace|skip`), jsonl lines without
the text field or that are not JSON, and unreadable parquet files are counted, reported and kept in the manifest; a
corpus of which nothing is left is an error that gives the counts per reason and the first problems.

    python -m data.tokenize corpus/*.txt --out data/mycorpus --prefix mycorpus --val-tokens 1000000
    python -m data.tokenize dump.jsonl --text-field content --out data/dump
    python -m data.tokenize --hub-repo HuggingFaceFW/fineweb-edu --hub-pattern 'sample/10BT/*.parquet' --out data/fwe
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import errno
import fnmatch
import glob
import json
import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.shards import (
    EOT_TOKEN,
    HEADER_BYTES,
    atomic_write,
    process_alive,
    sha256_file,
    shard_globs,
    shard_name,
    write_shard,
)
from data.tokenizer import GPT2_RANKS_SHA256, ensure_gpt2_ranks, gpt2_tokenizer

DEFAULT_SHARD_TOKENS = 100_000_000
BATCH_CHARS = 1 << 20  # text per worker task: large enough to amortise IPC, small enough to keep all cores busy
SUFFIXES = (".txt", ".jsonl", ".parquet")
MAX_PROBLEMS_LISTED = 50
DROPPED = {  # CorpusStats counters of input that yields no document, and what each counts
    "empty_files": "empty files",
    "empty_documents": "empty documents",
    "invalid_utf8_skipped": "documents with invalid UTF-8 (--utf8-errors skip)",
    "bad_json_lines": "jsonl lines that are not JSON",
    "missing_field": "records without a string text field (see --text-field)",
    "unreadable_files": "parquet files without the text column or unreadable",
}


class TokenizeError(ValueError):
    """Bad arguments or input for tokenization; the message names the file or flag and what to do."""


@dataclasses.dataclass
class CorpusStats:
    """What was read, and what was skipped or repaired (and why)."""

    files: int = 0
    documents: int = 0
    text_bytes: int = 0
    empty_files: int = 0
    empty_documents: int = 0
    invalid_utf8_replaced: int = 0
    invalid_utf8_skipped: int = 0
    bad_json_lines: int = 0
    missing_field: int = 0
    unreadable_files: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    def note(self, counter: str, message: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        if len(self.problems) < MAX_PROBLEMS_LISTED:
            self.problems.append(message)

    def summary(self) -> str:
        counts = {k: v for k, v in dataclasses.asdict(self).items() if k != "problems" and v}
        lines = [", ".join(f"{k}={v}" for k, v in counts.items())] + [f"  {p}" for p in self.problems]
        total = sum(v for k, v in counts.items() if k not in ("files", "documents", "text_bytes"))
        if total > len(self.problems):
            lines.append(f"  ... {total - len(self.problems)} more problems not listed")
        return "\n".join(lines)

    def dropped(self, listed: int = 5) -> str:
        """What was skipped, counted per reason, and the first `listed` problems (for an error message)."""
        counts = [f"{getattr(self, counter):,} {what}" for counter, what in DROPPED.items() if getattr(self, counter)]
        if not counts:
            return ""
        total = sum(getattr(self, counter) for counter in DROPPED) + self.invalid_utf8_replaced
        lines = [f"read {self.files:,} file(s), {self.documents:,} document(s); skipped: {'; '.join(counts)}"]
        lines += [f"  {problem}" for problem in self.problems[:listed]]
        if total > listed:
            lines.append(f"  ... and {total - min(listed, len(self.problems))} more")
        return "\n".join(lines)


# -----------------------------------------------------------------------------
# Parallel, ordered, bounded map (shared with data/embedded.py)


def parallel_map(fn: Callable, items: Iterable, workers: int, initializer: Callable | None = None) -> Iterator:
    """`map(fn, items)` over `workers` processes, results in input order, at most 2*workers tasks in flight.

    Unlike `Pool.imap`, the input is consumed lazily, so a corpus larger than memory streams through.
    """
    if workers <= 1:
        if initializer is not None:
            initializer()
        yield from map(fn, items)
        return
    with multiprocessing.Pool(workers, initializer=initializer) as pool:
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


def _init_encoder() -> None:
    gpt2_tokenizer()


def encode_batch(texts: list[str]) -> np.ndarray:
    """<|endoftext|> + tokens for each text, concatenated (uint16)."""
    enc = gpt2_tokenizer()
    pieces = []
    for text in texts:
        pieces.append(np.array([EOT_TOKEN], dtype=np.uint16))
        pieces.append(np.array(enc.encode_ordinary(text), dtype=np.uint16))
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
    """Cuts a token stream into `<prefix>_val_000000.bin` (val_tokens) and train shards (shard_tokens each)."""

    def __init__(self, out_dir: Path, prefix: str, shard_tokens: int, val_tokens: int, destination: Path):
        self.out_dir, self.prefix, self.destination = out_dir, prefix, destination  # written to, then moved to
        self.shard_tokens, self.val_tokens = shard_tokens, val_tokens
        self.buffer = np.empty(max(shard_tokens, val_tokens), dtype=np.uint16)
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
        if self.fill:
            self._flush()
        return self.records


@contextlib.contextmanager
def named_write_errors(path: Path, size_flag: str | None = None, tokens: int = 0) -> Iterator[None]:
    """Turn an OSError while writing `path` (a full disk, the file-size limit of `ulimit -f`, no permission) into a
    TokenizeError naming the file, the free space and what to do; a shard's `tokens` are set by data.tokenize's
    `size_flag`."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        free = shutil.disk_usage(path.parent).free
        fix = "free some space, or choose another --out"
        if exc.errno == errno.EFBIG:
            fix = "the file exceeds the file-size limit (`ulimit -f`) or the largest file of the filesystem: raise " \
                  "the limit" + (f", or make smaller shards with data.tokenize's {size_flag} (this one: {tokens:,} "
                                 f"tokens, {HEADER_BYTES + 2 * tokens:,} bytes)" if size_flag else "")
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = "choose an --out you may write to"
        raise TokenizeError(f"could not write {path}: {reason} ({free / 2**20:,.0f} MiB free there); {fix}; "
                            "earlier outputs in --out are untouched") from exc


def existing_outputs(out_dir: Path, prefix: str) -> list[Path]:
    """Shards and manifest of an earlier run with this prefix in `out_dir`."""
    names = [f"{prefix}_val_*.bin", f"{prefix}_train_*.bin", f"{prefix}_manifest.json"]
    return sorted(p for name in names for p in out_dir.glob(name))


def _staging_dir(out_dir: Path, prefix: str) -> Path:
    """Where this process writes the shards of `prefix` before they replace the outputs in `out_dir`; staging
    directories of processes that no longer run (killed mid-run) are removed."""
    for stale in out_dir.glob(f".{prefix}.*.tmp"):
        pid = stale.name.removeprefix(f".{prefix}.").removesuffix(".tmp")
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    staging = out_dir / f".{prefix}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


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

    The validation shard holds the first `val_tokens` tokens (default: one shard's worth, as llm.c), or, with
    `val_fraction`, that fraction of all tokens (this keeps the whole token stream in memory: small corpora only).
    `metadata()` (sources, counts, ...), called after the last document is read, is stored in the manifest. Earlier
    outputs with this prefix are an error unless `overwrite`, which replaces them once the new shards are complete
    (written to a staging directory in `out_dir` first: for a while both take disk space); a run that fails leaves
    them untouched and removes what it wrote.
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
    old = existing_outputs(out_dir, prefix)
    if old and not overwrite:
        raise TokenizeError(
            f"{out_dir} already holds {len(old)} '{prefix}' shard/manifest files (e.g. {old[0].name}); "
            "choose another --out/--prefix or pass --overwrite to replace them"
        )
    ensure_gpt2_ranks()  # fetch once here, not in every worker
    workers = workers or default_workers()
    created = not out_dir.exists()
    staging = _staging_dir(out_dir, prefix)
    try:
        chunks = parallel_map(encode_batch, _batches(documents), workers, initializer=_init_encoder)
        bar = tqdm(unit="tok", unit_scale=True, desc=f"tokenizing {prefix}", disable=not progress, file=sys.stderr)
        chunks = _counted(chunks, bar)
        if val_fraction is not None:
            chunks = list(chunks)
            total = sum(c.size for c in chunks)
            val_tokens = max(1, round(total * val_fraction))
        writer = _ShardWriter(staging, prefix, shard_tokens, val_tokens or shard_tokens, out_dir)
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
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # only when nothing was written: a failed run into a new directory leaves none
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


def _counted(chunks: Iterator[np.ndarray], bar: tqdm) -> Iterator[np.ndarray]:
    for chunk in chunks:
        bar.update(chunk.size)
        yield chunk


# -----------------------------------------------------------------------------
# Reading documents from files


def resolve_sources(patterns: Iterable[str]) -> list[Path]:
    """Files named by `patterns` (paths or globs), each glob's matches sorted, duplicates dropped, order kept."""
    paths: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise TokenizeError(f"{pattern!r} matches no files")
        for match in matches:
            path = Path(match)
            if not path.is_file():
                raise TokenizeError(f"{path}: no such file")
            if path.suffix.lower() not in SUFFIXES:
                raise TokenizeError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
            if path not in paths:
                paths.append(path)
    return paths


def _decode(data: bytes, where: str, utf8_errors: str, stats: CorpusStats) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if utf8_errors == "skip":
            stats.note("invalid_utf8_skipped", f"{where}: invalid UTF-8 ({e.reason} at byte {e.start}); skipped")
            return None
        stats.note("invalid_utf8_replaced",
                   f"{where}: invalid UTF-8 ({e.reason} at byte {e.start}); replaced with U+FFFD")
        return data.decode("utf-8", errors="replace")


def _read_txt(path: Path, utf8_errors: str, txt_split: str, stats: CorpusStats) -> Iterator[str]:
    data = path.read_bytes()
    if txt_split == "file":
        parts = [(str(path), data)]
    else:
        parts = [(f"{path}:{i + 1}", line) for i, line in enumerate(data.splitlines()) if line.strip()]
    for where, part in parts:
        text = _decode(part, where, utf8_errors, stats)
        if text is not None:
            yield text


def _read_jsonl(path: Path, text_field: str, utf8_errors: str, stats: CorpusStats) -> Iterator[str]:
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            if not raw.strip():
                continue
            where = f"{path}:{i + 1}"
            line = _decode(raw, where, utf8_errors, stats)
            if line is None:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                stats.note("bad_json_lines", f"{where}: not JSON ({e.msg})")
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                found = (f"fields: {', '.join(map(str, record)) or 'none'}" if isinstance(record, dict)
                         else "not an object")
                stats.note("missing_field", f"{where}: no string field {text_field!r} ({found}; see --text-field)")
                continue
            yield text


def _read_parquet(path: Path, text_field: str, stats: CorpusStats) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TokenizeError(f"{path}: reading parquet needs pyarrow; `pip install pyarrow`") from None
    try:
        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            stats.note("unreadable_files", f"{path}: no column {text_field!r} (columns: {parquet.schema_arrow.names}); "
                       "see --text-field")
            return
        for batch in parquet.iter_batches(columns=[text_field], batch_size=4096):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str):
                    yield text
                else:
                    stats.note("missing_field", f"{path}: row with null/non-string {text_field!r}")
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError, ArrowIOError an OSError
        stats.note("unreadable_files", f"{path}: unreadable parquet ({e}); documents read before the error are kept")


def iter_documents(
    paths: Iterable[Path],
    stats: CorpusStats,
    *,
    text_field: str = "text",
    utf8_errors: str = "replace",
    txt_split: str = "file",
) -> Iterator[str]:
    """Documents of `paths` in order; problems are counted in `stats`.

    `.txt`: the whole file (txt_split="file") or each non-blank line ("line") is a document; `.jsonl`: one JSON object
    per line, text in `text_field`; `.parquet`: column `text_field`. Empty documents are skipped (counted).
    """
    if utf8_errors not in ("replace", "skip"):
        raise TokenizeError(f"utf8_errors must be 'replace' or 'skip' (got {utf8_errors!r})")
    if txt_split not in ("file", "line"):
        raise TokenizeError(f"txt_split must be 'file' or 'line' (got {txt_split!r})")
    for path in paths:
        stats.files += 1
        if path.stat().st_size == 0:
            stats.note("empty_files", f"{path}: empty file")
            continue
        suffix = path.suffix.lower()
        if suffix == ".txt":
            docs = _read_txt(path, utf8_errors, txt_split, stats)
        elif suffix == ".jsonl":
            docs = _read_jsonl(path, text_field, utf8_errors, stats)
        elif suffix == ".parquet":
            docs = _read_parquet(path, text_field, stats)
        else:
            raise TokenizeError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(SUFFIXES)}")
        for text in docs:
            if not text.strip():
                stats.note("empty_documents", f"{path}: empty document")
                continue
            stats.documents += 1
            stats.text_bytes += len(text.encode("utf-8", errors="surrogatepass"))
            yield text


def fetch_hub_files(repo: str, pattern: str, max_files: int | None = None, *, revision: str | None = None,
                    endpoint: str | None = None, cache_dir: Path | None = None) -> list[tuple[str, Path]]:
    """Download the files of Hub dataset `repo` whose names match glob `pattern` (sorted; the first `max_files`);
    return (name in the repo, local path) pairs.

    Files go to the huggingface_hub cache (`cache_dir`, default ~/.cache/huggingface/hub), which makes reruns free.
    """
    from huggingface_hub import HfApi, hf_hub_download

    try:
        names = HfApi(endpoint=endpoint).list_repo_files(repo, repo_type="dataset", revision=revision)
    except Exception as e:  # network, auth or a missing repo: the same advice for all
        raise TokenizeError(f"cannot list Hub dataset {repo!r} ({type(e).__name__}: {e}); check the name, your "
                            "network / HF_TOKEN, or download the files yourself and pass them as local paths") from e
    names = sorted(n for n in names if fnmatch.fnmatch(n, pattern))[:max_files]
    if not names:
        raise TokenizeError(f"no files in Hub dataset {repo!r} match {pattern!r} (see --hub-pattern)")
    files = []
    for name in tqdm(names, desc=f"downloading {repo}", unit="file", file=sys.stderr):
        try:
            path = hf_hub_download(repo, name, repo_type="dataset", revision=revision, endpoint=endpoint,
                                   cache_dir=cache_dir)
        except Exception as e:
            raise TokenizeError(f"downloading {name} from Hub dataset {repo!r} failed ({type(e).__name__}: {e}); "
                                "rerun to resume") from e
        files.append((name, Path(path)))
    return files


# -----------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tokenize text corpora into GPT-2 token shards (docs/data.md).")
    parser.add_argument("inputs", nargs="*", help="local .txt/.jsonl/.parquet files or globs (quote globs)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--prefix", default="corpus", help="shard name prefix: <prefix>_val_000000.bin, ...")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--val-tokens", type=int, default=None,
                        help="tokens in the val shard (default: --shard-tokens)")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="instead of --val-tokens: this fraction of all tokens (held in memory: small corpora)")
    parser.add_argument("--text-field", default="text", help="jsonl key / parquet column holding the text")
    parser.add_argument("--txt-split", choices=("file", "line"), default="file",
                        help="a .txt document is the whole file or each non-blank line")
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
    parser.add_argument("--hub-revision", default=None)
    parser.add_argument("--hub-endpoint", default=None, help="default: $HF_ENDPOINT or huggingface.co")
    args = parser.parse_args(argv)
    if Path(args.prefix).name != args.prefix or args.prefix.strip(".") == "":
        parser.error(f"--prefix {args.prefix!r}: a name for the shard files, without '/' (put the directory in --out, "
                     "e.g. --out data/mine --prefix mine)")
    stats = CorpusStats()
    try:
        paths = resolve_sources(args.inputs)
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
    except (TokenizeError, OSError) as e:  # an OSError of reading names its file
        sys.exit("\n".join(filter(None, [f"error: {e}", stats.dropped()])))
    print(f"{manifest['tokens']:,} tokens from {stats.documents:,} documents in {len(manifest['shards'])} shards "
          f"-> {args.out}")
    print(f"read: {stats.summary()}")
    train_glob, val_glob = shard_globs(args.out, args.prefix)
    print(f"train files: {train_glob}\nval files:   {val_glob}")


if __name__ == "__main__":
    main()
