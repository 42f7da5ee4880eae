"""The embedded default corpus (docs/data.md#other-corpora): a text shipped in the repository, the docstrings and
comments of CPython 3.11.7's standard library, pinned by its sha256 (TEXT_SHA256) so that every installation builds
the same shards, with no network: `<cache>/embedded/` (`data/cache` or `$SYMGPT_CACHE`), rebuilt only when the text
or the settings change.

    python -m data.embedded [--out DIR]
    python -m data.embedded --text notes/*.txt [--out DIR]     # the same kind of shards from your own text files

`--write-text` regenerates the text from the running Python's standard library (`module_text`: docstrings via
`ast`, comments via a string-aware scan, in source order): for maintainers only, since another text is another
corpus, whose numbers do not compare with the old one's; pin the sha256 it prints.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import sysconfig
import tokenize
from pathlib import Path

from cli import ArgumentParser
from data.shards import ShardError, cache_root, read_shard_header, shard_globs
from data.tokenize import TokenizeError, default_workers, documents_to_shards, parallel_map
from data.tokenize import main as tokenize_main
from fileio import exits_on_filesystem_errors

PREFIX = "embedded"
TEXT_FILE = Path(__file__).resolve().parent / "embedded_corpus" / "python-3.11-stdlib.jsonl.gz"
TEXT_SHA256 = "6e1fc1ac6b0dbd466c6836e2c146caf1b58494fbe948c7fce17737f99e703041"
TEXT_MAX_BYTES = 2_000_000
DEFAULT_VAL_FRACTION = 0.05
SHARD_TOKENS = 2_000_000
# Left out of the text: other packages, tests, the IDE and demos (their comments are code more than prose)
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "turtledemo", "ensurepip",
             "lib2to3", "tkinter", "pydoc_data", "encodings"}


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


def write_text(path: Path = TEXT_FILE, max_bytes: int = TEXT_MAX_BYTES, workers: int = 1) -> str:
    """Write the embedded text from the running Python's standard library (see the module docstring): gzipped JSON
    lines {"module", "text"}, whole modules in sorted order up to `max_bytes` of text. Returns the sha256 of the
    uncompressed lines, to pin as TEXT_SHA256."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = python_files([root])
    lines, size = [], 0
    for path_read, text in zip(files, parallel_map(module_text, files, workers)):
        if not text:  # no docstring or comment, or not parsable
            continue
        text = text.encode("utf-8", errors="replace").decode("utf-8")  # lone surrogates of escapes become "?"
        size += len(text.encode("utf-8"))
        if size > max_bytes:
            break
        module = ".".join(path_read.relative_to(root).with_suffix("").parts)
        lines.append(json.dumps({"module": module, "text": text}, ensure_ascii=False) + "\n")
    data = "".join(lines).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def read_text(path: Path = TEXT_FILE, sha256: str = TEXT_SHA256) -> list[str]:
    """The documents of the embedded text, after checking its sha256 (a changed file is an error naming it)."""
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as exc:
        raise TokenizeError(f"{path}: cannot read the embedded text ({exc}); restore it with `git checkout -- "
                            f"{path.name}` in {path.parent}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise TokenizeError(f"{path}: sha256 {digest[:16]}.. is not the pinned {sha256[:16]}..: the embedded text "
                            "was changed, so its numbers would not compare with other installations'; restore it "
                            f"with `git checkout -- {path.name}` in {path.parent}")
    return [json.loads(line)["text"] for line in data.decode("utf-8").splitlines()]


def _manifest_is_current(out_dir: Path, expected: dict) -> bool:
    """Whether `out_dir` holds a complete corpus built with `expected` settings from the same text."""
    try:
        manifest = json.loads((out_dir / f"{PREFIX}_manifest.json").read_text())
        if any(manifest.get(k) != v for k, v in expected.items()):
            return False
        return all(read_shard_header(out_dir / s["name"]) == s["tokens"] for s in manifest["shards"])
    except (OSError, ValueError, KeyError, TypeError, ShardError):
        return False


def prepare_embedded_corpus(cache_dir: Path | None = None, val_fraction: float = DEFAULT_VAL_FRACTION, *,
                            text: Path = TEXT_FILE, workers: int | None = None, progress: bool = True
                            ) -> tuple[str, str]:
    """Build (or reuse) the embedded corpus shards; return (train_glob, val_glob) for the trainer.

    `cache_dir` defaults to `cache_root()/embedded`. Reuses the cache when its manifest names the same text
    (sha256) and settings; otherwise builds in a temporary sibling directory and renames it into place, so
    concurrent callers never see a half-written corpus.
    """
    out_dir = Path(cache_dir) if cache_dir is not None else cache_root() / PREFIX
    expected = {"corpus": PREFIX, "text": Path(text).name, "text_sha256": TEXT_SHA256, "val_fraction": val_fraction}
    if _manifest_is_current(out_dir, expected):
        return shard_globs(out_dir, PREFIX)
    docs = read_text(Path(text))
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    documents_to_shards(docs, tmp_dir, PREFIX, shard_tokens=SHARD_TOKENS, val_fraction=val_fraction,
                        workers=workers, metadata=lambda: expected, progress=progress)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    try:
        tmp_dir.rename(out_dir)
    except OSError:  # another process renamed its (identical) build into place first
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not _manifest_is_current(out_dir, expected):
            raise
    return shard_globs(out_dir, PREFIX)


@exits_on_filesystem_errors("--out")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="data.embedded",
                            description="Build the embedded corpus (or shards from local text files).")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                        help="fraction of the tokens in the validation shard")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: data/cache/embedded (or data/cache/text with --text)")
    parser.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="instead: shards with prefix 'text' from these files or globs (plain text, .jsonl or "
                        ".parquet; one document per text file; replaces earlier text_* shards in --out)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument("--write-text", action="store_true",
                        help=f"maintainers: regenerate {TEXT_FILE.name} from this Python's standard library "
                        "(another text is another corpus) and print its sha256 to pin")
    args = parser.parse_args(argv)
    if args.write_text:
        print(f"{TEXT_FILE}: sha256 {write_text(workers=args.workers or default_workers())} (pin as TEXT_SHA256)")
        return
    if args.text is not None:
        out = args.out or cache_root() / "text"
        workers = ["--workers", str(args.workers)] if args.workers else []
        tokenize_main([*args.text, "--out", str(out), "--prefix", "text", "--shard-tokens", str(SHARD_TOKENS),
                       "--val-fraction", str(args.val_fraction), "--overwrite", *workers])
        return
    try:
        train_glob, val_glob = prepare_embedded_corpus(args.out, args.val_fraction, workers=args.workers)
    except TokenizeError as e:
        e.exit()
    print(f"train files: {train_glob}\nval files:   {val_glob}")


if __name__ == "__main__":
    main()
