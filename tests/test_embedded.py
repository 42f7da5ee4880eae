"""The embedded corpus (data/embedded.py): extraction, shards, cache, cap."""
from __future__ import annotations

import io
import json
import random
import tokenize
from pathlib import Path

import numpy as np
import pytest

from data import embedded
from data.embedded import extract_corpus, module_comments, module_text, prepare_embedded_corpus, python_files
from data.shards import EOT_TOKEN, GPT2_VOCAB, find_shards, open_shard
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
    sources = [tricky] + [p.read_text(encoding="utf-8") for p in python_files(embedded.python_source_roots()[:1])[:40]]
    for source in sources:
        reference = [(t.start[0], t.string.lstrip("#").strip())
                     for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
        assert module_comments(source) == [c for c in reference if c[1]]


def test_extract_skips_and_counts(tmp_path):
    make_package(tmp_path, random.Random(1))
    files = python_files([tmp_path])
    assert all("__pycache__" not in str(f) for f in files) and files == sorted(files)
    docs, stats = extract_corpus(files, max_bytes=10**9)
    assert (stats.files, stats.modules, stats.unparsable, stats.empty) == (len(files), 6, 1, 1)
    assert stats.text_bytes == sum(len(d.encode()) for d in docs) and not stats.truncated


def test_max_bytes_cap(tmp_path):
    make_package(tmp_path, random.Random(2))
    full, _ = extract_corpus(python_files([tmp_path]), max_bytes=10**9)
    cap = len(full[0].encode()) + len(full[1].encode()) // 2
    docs, stats = extract_corpus(python_files([tmp_path]), max_bytes=cap)
    assert stats.truncated and len(docs) == 2
    assert cap - 3 <= stats.text_bytes == sum(len(d.encode()) for d in docs) <= cap
    assert docs[0] == full[0] and full[1].startswith(docs[1])


def read_all(pattern: str) -> np.ndarray:
    return np.concatenate([np.asarray(open_shard(p, vocab_size=GPT2_VOCAB)) for p in find_shards(pattern)])


def test_prepare_shards_split_and_cache(tmp_path, monkeypatch):
    make_package(tmp_path / "src", random.Random(3), modules=40)
    cache = tmp_path / "cache"
    train_glob, val_glob = prepare_embedded_corpus(cache, max_bytes=10**9, val_fraction=0.1,
                                                   roots=[tmp_path / "src"], workers=1)
    docs, _ = extract_corpus(python_files([tmp_path / "src"]), max_bytes=10**9)
    enc = gpt2_tokenizer()
    expected = np.concatenate([np.array([EOT_TOKEN] + enc.encode_ordinary(d), dtype=np.uint16) for d in docs])
    val, train = read_all(val_glob), read_all(train_glob)
    assert np.array_equal(np.concatenate([val, train]), expected)
    assert val.size == round(0.1 * expected.size) and val[0] == EOT_TOKEN
    assert [p.name for p in find_shards(val_glob)] == ["embedded_val_000000.bin"]
    assert find_shards(train_glob)[0].name == "embedded_train_000001.bin"
    manifest = json.loads((cache / "embedded_manifest.json").read_text())
    assert manifest["tokens"] == expected.size and manifest["extraction"]["unparsable"] == 1

    # A second call reuses the cache without extracting again ...
    def fail(*args, **kwargs):
        raise AssertionError("cache not reused")

    monkeypatch.setattr(embedded, "extract_corpus", fail)
    assert prepare_embedded_corpus(cache, max_bytes=10**9, val_fraction=0.1, roots=[tmp_path / "src"]) == (
        train_glob, val_glob)
    # ... but rebuilds when the settings or a source file change.
    with pytest.raises(AssertionError, match="cache not reused"):
        prepare_embedded_corpus(cache, max_bytes=10**6, val_fraction=0.1, roots=[tmp_path / "src"])
    with (tmp_path / "src" / "pkg" / "mod0.py").open("a") as f:
        f.write("# one more comment\n")
    with pytest.raises(AssertionError, match="cache not reused"):
        prepare_embedded_corpus(cache, max_bytes=10**9, val_fraction=0.1, roots=[tmp_path / "src"])


def test_real_python_sources_small_cap(tmp_path):
    train_glob, val_glob = prepare_embedded_corpus(tmp_path, max_bytes=60_000, val_fraction=0.2, workers=1)
    val, train = read_all(val_glob), read_all(train_glob)
    text = gpt2_tokenizer().decode(np.concatenate([val, train]).tolist())
    assert len(text.replace("<|endoftext|>", "").encode()) <= 60_000
    manifest = json.loads((tmp_path / "embedded_manifest.json").read_text())
    assert manifest["roots"][0] == str(embedded.python_source_roots()[0]) and manifest["extraction"]["truncated"]


def test_text_mode_makes_text_shards_with_the_val_fraction(tmp_path):
    for i in range(4):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} says something about shards. " * 200)
    out = tmp_path / "out"
    embedded.main(["--text", str(tmp_path / "*.txt"), "--out", str(out), "--val-fraction", "0.1", "--workers", "1"])
    manifest = json.loads((out / "text_manifest.json").read_text())
    assert manifest["val_tokens"] == round(0.1 * manifest["tokens"])
    assert manifest["counts"]["documents"] == 4
    assert sorted(p.name for p in out.glob("text_*.bin")) == ["text_train_000001.bin", "text_val_000000.bin"]
