"""Documents from files: local text, jsonl and parquet files (any other readable file is plain text), or the
files of a Hugging Face Hub dataset repo. Bad input is never dropped silently: what was read, skipped (DROPPED) or
repaired is counted, reported and kept in data.tokenize's manifest (docs/data.md#other-corpora)."""
from __future__ import annotations

import codecs
import contextlib
import dataclasses
import fnmatch
import glob
import json
import os
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path

from cli import progress_bar
from fileio import FILESYSTEM_ERROR_EXIT, doing, print_error

MAX_PROBLEMS_LISTED = 50
DROPPED = {  # CorpusStats counters of input that yields no document, and what each counts
    "empty_files": "empty files",
    "binary_files": "binary files (NUL bytes: not UTF-8 text)",
    "empty_documents": "empty documents",
    "invalid_utf8_skipped": "documents with invalid UTF-8 (--utf8-errors skip)",
    "bad_json_lines": "jsonl lines that are not JSON",
    "missing_field": "records without a string text field (see --text-field)",
    "unreadable_files": "parquet files without the text column or unreadable",
    "duplicate_files": "files named again (another path to a file already read: a symlink, an overlapping glob)",
}


class TokenizeError(ValueError):
    """Bad arguments or input for tokenization, or an output it could not write; the message names the file or flag
    and what to do."""

    def exit(self, *notes: str) -> typing.NoReturn:
        """End the tool with this error on one line (`notes` after it): exit status 1, or 2 for an output it could not
        write (a filesystem error: docs/runs.md#filesystem-errors)."""
        text = "\n".join(filter(None, [f"error: {self}", *notes]))
        if not isinstance(self.__cause__, OSError):
            raise SystemExit(text)
        print_error(text.removeprefix("error: "))
        raise SystemExit(FILESYSTEM_ERROR_EXIT)


@dataclasses.dataclass
class CorpusStats:
    """What was read, and what was skipped or repaired (and why)."""

    files: int = 0
    documents: int = 0
    text_bytes: int = 0
    empty_files: int = 0
    binary_files: int = 0
    empty_documents: int = 0
    invalid_utf8_replaced: int = 0
    invalid_utf8_skipped: int = 0
    bad_json_lines: int = 0
    missing_field: int = 0
    unreadable_files: int = 0
    duplicate_files: int = 0
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


def resolve_sources(patterns: Iterable[str], stats: CorpusStats | None = None) -> list[Path]:
    """Files named by `patterns` (paths or globs; `**` recursive: expand_glob), each glob's matches sorted (folders
    left out), order kept, and each file once: a path to a file already listed (the same path again, a symlink to
    it, or the same file through a symlinked folder) is dropped and counted in `stats` (duplicate_files)."""
    paths: list[Path] = []
    seen: dict[tuple[int, int], Path] = {}  # (device, inode) -> the path that named the file first
    for pattern in patterns:
        matches = sorted(expand_glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise TokenizeError(f"{pattern!r} matches no files")
        for match in matches:
            path, real = Path(match), Path(os.path.realpath(match))
            if real.is_dir() and glob.has_magic(pattern):  # `notes/**` matches folders too
                continue
            if not real.is_file():
                what = "a directory: give its files, e.g. DIR/**/*" if real.is_dir() else "no such file"
                raise TokenizeError(f"{path}: {what}")
            info = real.stat()
            first = seen.setdefault((info.st_dev, info.st_ino), path)
            if first is path:
                paths.append(path if os.path.exists(path) else real)  # a path through more links than followed
            elif stats is not None:
                stats.note("duplicate_files", f"{path}: the same file as {first}; read once")
    return paths


def expand_glob(pattern: str) -> list[str]:
    """What glob.glob(pattern, recursive=True) names, except that a `**` walks each folder once (by device and
    inode, subfolders in name order), so that links back to a folder already walked (a loop, however many links
    form it) end the walk instead of multiplying it: Python's glob follows them until the path is too long, which
    with two links in a folder is 2^40 paths."""
    parts = Path(pattern).parts
    if "**" not in parts:
        return glob.glob(pattern)
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root, wanted = Path(*parts[:fixed]) if fixed else Path("."), parts[fixed:]
    found, walked = [], set()
    for folder, folders, files in os.walk(root, followlinks=True):
        folders.sort()
        with contextlib.suppress(OSError):
            info = os.stat(folder)
            if (info.st_dev, info.st_ino) in walked:
                folders[:] = []
                continue
            walked.add((info.st_dev, info.st_ino))
        inside = Path(folder).relative_to(root).parts
        found += [str(Path(folder, name)) for name in folders + files if _glob_matches(wanted, (*inside, name))]
    return found


def _glob_matches(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether path components `parts` match glob components `pattern` as glob does: `**` any number of folders,
    and no wildcard matches a name that starts with a dot unless its component does."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return _glob_matches(rest, parts) or (bool(parts) and not parts[0].startswith(".")
                                              and _glob_matches(pattern, parts[1:]))
    return (bool(parts) and fnmatch.fnmatchcase(parts[0], head)
            and (head.startswith(".") or not parts[0].startswith(".")) and _glob_matches(rest, parts[1:]))


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


def _read_text(path: Path, utf8_errors: str, txt_split: str, stats: CorpusStats) -> Iterator[str]:
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # a byte-order mark says UTF-8; it is not text
    if b"\0" in data:
        stats.note("binary_files", f"{path}: NUL bytes, so not UTF-8 text (a binary file?); skipped")
        return
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
            raw = raw.removeprefix(codecs.BOM_UTF8) if i == 0 else raw
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
    """Documents of `paths` in order (`.jsonl`: field `text_field` of each line; `.parquet`: column `text_field`; any
    other file: UTF-8 text, one document per file or per non-blank line by `txt_split`); every skip is counted in
    `stats`."""
    for path in paths:
        stats.files += 1
        with doing("read", path):  # an OSError names the file it was reading
            if path.stat().st_size == 0:
                stats.note("empty_files", f"{path}: empty file")
                continue
            suffix = path.suffix.lower()
            if suffix == ".jsonl":
                docs = _read_jsonl(path, text_field, utf8_errors, stats)
            elif suffix == ".parquet":
                docs = _read_parquet(path, text_field, stats)
            else:
                docs = _read_text(path, utf8_errors, txt_split, stats)
            for text in docs:
                if not text.strip():
                    stats.note("empty_documents", f"{path}: empty document")
                    continue
                stats.documents += 1
                stats.text_bytes += len(text.encode("utf-8", errors="surrogatepass"))
                yield text


def fetch_hub_files(repo: str, pattern: str, max_files: int | None = None, *, revision: str | None = None,
                    endpoint: str | None = None, cache_dir: Path | None = None) -> list[tuple[str, Path]]:
    """(name in the repo, local path) of the files of Hub dataset `repo` whose names match glob `pattern` (sorted;
    the first `max_files`), downloaded into the huggingface_hub cache (`cache_dir`), which makes reruns free."""
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
    for name in progress_bar(names, desc=f"downloading {repo}", unit="file"):
        try:
            path = hf_hub_download(repo, name, repo_type="dataset", revision=revision, endpoint=endpoint,
                                   cache_dir=cache_dir)
        except Exception as e:
            raise TokenizeError(f"downloading {name} from Hub dataset {repo!r} failed ({type(e).__name__}: {e}); "
                                "rerun to resume") from e
        files.append((name, Path(path)))
    return files


