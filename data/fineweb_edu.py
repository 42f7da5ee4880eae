"""Download the pre-tokenized FineWeb-Edu 10B shards of `kjj0/finewebedu10B-gpt2` from the Hugging Face Hub
(docs/data.md#fineweb-edu): idempotent, resumable, and every new file validated (header, size, ids, sha256 against
the Hub's LFS etag) and fetched once more if it fails.

    python -m data.fineweb_edu                 # val + all 99 train shards (~20 GB) into data/fineweb_edu/
    python -m data.fineweb_edu --chunks 8      # val + the first 8 train shards (~1.8 GB, 800M tokens)

Offline, it stops at the first file it cannot fetch and says what to do instead.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from cli import ArgumentParser, progress_bar
from data.shards import (DIGEST_CACHE, GPT2_VOCAB, REPO_ROOT, ShardError, cache_root, open_shard, read_shard_header,
                         remember_sha256, sha256_file, shard_globs)
from fileio import exits_on_filesystem_errors

DEFAULT_REPO = "kjj0/finewebedu10B-gpt2"
DEFAULT_DEST = REPO_ROOT / "data" / "fineweb_edu"
VAL_FILE = "finewebedu_val_000000.bin"
TRAIN_FORMAT = "finewebedu_train_%06d.bin"
FULL_TRAIN_CHUNKS = 99
DEFAULT_TRAIN_PATTERN, DEFAULT_VAL_PATTERN = shard_globs(DEFAULT_DEST, "finewebedu")
PROBE_TIMEOUT_S = 10


class DownloadError(RuntimeError):
    """A shard could not be fetched or failed validation; the message says what to do."""


def fineweb_shards_present(dest: str | os.PathLike = DEFAULT_DEST) -> bool:
    """Whether `dest` holds the val shard and at least one train shard, all with valid headers (no network)."""
    dest = Path(dest)
    train = sorted(dest.glob("finewebedu_train_*.bin"))
    try:
        return bool(train) and all(read_shard_header(p) >= 0 for p in [dest / VAL_FILE, *train])
    except ShardError:
        return False


def shard_names(chunks: int, val_file: str = VAL_FILE, train_format: str = TRAIN_FORMAT) -> list[str]:
    """The val file, then train files 1..chunks."""
    return [val_file] + [train_format % i for i in range(1, chunks + 1)]


def _offline_advice(dest: Path) -> str:
    return (
        "If this machine has no access to the Hugging Face Hub: (1) train on the embedded corpus (run train_gpt.py "
        "without --train-files), (2) tokenize local text with `python -m data.tokenize FILES --out DIR`, or "
        f"(3) copy finewebedu_*.bin shards from a machine with access into {dest} (they are validated here), "
        "then rerun this command to check them."
    )


def _validate(path: Path, size: int | None, sha256: str | None) -> None:
    """Header, length and token range (docs/data.md#shard-format), then the expected size and sha256 when the Hub
    gave them; a verified digest goes to the trainer's digest cache, so a run's first start need not hash the file
    again."""
    open_shard(path, vocab_size=GPT2_VOCAB)
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise ShardError(f"{path}: {actual} bytes, the Hub says {size}")
    if sha256 is not None:
        if (actual_sha256 := sha256_file(path)) != sha256:
            raise ShardError(f"{path}: sha256 {actual_sha256} differs from the Hub's {sha256}")
        remember_sha256(path, sha256, cache_root() / DIGEST_CACHE)


def _download_one(name: str, dest: Path, repo: str, revision: str | None, endpoint: str | None) -> Path:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    url = hf_hub_url(repo, name, repo_type="dataset", revision=revision, endpoint=endpoint)
    try:  # one quick HEAD without retries: fails fast offline and gives the size and the LFS sha256
        meta = get_hf_file_metadata(url, timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # connection, HTTP, offline mode: all mean this file can't be fetched now
        raise DownloadError(f"cannot reach {url} ({type(e).__name__}: {e}).\n{_offline_advice(dest)}") from e
    sha256 = meta.etag if meta.etag and re.fullmatch(r"[0-9a-f]{64}", meta.etag) else None
    path = dest / name
    problem = None
    for attempt in range(2):
        try:
            hf_hub_download(repo, name, repo_type="dataset", revision=revision, local_dir=dest, endpoint=endpoint,
                            force_download=attempt > 0)
        except Exception as e:
            raise DownloadError(f"downloading {name} from {repo} failed ({type(e).__name__}: {e}); rerun to resume.\n"
                                f"{_offline_advice(dest)}") from e
        try:
            _validate(path, meta.size, sha256)
            return path
        except ShardError as e:
            problem = e
            path.unlink(missing_ok=True)
    raise DownloadError(f"{name} from {repo} is corrupt after two downloads ({problem}); removed it. "
                        "Check the repo/revision or your network, then rerun.")


def download_shards(
    dest: str | os.PathLike = DEFAULT_DEST,
    chunks: int = FULL_TRAIN_CHUNKS,
    *,
    repo: str = DEFAULT_REPO,
    val_file: str = VAL_FILE,
    train_format: str = TRAIN_FORMAT,
    revision: str | None = None,
    endpoint: str | None = None,
    progress: bool = True,
) -> list[Path]:
    """Make `dest` hold the val shard and train shards 1..chunks of `repo`; return their paths.

    Present files that validate (header and size) are kept without network access; invalid ones are replaced.
    `endpoint` overrides HF_ENDPOINT (e.g. a mirror).
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    bar = progress_bar(shard_names(chunks, val_file, train_format), unit="shard", desc=f"{repo} -> {dest}",
                       disable=not progress)
    for name in bar:
        path = dest / name
        if path.is_file():
            try:
                read_shard_header(path)
                paths.append(path)
                continue
            except ShardError as e:
                bar.write(f"{e}; downloading it again", file=sys.stderr)
                path.unlink()
        paths.append(_download_one(name, dest, repo, revision, endpoint))
    return paths


@exits_on_filesystem_errors("--dest")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="data.fineweb_edu",
                            description="Download pre-tokenized FineWeb-Edu 10B shards (docs/data.md).")
    parser.add_argument("--chunks", type=int, default=FULL_TRAIN_CHUNKS,
                        help=f"train shards 1..N (100M tokens each; default all {FULL_TRAIN_CHUNKS})")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="directory the shards go to")
    parser.add_argument("--repo", default=DEFAULT_REPO, help="Hub dataset repo")
    parser.add_argument("--val-file", default=VAL_FILE, help="name of the validation shard in the repo")
    parser.add_argument("--train-format", default=TRAIN_FORMAT, help="printf pattern of train file names")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of the repo")
    parser.add_argument("--endpoint", default=None, help="Hub endpoint (default: $HF_ENDPOINT or huggingface.co)")
    args = parser.parse_args(argv)
    if args.chunks < 0:
        parser.error(f"--chunks must be >= 0 (got {args.chunks})")
    try:
        paths = download_shards(args.dest, args.chunks, repo=args.repo, val_file=args.val_file,
                                train_format=args.train_format, revision=args.revision, endpoint=args.endpoint)
    except DownloadError as e:
        sys.exit(f"error: {e}")
    print(f"{len(paths)} shards ready in {args.dest}")
    print(f"train files: {args.dest / re.sub(r'%0?[0-9]*d', '*', args.train_format)}")
    print(f"val files:   {args.dest / args.val_file}")


if __name__ == "__main__":
    main()
