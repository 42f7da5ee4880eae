"""The offline GPT-2 tokenizer (data/tokenizer.py, docs/data.md#shard-format)."""
from __future__ import annotations

import hashlib
import random
import shutil

import pytest
import tiktoken

from data.shards import EOT_TOKEN
from data.tokenizer import (
    GPT2_RANKS_SHA256,
    GPT2_RANKS_URL,
    RANKS_FILENAME,
    TokenizerSetupError,
    ensure_gpt2_ranks,
    gpt2_tokenizer,
)


def random_text(rng: random.Random, n: int) -> str:
    pieces = ["the", " The", "  ", "\n", "\n\n", "\t", "café", " naïve", "日本語", " 😀", "!?", "'s", " don't",
              "1234", " 3.14", "<|endoftext|>", "\u200b", "Ω≈ç", " http://x.org/a?b=c", "    def f(x):"]
    return "".join(rng.choice(pieces) for _ in range(n))


def test_known_gpt2_ids():
    enc = gpt2_tokenizer()
    assert enc.n_vocab == 50257 and enc.eot_token == EOT_TOKEN == 50256
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    # byte-level base vocabulary: printable bytes from '!' (33) get ranks 0.., the others follow from 188
    assert enc.encode_ordinary("!") == [0]
    assert enc.encode_ordinary("A") == [65 - 33]
    assert enc.encode_ordinary("\n") == [188 + 10]
    assert enc.encode_ordinary(" ") == [188 + 32]


def test_round_trip_and_special_tokens():
    enc = gpt2_tokenizer()
    rng = random.Random(0)
    for _ in range(20):
        text = random_text(rng, rng.randrange(1, 60))
        ids = enc.encode_ordinary(text)
        assert EOT_TOKEN not in ids  # ordinary text never yields the separator, even "<|endoftext|>" literally
        assert enc.decode(ids) == text
        assert enc.decode(enc.encode(text, allowed_special={"<|endoftext|>"})) == text
    assert enc.encode("a<|endoftext|>b", allowed_special={"<|endoftext|>"}).count(EOT_TOKEN) == 1
    with pytest.raises(ValueError):
        enc.encode("<|endoftext|>")  # tiktoken refuses special text unless allowed


def test_matches_tiktoken_r50k_base(tmp_path, monkeypatch):
    # Serve our verified file to tiktoken through its own cache so that get_encoding works offline.
    key = hashlib.sha1(GPT2_RANKS_URL.encode()).hexdigest()
    shutil.copy(ensure_gpt2_ranks(), tmp_path / key)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    reference = tiktoken.get_encoding("r50k_base")
    ours = gpt2_tokenizer()
    rng = random.Random(1)
    texts = [random_text(rng, 40) for _ in range(20)]
    assert ours.encode_ordinary_batch(texts) == reference.encode_ordinary_batch(texts)
    assert ours.special_tokens_set == reference.special_tokens_set


def test_fetch_from_tiktoken_cache(tmp_path, monkeypatch):
    source = tmp_path / "tiktoken-cache"
    source.mkdir()
    shutil.copy(ensure_gpt2_ranks(), source / hashlib.sha1(GPT2_RANKS_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(source))
    path = ensure_gpt2_ranks(tmp_path / "ours")
    assert path == tmp_path / "ours" / RANKS_FILENAME
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GPT2_RANKS_SHA256


def test_corrupt_rank_file_rejected(tmp_path):
    good = ensure_gpt2_ranks().read_bytes()
    bad = bytearray(good)
    bad[random.Random(2).randrange(len(bad))] ^= 0x01
    (tmp_path / RANKS_FILENAME).write_bytes(bytes(bad))
    with pytest.raises(TokenizerSetupError, match="sha256.*delete it"):
        ensure_gpt2_ranks(tmp_path)
    assert (tmp_path / RANKS_FILENAME).read_bytes() == bytes(bad)  # not silently replaced
