"""data/shards.py: the docs/data.md byte layout, round trips, and errors that name the file and the problem."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from data.shards import ShardError, find_shards, open_shard, read_shard_header, shard_name, write_shard


def random_tokens(seed: int, size: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50257, size)


def test_header_bytes_follow_spec(tmp_path):
    tokens = random_tokens(0, 777)
    path = tmp_path / "s.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    assert raw[:1024] == struct.pack("<256i", 20240520, 1, 777, *([0] * 253))
    assert raw[1024:] == struct.pack(f"<{len(tokens)}H", *tokens.tolist())


def test_round_trip(tmp_path):
    tokens = random_tokens(1)
    path = tmp_path / "s.bin"
    write_shard(path, tokens.tolist())
    assert read_shard_header(path) == len(tokens)
    loaded = open_shard(path, vocab_size=50257)
    assert loaded.dtype == np.uint16
    np.testing.assert_array_equal(loaded, tokens)
    assert not list(tmp_path.glob("*.tmp"))  # written atomically through a temporary file


def test_empty_shard_round_trip(tmp_path):
    path = tmp_path / "empty.bin"
    write_shard(path, np.zeros(0, dtype=np.int64))
    assert read_shard_header(path) == 0
    assert len(open_shard(path, vocab_size=50257)) == 0


def corrupt(path, offset: int, value: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + 4] = struct.pack("<i", value)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: corrupt(p, 0, 1234), r"bad magic 1234"),
        (lambda p: corrupt(p, 4, 2), r"unsupported version 2"),
        (lambda p: p.write_bytes(p.read_bytes()[:-2]), r"header says 1000 tokens .* file has 3022 bytes"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0\0"), r"header says 1000 tokens .* file has 3026 bytes"),
        (lambda p: p.write_bytes(p.read_bytes()[:100]), r"truncated header \(100 bytes"),
        (lambda p: p.unlink(), r"no such shard file"),
    ],
    ids=["bad-magic", "wrong-version", "truncated-body", "trailing-bytes", "truncated-header", "missing"],
)
def test_damaged_shard_raises_naming_file(tmp_path, damage, message):
    path = tmp_path / "fineweb_train_000003.bin"
    write_shard(path, random_tokens(2))
    damage(path)
    for read in (read_shard_header, open_shard):
        with pytest.raises(ShardError, match=r"fineweb_train_000003\.bin: " + message):
            read(path)


def test_token_id_outside_vocab_raises_naming_file(tmp_path):
    tokens = random_tokens(3)
    tokens[417] = 50300
    path = tmp_path / "odd.bin"
    write_shard(path, tokens)
    with pytest.raises(ShardError, match=r"odd\.bin: token id 50300 at position 417 is >= vocab_size 50257"):
        open_shard(path, vocab_size=50257)
    np.testing.assert_array_equal(open_shard(path, vocab_size=50304), tokens)


def test_write_rejects_bad_tokens(tmp_path):
    with pytest.raises(ValueError, match="1-D"):
        write_shard(tmp_path / "a.bin", random_tokens(4).reshape(10, 100))
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path / "b.bin", np.array([1, 70000]))


def test_names_and_find_shards(tmp_path):
    assert shard_name("finewebedu", "train", 12) == "finewebedu_train_000012.bin"
    for index in (2, 0, 1):
        write_shard(tmp_path / shard_name("x", "train", index), random_tokens(index, 10))
    assert [p.name for p in find_shards(str(tmp_path / "x_train_*.bin"))] == [
        "x_train_000000.bin", "x_train_000001.bin", "x_train_000002.bin"]
    with pytest.raises(ShardError, match="no shard files match"):
        find_shards(str(tmp_path / "y_*.bin"))
