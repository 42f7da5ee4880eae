"""The GPT-2 tokenizer (tiktoken `r50k_base`) without internet access (docs/data.md#tokenizer): a verified copy of
the rank file in our cache, filled from tiktoken's cache, the `openai-whisper` sdist on PyPI or tiktoken's URL.

    python -m data.tokenizer            # fetch + verify, print the path
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

from cli import ArgumentParser
from data.shards import EOT_TOKEN, GPT2_VOCAB, cache_root
from fileio import atomic_write, exits_on_filesystem_errors

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_RANKS_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"
RANKS_FILENAME = "r50k_base.tiktoken"


class TokenizerSetupError(RuntimeError):
    """The GPT-2 rank file could not be found, fetched or verified."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tiktoken_cache_path() -> Path:
    """Where tiktoken's download cache keeps the rank file (same lookup rules as tiktoken.load.read_file_cached)."""
    base = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    base = base or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(base) / hashlib.sha1(GPT2_RANKS_URL.encode()).hexdigest()


def _from_tiktoken_cache() -> bytes | None:
    """The rank file from tiktoken's download cache, if it holds one."""
    path = _tiktoken_cache_path()
    return path.read_bytes() if path.is_file() else None


def _from_whisper_sdist() -> bytes:
    """Download the openai-whisper sdist with pip and read `whisper/assets/gpt2.tiktoken` out of it."""
    with tempfile.TemporaryDirectory(prefix="symgpt-whisper-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--timeout", "20", "--retries", "1", "-d", tmp, WHISPER_SDIST]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"`{' '.join(cmd[2:])}` failed: {result.stderr.strip()[-500:]}")
        sdists = sorted(Path(tmp).glob("*.tar.gz"))
        if not sdists:
            raise OSError(f"pip download of {WHISPER_SDIST} produced no .tar.gz")
        with tarfile.open(sdists[0]) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("/" + WHISPER_MEMBER)), None)
            if member is None:
                raise OSError(f"{sdists[0].name} has no {WHISPER_MEMBER}")
            return tar.extractfile(member).read()


def _from_url() -> bytes:
    with urllib.request.urlopen(GPT2_RANKS_URL, timeout=10) as response:
        return response.read()


def ensure_gpt2_ranks(cache_dir: Path | None = None) -> Path:
    """Path of a verified GPT-2 rank file in `cache_dir` (default `cache_root()/tiktoken`), fetching it if absent.

    A cached file whose sha256 differs from docs/data.md#shard-format is rejected (never silently used or overwritten).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "tiktoken"
    path = cache_dir / RANKS_FILENAME
    if path.is_file():
        digest = _sha256(path.read_bytes())
        if digest != GPT2_RANKS_SHA256:
            raise TokenizerSetupError(
                f"{path}: sha256 {digest} does not match the GPT-2 rank file ({GPT2_RANKS_SHA256}); "
                "the file is corrupt or not r50k_base — delete it and run `python -m data.tokenizer` to fetch it "
                "again"
            )
        return path
    failures = []
    sources = [("tiktoken cache", _from_tiktoken_cache), (f"PyPI sdist {WHISPER_SDIST}", _from_whisper_sdist),
               (GPT2_RANKS_URL, _from_url)]
    for source, fetch in sources:
        try:
            data = fetch()
        except (OSError, subprocess.SubprocessError, tarfile.TarError) as e:
            failures.append(f"{source}: {e}")
            continue
        if data is None:
            failures.append(f"{source}: not present")
        elif _sha256(data) != GPT2_RANKS_SHA256:
            failures.append(f"{source}: sha256 mismatch ({_sha256(data)})")
        else:
            atomic_write(path, data)
            return path
    raise TokenizerSetupError(
        f"could not obtain the GPT-2 rank file ({RANKS_FILENAME}, sha256 {GPT2_RANKS_SHA256}):\n  "
        + "\n  ".join(failures)
        + f"\nFix: copy `whisper/assets/gpt2.tiktoken` from the {WHISPER_SDIST} sdist (or tiktoken's "
        f"r50k_base.tiktoken) to {path}, or set SYMGPT_CACHE to a directory whose tiktoken/ subfolder holds it."
    )


def load_gpt2_ranks(path: Path) -> dict[bytes, int]:
    """Parse a verified tiktoken rank file (lines `base64(token) rank`)."""
    data = Path(path).read_bytes()
    if _sha256(data) != GPT2_RANKS_SHA256:
        raise TokenizerSetupError(f"{path}: sha256 mismatch; not the GPT-2 rank file — delete it and rerun")
    pairs = (line.split() for line in data.splitlines() if line)  # lines `base64(token) rank`
    return {base64.b64decode(token): int(rank) for token, rank in pairs}


def local_gpt2_ranks_file() -> Path | None:
    """The rank file in our cache, else in tiktoken's download cache; None when neither holds one (nothing is
    downloaded: `python -m data.tokenizer` does that)."""
    return next((path for path in (cache_root() / "tiktoken" / RANKS_FILENAME, _tiktoken_cache_path())
                 if path.is_file()), None)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters, in which vocab.json and merges.txt
    spell byte-level tokens (printable Latin-1 bytes stand for themselves, the others take chr(256 + i))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def gpt2_bpe_files() -> tuple[str, str] | None:
    """The texts of GPT-2's vocab.json and merges.txt (the files Hugging Face's GPT2Tokenizer reads), rebuilt from
    the local tiktoken ranks (local_gpt2_ranks_file, verified); None when there are none."""
    path = local_gpt2_ranks_file()
    return None if path is None else _bpe_files(path)


@functools.cache
def _bpe_files(path: Path) -> tuple[str, str]:
    """A token's id is its rank; each token of two or more bytes is the merge of the two parts that byte-level BPE
    leaves it in when only lower ranks may merge, and merges.txt lists these merges in rank order."""
    ranks = load_gpt2_ranks(path)
    alphabet = byte_alphabet()
    spell = lambda token: "".join(alphabet[b] for b in token)  # noqa: E731
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while True:  # BPE of `token` with the ranks below its own
            merged = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]
            best = min(range(len(merged)), key=merged.__getitem__)
            if merged[best] >= rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise TokenizerSetupError(f"rank {rank}: BPE leaves {len(parts)} parts, not 2; not a BPE rank file")
        merges.append(f"{spell(parts[0])} {spell(parts[1])}")
    vocab = {spell(token): rank for token, rank in ranks.items()} | {ENDOFTEXT: EOT_TOKEN}
    return json.dumps(vocab, ensure_ascii=False), "#version: 0.2\n" + "\n".join(merges) + "\n"


@functools.cache
def gpt2_tokenizer() -> tiktoken.Encoding:
    """The GPT-2 BPE encoding, identical to tiktoken's `r50k_base` (built once per process)."""
    return tiktoken.Encoding(
        name="r50k_base",
        pat_str=r50k_pat_str,
        mergeable_ranks=load_gpt2_ranks(ensure_gpt2_ranks()),
        special_tokens={ENDOFTEXT: EOT_TOKEN},
        explicit_n_vocab=GPT2_VOCAB,
    )


@exits_on_filesystem_errors("--cache-dir")
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(module="data.tokenizer",
                            description="Fetch and verify the GPT-2 BPE rank file; print its path.")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="default: $SYMGPT_CACHE/tiktoken or data/cache/tiktoken")
    args = parser.parse_args(argv)
    try:
        print(ensure_gpt2_ranks(args.cache_dir))
    except TokenizerSetupError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
