"""Raw text -> shards (data/tokenize.py): round trip, docs/data.md bytes, loader, determinism, bad input, Hub files."""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from data import embedded
from data import tokenize as tok
from data.shards import EOT_TOKEN, GPT2_VOCAB, find_shards
from data import documents
from data.documents import CorpusStats, TokenizeError, iter_documents, resolve_sources
from data.tokenize import documents_to_shards
from data.tokenizer import gpt2_tokenizer
from tests.helpers import HUB_REPO, FakeHub

ROOT = Path(__file__).resolve().parents[1]

WORDS = ["the", "gauge", "orbit", "bias", "Ω", "naïve", "日本語", "😀", "don't", "3.14", "\n", "\t", "  ",
         "<|endoftext|>"]


def make_docs(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["x" + "".join(rng.choice(WORDS) + rng.choice(" \n") for _ in range(rng.randrange(5, 80))) for _ in range(n)]


def expected_stream(docs: list[str]) -> np.ndarray:
    enc = gpt2_tokenizer()
    return np.concatenate([np.array([EOT_TOKEN] + enc.encode_ordinary(d), dtype=np.uint16) for d in docs])


def spec_bytes(tokens: np.ndarray) -> bytes:
    """docs/data.md written out independently of data.shards: 256 int32 header, then uint16 tokens, little-endian."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, tokens.size]
    return header.tobytes() + tokens.astype("<u2").tobytes()


def write_corpus(root: Path, seed: int) -> tuple[list[str], list[str]]:
    """.txt files, a .jsonl and a .parquet (text in "content"); returns (CLI inputs, documents in reading order)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    txt, jsonl, parquet = make_docs(seed, 5), make_docs(seed + 1, 12), make_docs(seed + 2, 9)
    (root / "txt").mkdir(parents=True)
    for i, doc in enumerate(txt):
        (root / "txt" / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    with open(root / "b.jsonl", "w", encoding="utf-8") as f:
        for i, doc in enumerate(jsonl):
            f.write(json.dumps({"id": i, "content": doc}) + "\n")
    pq.write_table(pa.table({"content": parquet, "n": list(range(len(parquet)))}), root / "c.parquet", row_group_size=4)
    return [str(root / "txt" / "*.txt"), str(root / "b.jsonl"), str(root / "c.parquet")], txt + jsonl + parquet


HELD = threading.Lock()


def under_held_lock(x: int) -> int:
    with HELD:
        return x


def test_parallel_map_workers_do_not_inherit_a_lock_the_caller_holds():
    """A lock held in the calling process while the pool starts (as another thread of a test runner or a library may
    hold one) is free in the workers: a forked worker inherits it held, with no thread to release it, and hangs."""
    result: list[int] = []
    with HELD:
        mapper = threading.Thread(target=lambda: result.extend(tok.parallel_map(under_held_lock, range(4), 2)),
                                  daemon=True)
        mapper.start()
        mapper.join(timeout=300)
    assert result == [0, 1, 2, 3], "parallel_map's workers did not finish within 300 s"


def test_round_trip_split_manifest_and_spec_bytes(tmp_path, monkeypatch):
    inputs, docs = write_corpus(tmp_path / "in", seed=0)
    out = tmp_path / "out"
    monkeypatch.setattr(tok, "BATCH_CHARS", 300)  # many worker tasks: their order must be kept
    tok.main(inputs + ["--out", str(out), "--prefix", "t", "--text-field", "content", "--shard-tokens", "500",
                       "--val-tokens", "300", "--workers", "2"])
    stream = expected_stream(docs)
    shards = sorted(find_shards(str(out / "t_*.bin")), key=lambda p: p.name[-10:])  # by index: val first
    names = [p.name for p in shards]
    assert names[0] == "t_val_000000.bin" and names[1:] == [f"t_train_{i:06d}.bin" for i in range(1, len(names))]
    sizes = [300] + [500] * (len(names) - 2) + [stream.size - 300 - 500 * (len(names) - 2)]
    assert 0 < sizes[-1] <= 500
    offsets = np.cumsum([0] + sizes)
    for path, lo, hi in zip(shards, offsets[:-1], offsets[1:]):
        assert path.read_bytes() == spec_bytes(stream[lo:hi])

    # Document boundaries: one <|endoftext|> before each document, and each segment decodes to its document.
    starts = np.flatnonzero(stream == EOT_TOKEN)
    assert starts.size == len(docs)
    segments = np.split(stream, starts[1:])
    assert [gpt2_tokenizer().decode(s[1:].tolist()) for s in segments] == docs

    manifest = json.loads((out / "t_manifest.json").read_text())
    assert manifest["tokens"] == stream.size and manifest["val_tokens"] == 300 and manifest["shard_tokens"] == 500
    assert manifest["counts"]["documents"] == len(docs) and manifest["counts"]["files"] == 7
    assert manifest["sources"] == [str(p) for p in resolve_sources(inputs)]
    assert [(s["name"], s["split"], s["tokens"]) for s in manifest["shards"]] == [
        (n, "val" if i == 0 else "train", sizes[i]) for i, n in enumerate(names)]
    assert all(s["sha256"] == hashlib.sha256((out / s["name"]).read_bytes()).hexdigest() for s in manifest["shards"])


def test_readable_by_trainer_loader(tmp_path):
    loader_module = pytest.importorskip("data.loader")
    docs = make_docs(3, 60)
    documents_to_shards(docs, tmp_path, "t", shard_tokens=2000, val_tokens=500, workers=1)
    stream = expected_stream(docs)
    loader = loader_module.DistributedTokenLoader(str(tmp_path / "t_train_*.bin"), 2, 16, vocab_size=GPT2_VOCAB,
                                                  prefetch=0)
    x, y, chunk = loader.next_batch()
    train = stream[500:2500].astype(np.int64)
    assert chunk == 0
    assert np.array_equal(x.numpy(), train[:32].reshape(2, 16))
    assert np.array_equal(y.numpy(), train[1:33].reshape(2, 16))


def test_output_independent_of_workers(tmp_path, monkeypatch):
    docs = make_docs(4, 80)
    monkeypatch.setattr(tok, "BATCH_CHARS", 500)
    for workers in (1, 2):
        documents_to_shards(docs, tmp_path / str(workers), "t", shard_tokens=700, val_tokens=300, workers=workers)
    one, two = sorted((tmp_path / "1").iterdir()), sorted((tmp_path / "2").iterdir())
    assert [p.name for p in one] == [p.name for p in two] and len(one) > 3
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two))


def test_bad_inputs_are_counted_and_named(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("café olé".encode("latin-1"))
    (tmp_path / "good.txt").write_text("fine text", encoding="utf-8")
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "one"}\n{"other": "x"}\n{oops\n\n{"text": 5}\n'
                                       b'{"text": "caf\xe9"}\n{"text": "   "}\n["text"]\n')
    (tmp_path / "garbage.parquet").write_bytes(b"this is not parquet" * 10)
    pq.write_table(pa.table({"body": ["no text column"]}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": ["kept", None, "also kept"]}), tmp_path / "nulls.parquet")
    order = ["empty.txt", "latin1.txt", "good.txt", "d.jsonl", "garbage.parquet", "nocol.parquet", "nulls.parquet"]
    paths = [tmp_path / n for n in order]

    stats = CorpusStats()
    docs = list(iter_documents(paths, stats, utf8_errors="replace"))
    assert docs == ["caf\ufffd ol\ufffd", "fine text", "one", "caf\ufffd", "kept", "also kept"]
    assert (stats.files, stats.documents, stats.empty_files, stats.invalid_utf8_replaced, stats.bad_json_lines,
            stats.missing_field, stats.empty_documents, stats.unreadable_files) == (7, 6, 1, 2, 1, 4, 1, 2)
    problems = "\n".join(stats.problems)
    named = ["empty.txt", "latin1.txt", "d.jsonl:2", "d.jsonl:3", "garbage.parquet", "nocol.parquet", "nulls.parquet"]
    assert all(name in problems for name in named)

    stats = CorpusStats()
    docs = list(iter_documents(paths, stats, utf8_errors="skip"))
    assert docs == ["fine text", "one", "kept", "also kept"] and stats.invalid_utf8_skipped == 2

    for bad, message in [("missing.txt", "no such file"), ("nothing*.jsonl", "matches no files")]:
        with pytest.raises(TokenizeError, match=message):
            resolve_sources([str(tmp_path / bad)])
    with pytest.raises(SystemExit, match="error: .*missing.txt: no such file"):
        tok.main([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "out")])


def test_any_readable_file_is_plain_text_and_binary_files_are_skipped(tmp_path):
    """.md, .py, .rst, .csv and extension-less files are text like .txt; a file with NUL bytes is counted and
    skipped, not tokenized as garbage."""
    texts = {"notes.md": "# Title\n\nSome *markdown*.", "code.py": "def f():\n    return 1  # one", "doc.rst": "A\n=",
             "README": "no extension at all", "table.csv": "a,b\n1,2"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    paths = resolve_sources([str(tmp_path / name) for name in [*texts, "image.png"]])
    stats = CorpusStats()
    assert list(iter_documents(paths, stats)) == list(texts.values())
    assert stats.binary_files == 1 and "image.png: NUL bytes" in stats.problems[0]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.md").write_text("one more")
    found = resolve_sources([str(tmp_path / "**")])  # folders left out, files in them found
    assert tmp_path / "sub" / "more.md" in found and all(path.is_file() for path in found)
    with pytest.raises(TokenizeError, match="sub: a directory: give its files"):
        resolve_sources([str(tmp_path / "sub")])
    out = tmp_path / "out"
    tok.main([str(tmp_path / "*"), "--out", str(out), "--prefix", "mixed", "--workers", "1"])
    manifest = json.loads((out / "mixed_manifest.json").read_text())
    assert manifest["counts"]["documents"] == 5 and manifest["counts"]["binary_files"] == 1


def test_small_corpus_and_existing_outputs(tmp_path):
    docs = make_docs(5, 20)
    with pytest.raises(TokenizeError, match="smaller --val-tokens"):
        documents_to_shards(docs, tmp_path, "t", val_tokens=10**8, workers=1)
    assert not list(tmp_path.glob("t_*"))
    small = documents_to_shards(docs, tmp_path / "default", "t", workers=1)  # smaller than a shard: a tenth
    total = small["tokens"]
    assert small["val_tokens"] == round(0.1 * total) and [r["tokens"] for r in small["shards"]] == [
        round(0.1 * total), total - round(0.1 * total)]
    large = documents_to_shards(docs, tmp_path / "large", "t", shard_tokens=total // 3, workers=1)
    assert large["val_tokens"] == total // 3  # a larger corpus: one shard's worth, as llm.c
    documents_to_shards(docs, tmp_path, "t", shard_tokens=100, val_tokens=100, workers=1)
    many = sorted(tmp_path.glob("t_train_*.bin"))
    with pytest.raises(TokenizeError, match="--overwrite"):
        documents_to_shards(docs, tmp_path, "t", shard_tokens=10_000, val_tokens=100, workers=1)
    documents_to_shards(docs, tmp_path, "t", shard_tokens=10_000, val_tokens=100, workers=1, overwrite=True)
    assert len(many) > 1 and [p.name for p in tmp_path.glob("t_train_*.bin")] == ["t_train_000001.bin"]


def test_hub_dataset_files(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    docs = make_docs(6, 10)
    files = {}
    for name, part in [("sample/10BT/001.parquet", docs[5:]), ("sample/10BT/000.parquet", docs[:5]),
                       ("other/000.parquet", ["not wanted"])]:
        pq.write_table(pa.table({"text": part}), tmp_path / "t.parquet")
        files[name] = (tmp_path / "t.parquet").read_bytes()
    hub = FakeHub(files)
    try:
        fetched = documents.fetch_hub_files(HUB_REPO, "sample/10BT/*.parquet", endpoint=hub.endpoint,
                                            cache_dir=tmp_path / "hf")
        assert [name for name, _ in fetched] == ["sample/10BT/000.parquet", "sample/10BT/001.parquet"]
        stats = CorpusStats()
        assert list(iter_documents([path for _, path in fetched], stats)) == docs
        assert documents.fetch_hub_files(HUB_REPO, "sample/*", 1, endpoint=hub.endpoint,
                                         cache_dir=tmp_path / "hf") == fetched[:1]
        assert sum(hub.gets.values()) == 2  # the second call is served from the cache
        with pytest.raises(TokenizeError, match="match"):
            documents.fetch_hub_files(HUB_REPO, "nothing/*", endpoint=hub.endpoint, cache_dir=tmp_path / "hf")
    finally:
        hub.close()


def outputs(out: Path) -> dict[str, bytes]:
    """The files in `out` (but the lock files, which name their last holder) and their bytes."""
    return {p.name: p.read_bytes() for p in out.iterdir() if p.suffix != ".lock"}


def good_run(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Shards and manifest of a successful run in tmp_path/out (prefix "ow"), and their bytes."""
    out = tmp_path / "out"
    documents_to_shards(make_docs(7, 30), out, "ow", shard_tokens=400, val_tokens=200, workers=1)
    return out, outputs(out)


def test_a_failed_overwrite_keeps_the_earlier_outputs_and_says_why_documents_were_dropped(tmp_path):
    out, before = good_run(tmp_path)
    assert len(before) > 3
    records = tmp_path / "allmissing.jsonl"
    records.write_text("".join(json.dumps({"id": i, "content": f"doc {i}"}) + "\n" for i in range(20)))
    with pytest.raises(SystemExit) as excinfo:
        tok.main([str(records), "--out", str(out), "--prefix", "ow", "--overwrite", "--workers", "1"])
    message = str(excinfo.value.code)
    assert outputs(out) == before  # nothing lost, nothing left over
    assert "no documents to tokenize" in message and "--val-tokens" not in message  # no impossible advice
    assert "skipped: 20 records without a string text field (see --text-field)" in message
    assert f"{records}:1: no string field 'text' (fields: id, content; see --text-field)" in message
    assert f"{records}:5:" in message and f"{records}:6:" not in message and "... and 15 more" in message

    with pytest.raises(SystemExit, match="no documents to tokenize"):  # the same through data.embedded --text
        embedded.main(["--text", str(records), "--out", str(out), "--workers", "1"])
    documents_to_shards(make_docs(8, 30), out, "text", shard_tokens=400, val_tokens=200, workers=1)
    texts = {p.name: p.read_bytes() for p in out.glob("text_*")}
    with pytest.raises(SystemExit, match="no documents to tokenize"):
        embedded.main(["--text", str(records), "--out", str(out), "--workers", "1"])
    assert {p.name: p.read_bytes() for p in out.glob("text_*")} == texts and len(texts) > 2

    (tmp_path / "fewer.txt").write_text("short text")  # a run that succeeds replaces the outputs, old shards and all
    tok.main([str(tmp_path / "fewer.txt"), "--out", str(out), "--prefix", "ow", "--overwrite", "--val-tokens", "1",
              "--workers", "1"])
    assert sorted(p.name for p in out.glob("ow_*")) == ["ow_manifest.json", "ow_train_000001.bin", "ow_val_000000.bin"]


def test_a_failed_run_into_a_new_directory_leaves_nothing(tmp_path):
    with pytest.raises(TokenizeError, match="no documents to tokenize"):
        documents_to_shards([], tmp_path / "new", "t", workers=1)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("val_flag", [["--val-tokens", "100000"], ["--val-fraction", "0.99"]])
def test_a_corpus_too_small_for_the_split_gets_advice_that_works(tmp_path, val_flag):
    (tmp_path / "tiny.txt").write_text("a few words of text")
    args = [str(tmp_path / "tiny.txt"), "--out", str(tmp_path / "out"), "--workers", "1"]
    with pytest.raises(SystemExit) as excinfo:
        tok.main(args + val_flag)
    message = str(excinfo.value.code)
    flag, value = re.search(r"pass a smaller (--val-\w+) \(e\.g\. ([\d.e-]+)\)", message).groups()
    assert flag == val_flag[0] and not (tmp_path / "out").exists()
    tok.main(args + [flag, value])  # the advice is a fix that works
    assert json.loads((tmp_path / "out" / "corpus_manifest.json").read_text())["shards"][1]["tokens"] >= 1


def test_a_file_size_limit_names_the_file_and_the_flag_and_keeps_the_earlier_outputs(tmp_path):
    resource = pytest.importorskip("resource")
    out, before = good_run(tmp_path)
    (tmp_path / "big.txt").write_text(" ".join(f"word{i}" for i in range(20_000)))
    limit = 16 * 1024  # bytes: the 200-token validation shard fits, a 20,000-token training shard does not

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "data.tokenize", str(tmp_path / "big.txt"), "--out", str(out),
                           "--prefix", "ow", "--overwrite", "--val-tokens", "200", "--shard-tokens", "20000",
                           "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_file_size)
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: could not write {out / 'ow_train_000001.bin'}: File too large"), proc.stderr
    assert "ulimit -f" in error and "--shard-tokens (this one: 20,000 tokens" in error
    assert "Traceback" not in proc.stderr
    assert outputs(out) == before


def test_the_staging_directory_of_a_killed_run_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".t.{int(dead.stdout)}.tmp"
    stale.mkdir()
    (stale / "t_train_000001.bin").write_bytes(b"x" * 4096)  # what SIGKILL in the middle of a run leaves
    documents_to_shards(make_docs(9, 20), tmp_path, "t", shard_tokens=400, val_tokens=200, workers=1)
    assert not stale.exists() and not list(tmp_path.glob(".t.*.tmp"))


@pytest.mark.parametrize("prefix", ["a/b", "..", ""])
def test_a_prefix_that_is_not_a_file_name_is_refused_before_anything_is_written(tmp_path, prefix, capsys):
    (tmp_path / "doc.txt").write_text("some text to tokenize")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as excinfo:
        tok.main([str(tmp_path / "doc.txt"), "--out", str(out), "--prefix", prefix, "--workers", "1"])
    assert excinfo.value.code == 2
    assert f"--prefix {prefix!r}: a name for the shard files, without '/'" in capsys.readouterr().err
    assert not out.exists()


def test_each_file_is_read_once_whatever_paths_lead_to_it(tmp_path, capsys):
    """A `**` glob through a symlink to a parent folder (a loop), a symlink to a file and a second pattern name the
    same two files again: each is tokenized once, the loop is walked once, and the other paths are counted and
    reported."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("the first document")
    (corpus / "sub" / "b.txt").write_text("the second document")
    (corpus / "sub" / "up").symlink_to("..")
    (corpus / "link.txt").symlink_to("a.txt")
    out = tmp_path / "out"
    tok.main([str(corpus / "**" / "*.txt"), str(corpus / "a.txt"), "--out", str(out), "--prefix", "p", "--workers",
              "1"])
    counts = json.loads((out / "p_manifest.json").read_text())["counts"]
    assert counts["files"] == 2 and counts["documents"] == 2
    shards = [out / "p_val_000000.bin", *sorted(out.glob("p_train_*.bin"))]
    stream = np.concatenate([np.fromfile(p, dtype="<u2", offset=1024) for p in shards])  # after the 256-int32 header
    assert np.array_equal(stream, expected_stream(["the first document", "the second document"]))
    assert counts["duplicate_files"] == 2  # the link and the second pattern
    assert f"duplicate_files={counts['duplicate_files']}" in capsys.readouterr().out


def test_a_glob_through_a_folder_linked_to_itself_twice_ends(tmp_path):
    """Two links in a folder to the folder itself: Python's `**` glob would follow them 2^40 times; the walk reads
    each folder once. In a process of its own, bounded: a hang fails the test instead of holding the suite."""
    (tmp_path / "loop" / "sub").mkdir(parents=True)
    (tmp_path / "loop" / "a.txt").write_text("one")
    (tmp_path / "loop" / "sub" / "b.txt").write_text("two")
    for name in ("self1", "self2"):
        (tmp_path / "loop" / name).symlink_to(".")
    script = ("from data.documents import resolve_sources\n"
              f"print([str(p) for p in resolve_sources([{str(tmp_path / 'loop' / '**' / '*.txt')!r}])])")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str([str(tmp_path / "loop" / "a.txt"), str(tmp_path / "loop" / "sub" / "b.txt")])


def test_two_runs_into_one_out_and_prefix_at_once_the_second_is_refused(tmp_path):
    """The first to claim the prefix in --out writes it; another, started meanwhile, is refused naming it (never
    both exit 0 with the later one's shards silently in place of the other's)."""
    (tmp_path / "doc.txt").write_text(" ".join(f"word{i}" for i in range(200)))
    out = tmp_path / "out"
    first = tok.claim_output(out, "p")
    try:
        with pytest.raises(SystemExit, match=f"error: {out}: another data.tokenize is writing 'p' shards there "
                                             f"\\(data.tokenize pid {os.getpid()} on host .*\\); wait for it to "
                                             "finish, or choose another --out/--prefix"):
            tok.main([str(tmp_path / "doc.txt"), "--out", str(out), "--prefix", "p", "--val-tokens", "20",
                      "--workers", "1"])
        assert not list(out.glob("p_*"))
    finally:
        first.close()
    tok.main([str(tmp_path / "doc.txt"), "--out", str(out), "--prefix", "p", "--val-tokens", "20", "--workers", "1"])
    assert (out / "p_manifest.json").is_file()


@pytest.mark.parametrize("flag", ["--shard-tokens", "--val-tokens"])
def test_more_tokens_than_a_shard_holds_is_one_line(tmp_path, flag):
    (tmp_path / "doc.txt").write_text("some text")
    with pytest.raises(SystemExit, match=f"error: {flag} 100,000,000,000,000: a shard holds at most 2,147,483,647 "
                                         "tokens"):
        tok.main([str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"), flag, str(10**14), "--workers", "1"])
    assert not (tmp_path / "out").exists()


def test_a_byte_order_mark_is_not_text(tmp_path):
    bom = "\ufeff".encode()
    (tmp_path / "a.txt").write_bytes(bom + b"hello world")
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "c.md").write_bytes(bom + b"line one\nline two\n")
    stats = CorpusStats()
    assert list(iter_documents([tmp_path / "a.txt", tmp_path / "b.jsonl"], stats)) == ["hello world", "one", "two"]
    assert stats.bad_json_lines == 0
    assert list(iter_documents([tmp_path / "c.md"], CorpusStats(), txt_split="line")) == ["line one", "line two"]
