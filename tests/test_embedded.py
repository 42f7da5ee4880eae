"""The embedded corpus (data/embedded.py): the pinned text, its shards and their fingerprint, the cache, extraction."""
from __future__ import annotations

import gzip
import io
import json
import random
import sysconfig
import tokenize
from pathlib import Path

import numpy as np
import pytest

from data import embedded, lookup
from data.embedded import module_comments, module_text, prepare_embedded_corpus, python_files
from data.shards import EOT_TOKEN, GPT2_VOCAB, find_shards, open_shard
from data.tokenize import TokenizeError
from data.tokenizer import gpt2_tokenizer

WORDS = ["alpha", "beta", "gauge", "symmetry", "bias", "orbit", "tensor", "naïve", "日本", "query", "value", "key"]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_package(root: Path, rng: random.Random, modules: int = 6) -> dict[str, list[str]]:
    """A fake site-packages tree; returns the docstrings and comments each module must yield."""
    expected = {}
    for i in range(modules):
        mod_doc, cls_doc, fn_doc = (sentence(rng, rng.randrange(20, 60)) for _ in range(3))
        comment, trailing = sentence(rng, 8), sentence(rng, 5)
        source = (
            f'"""{mod_doc}"""\n'
            f"# {comment}\n"
            f"X = '# not a comment {i}'  # {trailing}\n"
            f"class C{i}:\n    '''{cls_doc}'''\n"
            f"    def f(self):\n        \"\"\"{fn_doc}\"\"\"\n        return r\"\\\"#\"\n"
        )
        path = root / "pkg" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
        expected[path.name] = [mod_doc, comment, trailing, cls_doc, fn_doc]
    (root / "pkg" / "broken.py").write_text("def f(:\n    '''never read'''\n")
    (root / "pkg" / "nodocs.py").write_text("x = 1\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "cached.py").write_text('"""ignored"""\n')
    return expected


def test_module_text_extracts_docstrings_and_comments(tmp_path):
    expected = make_package(tmp_path, random.Random(0))
    for name, pieces in expected.items():
        text = module_text(tmp_path / "pkg" / name)
        positions = [text.index(p) for p in pieces]
        assert positions == sorted(positions)  # source order
        assert "not a comment" not in text and "#" not in text
    assert module_text(tmp_path / "pkg" / "broken.py") is None
    assert module_text(tmp_path / "pkg" / "nodocs.py") == ""


def test_comment_scan_matches_tokenize():
    tricky = (
        "s = 'it''s # no'  # one\nt = \"\\\"#\"  ## two\nu = '''\n# in string\n'''\nv = r'\\'#'\n"
        "w = f\"{1:#x}\"  # three\nx = b'\\\\'  # four\n#\n"
    )
    sources = [tricky] + [p.read_text(encoding="utf-8") for p in 
               python_files([Path(sysconfig.get_paths()["stdlib"])])[:40]]
    for source in sources:
        reference = [(t.start[0], t.string.lstrip("#").strip())
                     for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
        assert module_comments(source) == [c for c in reference if c[1]]


def test_python_files_skips_caches_and_walks_in_order(tmp_path):
    make_package(tmp_path, random.Random(1))
    files = python_files([tmp_path])
    assert all("__pycache__" not in str(f) for f in files) and files == sorted(files) and len(files) == 8


def read_all(pattern: str) -> np.ndarray:
    return np.concatenate([np.asarray(open_shard(p, vocab_size=GPT2_VOCAB)) for p in find_shards(pattern)])


# The data fingerprint (data.lookup.data_fingerprint) of the default corpus: the same on every installation, since
# the text is pinned (embedded.TEXT_SHA256) and so are the tokenizer's ranks. A new text or tokenizer changes it on
# purpose, and every number measured on the old corpus stops being comparable: update it only then.
EMBEDDED_FINGERPRINT = "d88fdc24dce58f40"


def test_the_default_corpus_is_the_pinned_text_everywhere(tmp_path, monkeypatch):
    """The shards hold exactly the shipped documents, tokenized, with the default validation fraction; their
    fingerprint is the pinned one whatever Python runs; a second call reuses them, another setting rebuilds."""
    monkeypatch.setenv("SYMGPT_CACHE", str(tmp_path / "cache"))
    cache = tmp_path / "embedded"
    train_glob, val_glob = prepare_embedded_corpus(cache, workers=1, progress=False)
    docs = embedded.read_text()
    assert len(docs) > 250 and 1_900_000 < sum(len(d.encode()) for d in docs) <= embedded.TEXT_MAX_BYTES
    enc = gpt2_tokenizer()
    expected = np.concatenate([np.array([EOT_TOKEN] + enc.encode_ordinary(d), dtype=np.uint16) for d in docs])
    val, train = read_all(val_glob), read_all(train_glob)
    assert np.array_equal(np.concatenate([val, train]), expected)
    assert val.size == round(embedded.DEFAULT_VAL_FRACTION * expected.size) >= 16384  # the smoke preset's budget
    record = lookup.describe_data({"train": "", "val": ""}, {"train": train_glob, "val": val_glob})
    assert record["fingerprint"] == EMBEDDED_FINGERPRINT
    manifest = json.loads((cache / "embedded_manifest.json").read_text())
    assert manifest["text_sha256"] == embedded.TEXT_SHA256 and manifest["tokens"] == expected.size

    def fail(*args, **kwargs):
        raise AssertionError("cache not reused")

    monkeypatch.setattr(embedded, "read_text", fail)
    assert prepare_embedded_corpus(cache, progress=False) == (train_glob, val_glob)
    with pytest.raises(AssertionError, match="cache not reused"):
        prepare_embedded_corpus(cache, val_fraction=0.1, progress=False)


def test_a_changed_text_is_refused(tmp_path):
    changed = tmp_path / "text.jsonl.gz"
    changed.write_bytes(gzip.compress(b'{"module": "m", "text": "another text"}\n'))
    with pytest.raises(TokenizeError, match=r"text.jsonl.gz: sha256 .* is not the pinned .*git checkout"):
        prepare_embedded_corpus(tmp_path / "out", text=changed, workers=1, progress=False)
    assert not (tmp_path / "out").exists()


def test_write_text_keeps_whole_modules_in_order_and_is_deterministic(tmp_path):
    first, second = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    digest = embedded.write_text(first, max_bytes=40_000)
    assert embedded.write_text(second, max_bytes=40_000) == digest and first.read_bytes() == second.read_bytes()
    records = [json.loads(line) for line in gzip.decompress(first.read_bytes()).decode().splitlines()]
    assert records and sum(len(r["text"].encode()) for r in records) <= 40_000
    assert [r["module"] for r in records] == sorted(r["module"] for r in records)  # top-level modules first
    assert embedded.read_text(first, digest) == [r["text"] for r in records]


def test_text_mode_makes_text_shards_with_the_val_fraction(tmp_path):
    for i in range(4):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} says something about shards. " * 200)
    out = tmp_path / "out"
    embedded.main(["--text", str(tmp_path / "*.txt"), "--out", str(out), "--val-fraction", "0.1", "--workers", "1"])
    manifest = json.loads((out / "text_manifest.json").read_text())
    assert manifest["val_tokens"] == round(0.1 * manifest["tokens"])
    assert manifest["counts"]["documents"] == 4
    assert sorted(p.name for p in out.glob("text_*.bin")) == ["text_train_000001.bin", "text_val_000000.bin"]
