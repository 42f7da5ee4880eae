"""The FineWeb-Edu downloader (data/fineweb_edu.py) against a fake Hub on 127.0.0.1."""
from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data import fineweb_edu
from data.fineweb_edu import DownloadError, download_shards, fineweb_shards_present, shard_names
from data.shards import GPT2_VOCAB, open_shard, write_shard
from tests.helpers import HUB_REPO, FakeHub


def shard_bytes(tmp: Path, name: str, seed: int, n: int) -> bytes:
    tokens = np.random.default_rng(seed).integers(0, GPT2_VOCAB, size=n)
    write_shard(tmp / name, tokens)
    return (tmp / name).read_bytes()


@pytest.fixture
def hub(tmp_path):
    names = shard_names(3)
    made = tmp_path / "made"
    made.mkdir()
    server = FakeHub({name: shard_bytes(made, name, seed, 3000 + 17 * seed) for seed, name in enumerate(names)})
    yield server
    server.close()


def download(dest: Path, hub: FakeHub, chunks: int) -> list[Path]:
    return download_shards(dest, chunks, repo=HUB_REPO, endpoint=hub.endpoint, progress=False)


def test_download_prefix_then_resume(tmp_path, hub):
    dest = tmp_path / "dest"
    assert not fineweb_shards_present(dest)
    paths = download(dest, hub, 1)
    assert [p.name for p in paths] == ["finewebedu_val_000000.bin", "finewebedu_train_000001.bin"]
    assert fineweb_shards_present(dest)
    for path in paths:
        assert path.read_bytes() == hub.files[path.name]
        open_shard(path, vocab_size=GPT2_VOCAB)
    # An interrupted run (server error on train 2) keeps what it fetched; the rerun fetches only the rest, and a
    # transfer cut mid-file is retried by huggingface_hub within the run.
    hub.fail.add("finewebedu_train_000002.bin")
    with pytest.raises(DownloadError, match=r"(?s)finewebedu_train_000002.bin.*rerun to resume"):
        download(dest, hub, 3)
    hub.truncate.add("finewebedu_train_000003.bin")
    paths = download(dest, hub, 3)
    assert len(paths) == 4 and all(p.read_bytes() == hub.files[p.name] for p in paths)
    assert hub.gets == Counter({name: 1 for name in shard_names(1)} | {name: 2 for name in shard_names(3)[2:]})
    # Idempotent: nothing more is fetched.
    download(dest, hub, 3)
    assert sum(hub.gets.values()) == 6


def test_corrupt_files_are_replaced_or_reported(tmp_path, hub):
    dest = tmp_path / "dest"
    download(dest, hub, 2)
    # A local file with a bad header is downloaded again.
    bad = dest / "finewebedu_train_000002.bin"
    bad.write_bytes(bad.read_bytes()[:-7])
    assert not fineweb_shards_present(dest)
    download(dest, hub, 2)
    assert bad.read_bytes() == hub.files[bad.name] and hub.gets[bad.name] == 2
    # Bytes corrupted in transit fail the sha256 check: fetched once more ...
    hub.corrupt["finewebedu_train_000003.bin"] = 1
    download(dest, hub, 3)
    assert hub.gets["finewebedu_train_000003.bin"] == 2
    assert (dest / "finewebedu_train_000003.bin").read_bytes() == hub.files["finewebedu_train_000003.bin"]
    # ... and a file that stays corrupt is removed and reported by name.
    (dest / "finewebedu_train_000003.bin").unlink()
    hub.corrupt["finewebedu_train_000003.bin"] = 5
    with pytest.raises(DownloadError, match=r"(?s)finewebedu_train_000003.bin.*corrupt"):
        download(dest, hub, 3)
    assert not (dest / "finewebedu_train_000003.bin").exists()


def test_offline_fails_fast_with_advice(tmp_path, monkeypatch):
    """Nothing listens at the endpoint: one probe, bounded by the probe timeout, no retry and no download, then the
    advice (fast by what it tries, whatever the machine's load)."""
    import huggingface_hub

    probes, downloads, probe = [], [], huggingface_hub.get_hf_file_metadata
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata",
                        lambda url, **kwargs: probes.append(kwargs.get("timeout")) or probe(url, **kwargs))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *args, **kwargs: downloads.append(args))
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError, match="embedded corpus") as info:
        download_shards(tmp_path, 2, repo=HUB_REPO, endpoint=f"http://127.0.0.1:{port}", progress=False)
    assert probes == [fineweb_edu.PROBE_TIMEOUT_S] and downloads == []
    assert "cannot reach" in str(info.value)
    assert "data.tokenize" in str(info.value) and str(tmp_path) in str(info.value)


def test_default_patterns_and_names():
    assert fineweb_edu.DEFAULT_TRAIN_PATTERN.endswith("data/fineweb_edu/finewebedu_train_*.bin")
    assert fineweb_edu.DEFAULT_VAL_PATTERN.endswith("data/fineweb_edu/finewebedu_val_*.bin")
    assert shard_names(2) == ["finewebedu_val_000000.bin", "finewebedu_train_000001.bin", "finewebedu_train_000002.bin"]
