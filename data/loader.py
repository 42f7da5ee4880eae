"""Distributed, resumable token loading from docs/data.md#shard-format shards.

One optimizer step consumes one global batch of N = world_size * grad_accum_steps * micro_batch sequences of
seq_len tokens. The global batch is cut into chunks of micro_batch rows; rank r processes chunk
c = micro_step * world_size + r at micro step `micro_step`. Only N matters for which tokens a step sees, so a run
on any number of GPUs, with any micro-batch split of the same N, sees the same rows (the same chunk ids too when
micro_batch is the same).

Row starts. Every sequence reads seq_len + 1 tokens from its start (x = row[:-1], y = row[1:]).
- contiguous (default): starts 0, T, 2T, ... so a global batch is one window of N*T + 1 tokens
  (x = window[:-1], y = window[1:], reshaped (N, T)), and consecutive windows share one token.
- align_to_eot: starts are <|endoftext|> positions chosen greedily from the shard's beginning: the first EOT,
  then each next row starts at the first EOT at or after previous start + T (rows never overlap in x).
Step b of a shard takes rows [b*N, (b+1)*N) of its starts; when the rest of the shard can't hold a global batch the
tail is dropped and the next shard (sorted order) begins; after the last shard the loader wraps (epoch += 1).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.shards import EOT_TOKEN, ShardError, find_shards, open_shard, read_shard_header

Files = str | os.PathLike | Sequence[str | os.PathLike]


def _resolve_files(files: Files) -> list[Path]:
    """A glob pattern or a list of paths -> sorted shard paths."""
    if isinstance(files, (str, os.PathLike)):
        return find_shards(str(files))
    paths = sorted(Path(p) for p in files)
    if not paths:
        raise ShardError("empty shard list; pass a glob pattern or at least one shard path")
    return paths


def _row_starts(tokens: np.ndarray, seq_len: int, align_to_eot: bool) -> np.ndarray:
    """Start of every sequence of a shard, in reading order (see the module docstring)."""
    last = len(tokens) - seq_len - 1  # the largest start that still has seq_len + 1 tokens
    if last < 0:
        return np.zeros(0, dtype=np.int64)
    if not align_to_eot:
        return np.arange(0, last + 1, seq_len, dtype=np.int64)
    eots = np.flatnonzero(tokens[: last + 1] == EOT_TOKEN)
    following = np.searchsorted(eots, eots + seq_len).tolist()  # first EOT index at or after start + T
    chain, j = [], 0
    while j < len(following):  # a Python walk: ~0.1 s for a 100M-token shard, done once per shard visit
        chain.append(j)
        j = following[j]
    return eots[chain].astype(np.int64)


def _read_rows(tokens: np.ndarray, starts: np.ndarray, seq_len: int, pin: bool) -> torch.Tensor:
    """(2, len(starts), seq_len) int64 tensor of inputs and targets; pinned when `pin` (fast async copies)."""
    rows = tokens[starts[:, None] + np.arange(seq_len + 1)]
    xy = torch.empty((2, len(starts), seq_len), dtype=torch.int64, pin_memory=pin)
    out = xy.numpy()
    out[0] = rows[:, :-1]
    out[1] = rows[:, 1:]
    return xy


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class _Position:
    """Where the next micro-batch comes from: global batch `batch` of shard `shard`, chunk of `micro_step`."""

    epoch: int = 0
    shard: int = 0
    batch: int = 0
    micro_step: int = 0


class DistributedTokenLoader:
    """This rank's training micro-batches, in order, as (x, y, chunk); see the module docstring.

    Shards are memory-mapped and validated (docs/data.md) when first visited; with vocab_size, every id of a shard is
    checked once (one pass over the shard). With prefetch > 0 a background thread builds the next `prefetch`
    micro-batches (pinned when the device is CUDA) and prepares the next shard ahead, so shard switches don't stall
    the GPU. state_dict() describes the batches consumed by the caller, not those prefetched.
    """

    def __init__(
        self,
        files: Files,
        micro_batch: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        grad_accum_steps: int = 1,
        vocab_size: int | None = None,
        align_to_eot: bool = False,
        device: str | torch.device = "cpu",
        prefetch: int = 2,
    ) -> None:
        for name, value in [("micro_batch", micro_batch), ("seq_len", seq_len), ("world_size", world_size),
                            ("grad_accum_steps", grad_accum_steps)]:
            if value < 1:
                raise ValueError(f"DistributedTokenLoader: {name} must be >= 1, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"DistributedTokenLoader: rank {rank} is outside [0, world_size={world_size})")
        self.files = _resolve_files(files)
        self.micro_batch, self.seq_len = micro_batch, seq_len
        self.rank, self.world_size, self.grad_accum_steps = rank, world_size, grad_accum_steps
        self.vocab_size, self.align_to_eot, self.prefetch = vocab_size, align_to_eot, prefetch
        self.device = _resolve_device(device)
        self.global_rows = world_size * grad_accum_steps * micro_batch  # N sequences per optimizer step
        window = self.global_rows * seq_len + 1
        sizes = [read_shard_header(path) for path in self.files]
        for path, size in zip(self.files, sizes):
            if size < window:
                raise ShardError(
                    f"{path}: {size} tokens, fewer than one global batch window of {window} tokens (world_size "
                    f"{world_size} x grad_accum_steps {grad_accum_steps} x micro_batch {micro_batch} sequences x "
                    f"seq_len {seq_len} + 1); use a smaller --micro-batch or --seq-len, or bigger shards"
                )
        listing = "\n".join(f"{path.name}:{size}" for path, size in zip(self.files, sizes))
        self._files_fingerprint = hashlib.sha256(listing.encode()).hexdigest()[:16]
        self._position = _Position()  # after the batches the caller consumed
        self._vocab_checked: set[int] = set()
        self._batches: Iterator | None = None  # prefetch == 0: the producer, run in the caller's thread
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._failure: BaseException | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._prepared: dict[int, concurrent.futures.Future] = {}

    # ----- consuming -----

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The next micro-batch of this rank: x, y int64 (micro_batch, seq_len) on the device, and its chunk."""
        xy, chunk, position = self._next_item()
        self._position = position
        xy = xy.to(self.device, non_blocking=True)
        return xy[0], xy[1], chunk

    def _next_item(self) -> tuple[torch.Tensor, int, _Position]:
        if self._failure is not None:  # a failed producer stays failed (until close or load_state_dict)
            raise self._failure
        if self.prefetch == 0:
            if self._batches is None:
                self._batches = self._produce(self._position)
            try:
                return next(self._batches)
            except Exception as exc:
                self._failure = exc
                raise
        if self._thread is None:
            self._start()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("DistributedTokenLoader: the prefetch thread stopped without a result")
                continue
            if isinstance(item, BaseException):
                self._failure = item
                raise item
            return item

    # ----- producing -----

    def _produce(self, start: _Position) -> Iterator[tuple[torch.Tensor, int, _Position]]:
        """Yield (xy, chunk, position after it) for this rank from `start` on, forever."""
        epoch, shard, first_batch, first_micro = dataclasses.astuple(start)
        rows, mb, pin = self.global_rows, self.micro_batch, self.device.type == "cuda"
        while True:
            tokens, starts = self._shard(shard)
            num_batches = len(starts) // rows
            next_epoch, next_shard = (epoch, shard + 1) if shard + 1 < len(self.files) else (epoch + 1, 0)
            for batch in range(first_batch, num_batches):
                step_starts = starts[batch * rows : (batch + 1) * rows]
                for micro in range(first_micro, self.grad_accum_steps):
                    chunk = micro * self.world_size + self.rank
                    xy = _read_rows(tokens, step_starts[chunk * mb : (chunk + 1) * mb], self.seq_len, pin)
                    if micro + 1 < self.grad_accum_steps:
                        after = _Position(epoch, shard, batch, micro + 1)
                    elif batch + 1 < num_batches:
                        after = _Position(epoch, shard, batch + 1)
                    else:
                        after = _Position(next_epoch, next_shard)
                    yield xy, chunk, after
                first_micro = 0
            epoch, shard, first_batch = next_epoch, next_shard, 0

    def _shard(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and row starts of shard `index`; starts preparing the following shard in the background."""
        pending = self._prepared.pop(index, None)
        tokens, starts = pending.result() if pending is not None else self._prepare(index)
        following = (index + 1) % len(self.files)
        if self._executor is not None and following != index and following not in self._prepared:
            self._prepared[following] = self._executor.submit(self._prepare, following)
        return tokens, starts

    def _prepare(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        path = self.files[index]
        check = self.vocab_size if index not in self._vocab_checked else None
        tokens = open_shard(path, vocab_size=check)
        self._vocab_checked.add(index)
        starts = _row_starts(tokens, self.seq_len, self.align_to_eot)
        if len(starts) < self.global_rows:
            raise ShardError(
                f"{path}: only {len(starts)} sequences of {self.seq_len} + 1 tokens"
                f"{' starting at <|endoftext|>' if self.align_to_eot else ''}, fewer than one global batch of "
                f"{self.global_rows}; use a smaller --micro-batch or --seq-len, or bigger shards"
            )
        return tokens, starts

    def _start(self) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
        if len(self.files) > 1:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-prepare")
        self._thread = threading.Thread(
            target=self._run, args=(self._position, self._queue, self._stop), name="token-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, start: _Position, out: queue.Queue, stop: threading.Event) -> None:
        """Prefetch thread: fill `out` until `stop`; an exception is handed to the caller through `out`."""

        def put(item: object) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # pinned allocations use this rank's GPU context, not GPU 0
            for item in self._produce(start):
                if not put(item):
                    return
        except BaseException as exc:  # handed over and re-raised in the caller's thread by next_batch
            put(exc)

    def close(self) -> None:
        """Stop the prefetch thread and drop prefetched batches; the next next_batch() starts afresh."""
        if self._thread is not None:
            self._stop.set()  # a producer waiting on the full queue sees it within put's 0.1 s timeout
            self._thread.join()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._thread = self._queue = self._stop = self._executor = self._batches = self._failure = None
        self._prepared = {}

    def __enter__(self) -> DistributedTokenLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- resuming -----

    def _geometry(self) -> dict:
        return {"seq_len": self.seq_len, "rows_per_step": self.global_rows, "align_to_eot": self.align_to_eot}

    def state_dict(self) -> dict:
        """JSON-able position after the consumed batches, with fingerprints of the shard list and geometry.

        A state taken at a step boundary (micro_step 0) resumes under any split of the same rows per step
        (world_size x grad_accum_steps x micro_batch); one taken mid-step needs the same world_size and micro_batch.
        """
        return {**dataclasses.asdict(self._position), "world_size": self.world_size, "micro_batch": self.micro_batch,
                "files": self._files_fingerprint, "num_files": len(self.files), "geometry": self._geometry()}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batches consumed when `state` was taken; clear errors on any mismatch."""
        missing = set(self.state_dict()) - set(state)
        if missing:
            raise ValueError(f"not a DistributedTokenLoader state: missing {sorted(missing)}")
        if state["files"] != self._files_fingerprint:
            raise ValueError(
                f"loader state was saved for another shard list ({state['num_files']} files, fingerprint "
                f"{state['files']}); this loader has {len(self.files)} files (fingerprint {self._files_fingerprint}, "
                f"first {self.files[0]}); resume with the same shard files or start the data order afresh"
            )
        geometry = self._geometry()
        saved = state["geometry"]
        changed = [f"{k}={saved.get(k)} now {v}" for k, v in geometry.items() if saved.get(k) != v]
        if changed:
            raise ValueError(
                f"loader state was saved with another batch geometry ({', '.join(changed)}); resume with the same "
                "--seq-len, --batch-tokens and --align-to-eot, or start the data order afresh"
            )
        split = (state["world_size"], state["micro_batch"])
        if state["micro_step"] != 0 and split != (self.world_size, self.micro_batch):
            raise ValueError(
                f"loader state was saved mid-step (micro_step {state['micro_step']}) with world_size {split[0]} and "
                f"micro_batch {split[1]}; resume it with those, or save at an optimizer-step boundary"
            )
        self.close()
        self._position = _Position(state["epoch"], state["shard"], state["batch"], state["micro_step"])


def validation_capacity(files: Files, seq_len: int) -> int:
    """The most tokens `validation_batches` can serve from `files` (whole sequences of seq_len + 1 tokens per shard;
    a shard's tail shorter than that is skipped), read from the shard headers alone."""
    return seq_len * sum(max(0, (read_shard_header(path) - 1) // seq_len) for path in _resolve_files(files))


def validation_batches(
    files: Files,
    micro_batch: int,
    seq_len: int,
    num_tokens: int,
    *,
    first_sequence: int = 0,
    rank: int = 0,
    world_size: int = 1,
    vocab_size: int | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """This rank's (x, y, first_row) of a fixed validation budget: the same tokens on every call, whatever the
    number of ranks and the micro-batch (docs/evaluation.md#validation-loss).

    The val stream is every shard's contiguous sequences (starts 0, T, 2T, ... reading T + 1 tokens) in sorted shard
    order. The budget is sequences [first_sequence, first_sequence + num_tokens // seq_len) of the stream, cut into
    blocks of micro_batch consecutive rows (the last one may be shorter) dealt round robin: block j goes to rank
    j % world_size. first_row is the stream index of the block's first row. Averaging per scored token over all
    ranks' blocks gives the same number on any world size (up to summation order).
    """
    count = num_tokens // seq_len
    if count == 0:
        raise ValueError(f"validation budget of {num_tokens} tokens is less than one sequence of --seq-len {seq_len}; "
                         f"raise --val-tokens to at least {seq_len}")
    paths, device = _resolve_files(files), _resolve_device(device)
    needed = first_sequence + count
    shards, shard_of_row, start_of_row = [], [], []
    for path in paths:
        if sum(map(len, start_of_row)) >= needed:
            break
        tokens = open_shard(path, vocab_size)
        starts = _row_starts(tokens, seq_len, align_to_eot=False)
        shard_of_row.append(np.full(len(starts), len(shards)))
        start_of_row.append(starts)
        shards.append(tokens)
    shard_of_row, start_of_row = np.concatenate(shard_of_row)[:needed], np.concatenate(start_of_row)[:needed]
    if len(start_of_row) < needed:
        raise ShardError(
            f"val shards {[str(p) for p in paths]} hold {len(start_of_row)} sequences of {seq_len} + 1 tokens; "
            f"the validation budget needs {needed} ({needed * seq_len} tokens); lower --val-tokens"
        )
    blocks = range(first_sequence + rank * micro_batch, needed, world_size * micro_batch)
    return _validation_iterator(shards, shard_of_row, start_of_row, blocks, micro_batch, needed, seq_len, device)


def _validation_iterator(shards: list[np.ndarray], shard_of_row: np.ndarray, start_of_row: np.ndarray,
                         blocks: range, micro_batch: int, end: int, seq_len: int, device: torch.device
                         ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    pin = device.type == "cuda"
    for first in blocks:
        mine = slice(first, min(first + micro_batch, end))
        parts = [_read_rows(shards[s], start_of_row[mine][shard_of_row[mine] == s], seq_len, pin)
                 for s in np.unique(shard_of_row[mine])]  # a block may straddle two shards
        xy = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(device, non_blocking=True)
        yield xy[0], xy[1], first
