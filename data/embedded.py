"""The embedded default corpus: docstrings and comments of the installed Python, tokenized into shards (docs/data.md).

It needs no network, so a fresh checkout can train (smoke runs, tests, CI) before any download. Sources, in order:
every `.py` file of the standard library (`sysconfig` "stdlib", without site-packages/dist-packages), then of
site-packages ("purelib", then "platlib" if different); each tree walked with directories and files sorted, skipping
`__pycache__`. One module is one document: its docstrings (`ast`) and comments (a regex scan) in source order; files
that do not parse are skipped and counted. The text is capped at `max_bytes` UTF-8 bytes (the last module is cut),
default 16 MB ~ 4.5M tokens, which takes ~30 s single-core (extraction dominates; it runs on all cores). The output
is deterministic for a given environment; the manifest records the Python version and a fingerprint (path, size) of
the files read, and the cache is rebuilt when any of them changes.

Shards go to `<cache>/embedded/` (`<repo>/data/cache`, or `$SYMGPT_CACHE`): `embedded_val_000000.bin` (the first
`val_fraction` of the tokens), `embedded_train_000001.bin`, ... and `embedded_manifest.json`.

    python -m data.embedded [--max-bytes N] [--out DIR]
    python -m data.embedded --text notes/*.txt [--out DIR]     # the same kind of shards from your own text files
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import sys
import sysconfig
import tokenize
from pathlib import Path


from cli import ArgumentParser, progress_bar
from data.shards import ShardError, read_shard_header, shard_globs
from data.tokenize import TokenizeError, default_workers, documents_to_shards, parallel_map
from data.tokenize import main as tokenize_main
from data.shards import cache_root

PREFIX = "embedded"
DEFAULT_MAX_BYTES = 16_000_000
DEFAULT_VAL_FRACTION = 0.05
SHARD_TOKENS = 2_000_000
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass
class ExtractStats:
    """Files visited, modules kept, files skipped (unparsable, no docstrings/comments), text kept."""

    files: int = 0
    modules: int = 0
    unparsable: int = 0
    empty: int = 0
    text_bytes: int = 0
    truncated: bool = False


def python_source_roots() -> list[Path]:
    """Standard library first, then site-packages (purelib, platlib), without duplicates."""
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        root = Path(paths[key])
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def python_files(roots: list[Path]) -> list[Path]:
    """`.py` files under `roots`, root by root, walked in sorted order (SKIP_DIRS pruned)."""
    files = []
    for root in roots:
        for directory, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            files += [Path(directory) / n for n in sorted(names) if n.endswith(".py")]
    return files


# String literals (skipped) or a comment (group 1). On source that parses this finds exactly tokenize's COMMENT
# tokens (checked on the stdlib and site-packages here) at ~6x its speed on Python 3.11.
_STRING_OR_COMMENT = re.compile(
    r"""'''(?:\\.|[^\\])*?'''|\"\"\"(?:\\.|[^\\])*?\"\"\"|'(?:\\.|[^\\'\n])*'|"(?:\\.|[^\\"\n])*"|#([^\r\n]*)""",
    re.S,
)


def module_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every non-empty comment of valid Python `source`, without the leading #s."""
    comments, line, position = [], 1, 0
    for match in _STRING_OR_COMMENT.finditer(source):
        if match.group(1) is not None:
            line += source.count("\n", position, match.start())
            position = match.start()
            text = match.group(1).lstrip("#").strip()
            if text:
                comments.append((line, text))
    return comments


def module_text(path: Path) -> str | None:
    """Docstrings and comments of one module in source order ("" if it has none); None if it does not parse.

    Comments on consecutive lines form one paragraph; everything else is separated by a blank line.
    """
    try:
        raw = path.read_bytes()
        tree = ast.parse(raw)
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        source = raw.decode(encoding)
    except (SyntaxError, ValueError, UnicodeError, LookupError, RecursionError, MemoryError, OSError):
        return None
    pieces = [(line, True, text) for line, text in module_comments(source)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                pieces.append((node.body[0].lineno, False, doc))
    pieces.sort(key=lambda piece: piece[0])
    text, previous = [], None
    for line, is_comment, body in pieces:
        if text:
            text.append("\n" if is_comment and previous == (line - 1, True) else "\n\n")
        text.append(body)
        previous = (line, is_comment)
    return "".join(text)


def extract_corpus(files: list[Path], max_bytes: int, workers: int = 1, progress: bool = False
                   ) -> tuple[list[str], ExtractStats]:
    """Module texts of `files` in order up to `max_bytes` UTF-8 bytes (the last one cut); stats.files: files visited."""
    if max_bytes < 1:
        raise TokenizeError(f"max_bytes must be >= 1 (got {max_bytes})")
    docs, stats = [], ExtractStats()
    bar = progress_bar(total=max_bytes, unit="B", unit_scale=True, desc="extracting text", disable=not progress)
    for text in parallel_map(module_text, files, workers):
        stats.files += 1
        if text is None:
            stats.unparsable += 1
            continue
        if not text:
            stats.empty += 1
            continue
        data = text.encode("utf-8", errors="replace")  # lone surrogates from escapes in docstrings become "?"
        room = max_bytes - stats.text_bytes
        stats.truncated = len(data) > room
        text = data[:room].decode("utf-8", errors="ignore")  # a cut lands on a character boundary
        if text:
            docs.append(text)
            stats.modules += 1
            size = len(text.encode("utf-8"))
            stats.text_bytes += size
            bar.update(size)
        if stats.truncated or stats.text_bytes >= max_bytes:
            break
    bar.close()
    return docs, stats


def _fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path}\0{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def _manifest_is_current(out_dir: Path, expected: dict, files: list[Path]) -> bool:
    """Whether `out_dir` holds a complete corpus built with `expected` settings from the same files."""
    try:
        manifest = json.loads((out_dir / f"{PREFIX}_manifest.json").read_text())
        if any(manifest.get(k) != v for k, v in expected.items()):
            return False
        visited = manifest["files_visited"]
        if visited > len(files) or manifest["files_sha256"] != _fingerprint(files[:visited]):
            return False
        return all(read_shard_header(out_dir / s["name"]) == s["tokens"] for s in manifest["shards"])
    except (OSError, ValueError, KeyError, TypeError, ShardError):
        return False


def prepare_embedded_corpus(
    cache_dir: Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    *,
    roots: list[Path] | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> tuple[str, str]:
    """Build (or reuse) the embedded corpus shards; return (train_glob, val_glob) for the trainer.

    `cache_dir` defaults to `cache_root()/embedded`; `roots` to `python_source_roots()`. Reuses the cache when its
    manifest matches the settings, Python version and source files; otherwise builds in a temporary sibling
    directory and renames it into place, so concurrent callers never see a half-written corpus.
    """
    out_dir = Path(cache_dir) if cache_dir is not None else cache_root() / PREFIX
    roots = [Path(r) for r in roots] if roots is not None else python_source_roots()
    files = python_files(roots)
    expected = {"corpus": PREFIX, "python": sys.version, "roots": [str(r) for r in roots],
                "max_bytes": max_bytes, "val_fraction": val_fraction}
    if _manifest_is_current(out_dir, expected, files):
        return shard_globs(out_dir, PREFIX)
    workers = workers or default_workers()
    docs, stats = extract_corpus(files, max_bytes, workers, progress)
    if not docs:
        raise TokenizeError(f"no docstrings or comments found under {', '.join(map(str, roots))}")
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    metadata = {**expected, "files_visited": stats.files, "files_sha256": _fingerprint(files[:stats.files]),
                "extraction": dataclasses.asdict(stats)}
    documents_to_shards(docs, tmp_dir, PREFIX, shard_tokens=SHARD_TOKENS, val_fraction=val_fraction,
                        workers=workers, metadata=lambda: metadata, progress=progress)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    try:
        tmp_dir.rename(out_dir)
    except OSError:  # another process renamed its (identical) build into place first
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not _manifest_is_current(out_dir, expected, files):
            raise
    return shard_globs(out_dir, PREFIX)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="data.embedded",
                            description="Build the embedded corpus (or shards from local text files).")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help="cap on the extracted text (UTF-8 bytes)")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                        help="fraction of the tokens in the validation shard")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: data/cache/embedded (or data/cache/text with --text)")
    parser.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="instead: shards with prefix 'text' from these .txt/.jsonl/.parquet files or globs "
                        "(one document per .txt file; replaces earlier text_* shards in --out)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    args = parser.parse_args(argv)
    if args.text is not None:
        out = args.out or cache_root() / "text"
        workers = ["--workers", str(args.workers)] if args.workers else []
        tokenize_main([*args.text, "--out", str(out), "--prefix", "text", "--shard-tokens", str(SHARD_TOKENS),
                       "--val-fraction", str(args.val_fraction), "--overwrite", *workers])
        return
    try:
        train_glob, val_glob = prepare_embedded_corpus(args.out, args.max_bytes, args.val_fraction,
                                                      workers=args.workers, progress=True)
    except TokenizeError as e:
        sys.exit(f"error: {e}")
    print(f"train files: {train_glob}\nval files:   {val_glob}")


if __name__ == "__main__":
    main()
