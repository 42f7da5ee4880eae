"""Benchmark: data.tokenize (documents -> shards, N processes) vs single-process tiktoken encode_ordinary_batch.

Text: the documents of the embedded corpus (data.embedded), repeated up to --mb. Ours is timed end to end (tokenize,
assemble, write shards, sha256 for the manifest); the baseline only encodes. Best of --repeats (by wall time).
Mtok/CPU-s divides by the CPU time of this process and its workers: on a shared machine it shows per-core efficiency
even when the wall time is inflated by other load.

    python -m bench.tokenize [--mb 16] [--repeats 3]     # run as a module: as a script, this file would shadow
                                                         # the standard library's `tokenize`
"""
from __future__ import annotations

import itertools
import platform
import resource
import tempfile
import time

from cli import ArgumentParser
from data.embedded import read_text
from data.tokenize import default_workers, documents_to_shards
from data.tokenizer import gpt2_tokenizer
from fileio import exits_on_filesystem_errors


def corpus_documents(max_bytes: int) -> list[str]:
    """Documents of the embedded corpus repeated in order up to `max_bytes` of text (the corpus holds about 2 MB)."""
    docs, size = [], 0
    for text in itertools.cycle(read_text()):
        if size >= max_bytes:
            return docs
        docs.append(text)
        size += len(text.encode())


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its reaped children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def best_time(fn, repeats: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of the fastest of `repeats` calls."""
    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), cpu_seconds()
        fn()
        runs.append((time.perf_counter() - wall, cpu_seconds() - cpu))
    return min(runs)


@exits_on_filesystem_errors("location")
def main() -> None:
    parser = ArgumentParser(module="bench.tokenize", description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=16.0, help="megabytes of text to tokenize")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (the best is reported)")
    parser.add_argument("--workers", type=int, nargs="*", default=None, help="default: 1, 2, 4, ... up to all cores")
    args = parser.parse_args()
    cores = default_workers()
    worker_counts = args.workers or sorted({1, cores} | {w for w in (2, 4, 8, 16, 32, 64) if w < cores})
    docs = corpus_documents(int(args.mb * 1e6))
    enc = gpt2_tokenizer()
    n_tokens = sum(map(len, enc.encode_ordinary_batch(docs))) + len(docs)  # + one <|endoftext|> per document
    text_mb = sum(len(d.encode()) for d in docs) / 1e6
    print(f"{platform.processor() or platform.machine()}, {cores} usable cores; {len(docs)} documents, "
          f"{text_mb:.1f} MB, {n_tokens / 1e6:.2f}M tokens; best of {args.repeats}")
    print(f"{'method':<44} {'cores':>5} {'wall s':>7} {'Mtok/s':>7} {'Mtok/s/core':>11} {'Mtok/CPU-s':>10} "
          f"{'vs baseline':>11}")

    def row(name: str, used: int, timing: tuple[float, float], baseline: tuple[float, float]) -> None:
        (wall, cpu), rate = timing, n_tokens / timing[0] / 1e6
        print(f"{name:<44} {used:>5} {wall:>7.2f} {rate:>7.2f} {rate / used:>11.2f} {n_tokens / cpu / 1e6:>10.2f} "
              f"{baseline[0] / wall:>10.2f}x")

    threads = 8  # tiktoken's default num_threads
    baseline = best_time(lambda: enc.encode_ordinary_batch(docs, num_threads=threads), args.repeats)
    row(f"tiktoken encode_ordinary_batch, {threads} threads", min(threads, cores), baseline, baseline)
    single = best_time(lambda: enc.encode_ordinary_batch(docs, num_threads=1), args.repeats)
    row("tiktoken encode_ordinary_batch, 1 thread", 1, single, baseline)
    with tempfile.TemporaryDirectory() as tmp:
        for workers in worker_counts:
            timing = best_time(lambda: documents_to_shards(docs, tmp, "bench", workers=workers,
                                                           val_tokens=n_tokens // 20, overwrite=True), args.repeats)
            row(f"data.tokenize.documents_to_shards, {workers} procs", min(workers, cores), timing, baseline)


if __name__ == "__main__":
    main()
