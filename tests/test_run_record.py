"""What a run records about its data (config.json, checkpoints, log.txt), the shard digest cache, the data check on
--resume, and optimizer state that holds the tied embedding once."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt
from data import lookup
from data import shards
from data.shards import describe_shards, sha256_shards, write_shard
from optim import OPTIMIZERS
from run.checkpoint import load_checkpoint
from tests import helpers

VOCAB = 80  # no other weight of the tiny model has 80 rows


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.uint16)


@pytest.fixture
def own_corpus(tmp_path, monkeypatch) -> Path:
    """Shards of this test alone (it rewrites them), of VOCAB random ids, with a digest cache of its own."""
    monkeypatch.setenv("SYMGPT_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "corpus"
    write_shard(root / "r_val_000000.bin", tokens(2048, 0))
    write_shard(root / "r_train_000001.bin", tokens(6000, 1))
    write_shard(root / "r_train_000002.bin", tokens(5000, 2))
    return root


def tiny_args(corpus: Path, run_dir: Path, name: str, **overrides) -> list[str]:
    """tests.helpers.tiny_args on `own_corpus`: a 16-token context, 3 steps, no validation during the run."""
    return helpers.tiny_args(corpus, run_dir, name, **{
        "train-files": str(corpus / "r_train_*.bin"), "val-files": str(corpus / "r_val_*.bin"), "vocab-size": VOCAB,
        "block-size": 16, "seq-len": 16, "batch-tokens": 64, "steps": 3, "val-every": 0, "val-tokens": 256,
        **overrides})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_digests_are_cached_by_path_size_and_mtime(tmp_path, monkeypatch):
    paths = [tmp_path / f"d_train_{i:06d}.bin" for i in range(3)]
    for i, path in enumerate(paths):
        write_shard(path, tokens(100 + i, i))
    hashed = []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    cache = tmp_path / "cache" / "digests.json"
    assert sha256_shards(paths, cache, progress=False) == [sha256(p) for p in paths]
    assert len(hashed) == 3
    hashed.clear()
    assert sha256_shards(paths, cache, progress=False) == [sha256(p) for p in paths]
    assert hashed == []  # a second start reads no shard
    write_shard(paths[1], tokens(100, 7))  # same size, new contents and mtime
    assert sha256_shards(paths, cache, progress=False)[1] == sha256(paths[1])
    assert hashed == [paths[1].name]
    paths[2].unlink()
    sha256_shards(paths[:1], cache, progress=False)
    cache.write_text("{not json")  # a damaged cache costs a rehash, not an error
    assert sha256_shards(paths[:1], cache, progress=False) == [sha256(paths[0])]
    assert set(json.loads(cache.read_text())) == {str(paths[0].resolve())}  # entries of deleted files are dropped


def test_a_verified_download_digest_is_reused(tmp_path, monkeypatch):
    path = tmp_path / "x_train_000001.bin"
    write_shard(path, tokens(50, 3))
    cache = tmp_path / "digests.json"
    shards.remember_sha256(path, "ab" * 32, cache)  # as data.fineweb_edu does after checking the Hub's sha256
    monkeypatch.setattr(shards, "sha256_file", lambda p: pytest.fail("hashed again"))
    assert describe_shards(str(path), cache, progress=False)["files"][0]["sha256"] == "ab" * 32


def test_config_checkpoint_and_log_record_the_data(own_corpus, tmp_path):
    train_gpt.main(tiny_args(own_corpus, tmp_path, "rec"))
    run = tmp_path / "rec"
    data = json.loads((run / "config.json").read_text())["data"]
    train = data["train"]
    assert train["given"] == train["pattern"] == str(own_corpus / "r_train_*.bin")
    assert [(Path(f["path"]).name, f["tokens"], f["bytes"]) for f in train["files"]] == [
        ("r_train_000001.bin", 6000, 1024 + 12000), ("r_train_000002.bin", 5000, 1024 + 10000)]
    assert [f["sha256"] for f in train["files"]] == [sha256(own_corpus / f"r_train_00000{i}.bin") for i in (1, 2)]
    assert train["tokens"] == 11000 and data["val"]["tokens"] == 2048
    ckpt = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert ckpt["config"]["data"] == data
    assert (f"train data {own_corpus / 'r_train_*.bin'}: 2 files, 11,000 tokens | val data "
            f"{own_corpus / 'r_val_*.bin'}: 1 files, 2,048 tokens | data fingerprint {data['fingerprint']}") in \
        (run / "log.txt").read_text()


def test_the_data_fingerprint_names_the_contents_not_the_paths(tmp_path, monkeypatch):
    """Equal shards in other places give the same fingerprint; one other token or another split gives another."""
    monkeypatch.setenv("SYMGPT_CACHE", str(tmp_path / "cache"))
    for folder, last in (("a", 7), ("b", 7), ("c", 8)):
        values = tokens(300, 0)
        values[-1] = last
        write_shard(tmp_path / folder / "x_train_000001.bin", values)
        write_shard(tmp_path / folder / "x_val_000000.bin", tokens(200, 1))

    def fingerprint(folder: str, val: str = "x_val_*.bin") -> str:
        record = lookup.describe_data({"train": "", "val": ""}, {"train": str(tmp_path / folder / "x_train_*.bin"),
                                                                "val": str(tmp_path / folder / val)})
        assert record["fingerprint"] == lookup.data_fingerprint(record) and len(record["fingerprint"]) == 16
        return record["fingerprint"]

    assert fingerprint("a") == fingerprint("b") != fingerprint("c")
    assert fingerprint("a", "x_train_*.bin") != fingerprint("a")


def test_default_data_records_the_empty_glob_as_given(monkeypatch, tmp_path):
    monkeypatch.setenv("SYMGPT_CACHE", str(tmp_path / "cache"))
    write_shard(tmp_path / "e_train_000000.bin", tokens(300, 0))
    write_shard(tmp_path / "e_val_000000.bin", tokens(200, 1))
    # no --train-files: the resolved default glob is recorded next to ""
    data = lookup.describe_data({"train": "", "val": ""}, {"train": str(tmp_path / "e_train_*.bin"),
                                                          "val": str(tmp_path / "e_val_*.bin")})
    assert data["train"]["given"] == "" and data["train"]["pattern"].endswith("e_train_*.bin")
    assert data["val"]["tokens"] == 200


def refused(argv: list[str], capsys) -> str:
    """The error a refused run prints (exit code 2, no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as excinfo:
        train_gpt.main(argv)
    assert excinfo.value.code == 2
    error = capsys.readouterr().err
    assert "\nerror: " in "\n" + error and "Traceback" not in error  # (after a progress bar, if any)
    return error


def test_resume_refuses_other_training_data_and_warns_on_other_validation_data(own_corpus, tmp_path, capsys):
    train_gpt.main(tiny_args(own_corpus, tmp_path, "first", **{"checkpoint-every": 2}))
    run = tmp_path / "first"
    write_shard(own_corpus / "r_val_000000.bin", tokens(2048, 5))
    train_gpt.main(["--resume", str(run), "--steps", "4"])
    assert "WARNING: the val data" in (run / "log.txt").read_text()
    write_shard(own_corpus / "r_train_000002.bin", tokens(5000, 9))
    error = refused(["--resume", str(run), "--steps", "6"], capsys)
    assert re.search(r"train data .* first difference at file 1: .*r_train_000002\.bin.*restore the recorded shards",
                     error), error
    write_shard(own_corpus / "r_train_000003.bin", tokens(100, 3))
    write_shard(own_corpus / "r_train_000002.bin", tokens(5000, 2))  # the recorded contents again, plus one more file
    assert "3 files / 11,100 tokens now, 2 files / 11,000 tokens" in refused(["--resume", str(run), "--steps", "6"],
                                                                            capsys)
    (own_corpus / "r_train_000003.bin").unlink()
    train_gpt.main(["--resume", str(run), "--steps", "6"])
    assert load_checkpoint(run / "checkpoints" / "latest.pt")["step"] == 6


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_state_holds_the_tied_embedding_once(optimizer):
    model = helpers.tiny_gpt(0, vocab_size=VOCAB, block_size=16, n_layer=1)
    spec = OPTIMIZERS[optimizer]
    opt = spec.build(model, spec.config())
    x = torch.randint(0, VOCAB, (2, 16))
    loss = model(x, x)[1]
    loss.backward()
    opt.step(loss) if spec.needs_loss else opt.step()
    unique = list(model.parameters())  # the tied weight once
    state = opt.state_dict()
    assert sum(len(g["params"]) for g in state["param_groups"]) == len(unique)
    embedding_entries = [entry for entry in state["state"].values()
                         if any(torch.is_tensor(t) and VOCAB in t.shape for t in entry.values())]
    assert len(embedding_entries) == 1  # one state entry for the embedding and the head
