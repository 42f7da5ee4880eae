"""DistributedTokenLoader and validation_batches against a plain numpy oracle on synthetic shards."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

import data.loader as loader_module
from data.loader import DistributedTokenLoader, validation_batches, validation_capacity
from data.shards import EOT_TOKEN, ShardError, open_shard, shard_name, write_shard
from tests.helpers import wait_until

T = 8  # seq_len of most tests


def make_shards(directory, sizes, seed=0, eot_rate=0.05, split="train"):
    """Random-token shards with planted EOTs; returns (glob pattern, token arrays in order)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for i, size in enumerate(sizes):
        tokens = rng.integers(0, EOT_TOKEN, size)
        tokens[rng.random(size) < eot_rate] = EOT_TOKEN
        write_shard(directory / shard_name("syn", split, i), tokens)
        arrays.append(tokens)
    return str(directory / f"syn_{split}_*.bin"), arrays


def oracle_row_starts(tokens, seq_len, align):
    """Row starts straight from the definition: every T tokens, or greedy EOT starts at least T apart."""
    starts, position = [], 0
    while True:
        if align:
            later = np.flatnonzero(tokens[position:] == EOT_TOKEN)
            if len(later) == 0:
                return starts
            position += int(later[0])
        if position + seq_len + 1 > len(tokens):
            return starts
        starts.append(position)
        position += seq_len


def oracle_steps(arrays, rows, seq_len, num_steps, align=False):
    """The first num_steps global batches (x, y), each (rows, seq_len), wrapping over the shards."""
    steps = []
    while True:
        for tokens in arrays:
            starts = oracle_row_starts(tokens, seq_len, align)
            for b in range(len(starts) // rows):
                window = np.stack([tokens[s : s + seq_len + 1] for s in starts[b * rows : (b + 1) * rows]])
                steps.append((window[:, :-1], window[:, 1:]))
                if len(steps) == num_steps:
                    return steps


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def as_numpy(batches):
    return [(x.numpy(), y.numpy(), c) for x, y, c in batches]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("world_size,rank,accum,micro_batch", [(1, 0, 1, 3), (1, 0, 3, 2), (2, 1, 2, 2), (3, 2, 1, 1)])
def test_rows_match_numpy_oracle(tmp_path, prefetch, world_size, rank, accum, micro_batch):
    pattern, arrays = make_shards(tmp_path, [300, 411, 150], seed=world_size * 10 + rank)
    rows = world_size * accum * micro_batch
    num_steps = 2 * sum(len(oracle_row_starts(a, T, False)) // rows for a in arrays) + 1  # two epochs and then some
    expected = oracle_steps(arrays, rows, T, num_steps)
    with DistributedTokenLoader(pattern, micro_batch, T, rank=rank, world_size=world_size, grad_accum_steps=accum,
                                prefetch=prefetch) as loader:
        for step in range(num_steps):
            for micro in range(accum):
                x, y, chunk = loader.next_batch()
                assert chunk == micro * world_size + rank
                assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (micro_batch, T)
                rows_of_chunk = slice(chunk * micro_batch, (chunk + 1) * micro_batch)
                np.testing.assert_array_equal(x.numpy(), expected[step][0][rows_of_chunk])
                np.testing.assert_array_equal(y.numpy(), expected[step][1][rows_of_chunk])
        assert loader.state_dict()["epoch"] == 2


def test_contiguous_window_layout(tmp_path):
    """A global batch is one window of N*T+1 tokens: x = window[:-1], y = window[1:] reshaped (N, T)."""
    pattern, (tokens,) = make_shards(tmp_path, [200], seed=1)
    with DistributedTokenLoader(pattern, 4, T, prefetch=0) as loader:
        loader.next_batch()
        x, y, _ = loader.next_batch()
    window = tokens[32:65]
    np.testing.assert_array_equal(x.numpy(), window[:-1].reshape(4, T))
    np.testing.assert_array_equal(y.numpy(), window[1:].reshape(4, T))


@pytest.mark.parametrize("align", [False, True])
def test_world_size_two_equals_accumulation_two(tmp_path, align):
    pattern, _ = make_shards(tmp_path, [700, 530], seed=2, eot_rate=0.15)
    steps = 12
    single = {}
    with DistributedTokenLoader(pattern, 2, T, grad_accum_steps=2, align_to_eot=align) as loader:
        for step in range(steps):
            for x, y, chunk in as_numpy(take(loader, 2)):
                single[step, chunk] = (x, y)
    split = {}
    for rank in range(2):
        with DistributedTokenLoader(pattern, 2, T, rank=rank, world_size=2, align_to_eot=align) as loader:
            for step in range(steps):
                x, y, chunk = as_numpy(take(loader, 1))[0]
                split[step, chunk] = (x, y)
    assert single.keys() == split.keys() and len(single) == 2 * steps
    for key in single:
        np.testing.assert_array_equal(single[key][0], split[key][0])
        np.testing.assert_array_equal(single[key][1], split[key][1])


def test_shard_boundary_drops_tail_and_wraps(tmp_path):
    # N*T + 1 = 33 tokens per window: shard 0 (70 tokens) holds 2 global batches, shard 1 (40 tokens) holds 1.
    pattern, (first, second) = make_shards(tmp_path, [70, 40], seed=3)
    with DistributedTokenLoader(pattern, 4, T, prefetch=1) as loader:
        batches = as_numpy(take(loader, 4))
        state = loader.state_dict()
    np.testing.assert_array_equal(batches[1][0].ravel(), first[32:64])
    np.testing.assert_array_equal(batches[2][0].ravel(), second[:32])  # first[64:70] dropped
    np.testing.assert_array_equal(batches[3][0], batches[0][0])  # wrapped around
    assert (state["epoch"], state["shard"], state["batch"]) == (1, 0, 1)


def test_align_to_eot_rows_start_at_eot_and_follow_rule(tmp_path):
    pattern, arrays = make_shards(tmp_path, [600, 450], seed=4, eot_rate=0.1)
    expected = oracle_steps(arrays, 6, T, 10, align=True)
    with DistributedTokenLoader(pattern, 3, T, grad_accum_steps=2, align_to_eot=True) as loader:
        for step in range(10):
            for x, y, chunk in as_numpy(take(loader, 2)):
                assert (x[:, 0] == EOT_TOKEN).all()
                np.testing.assert_array_equal(x, expected[step][0][chunk * 3 : (chunk + 1) * 3])
                np.testing.assert_array_equal(y, expected[step][1][chunk * 3 : (chunk + 1) * 3])


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("align", [False, True])
def test_resume_continues_exactly(tmp_path, prefetch, align):
    pattern, _ = make_shards(tmp_path, [260, 330], seed=5, eot_rate=0.2)
    kwargs = dict(grad_accum_steps=2, align_to_eot=align)
    with DistributedTokenLoader(pattern, 2, T, prefetch=0, **kwargs) as loader:
        reference = as_numpy(take(loader, 20))
    with DistributedTokenLoader(pattern, 2, T, prefetch=prefetch, **kwargs) as loader:
        take(loader, 7)  # mid-step and, with prefetch, several batches beyond
        state = json.loads(json.dumps(loader.state_dict()))
    with DistributedTokenLoader(pattern, 2, T, prefetch=prefetch, **kwargs) as resumed:
        resumed.load_state_dict(state)
        for (x, y, chunk), (rx, ry, rchunk) in zip(reference[7:], as_numpy(take(resumed, 13))):
            assert chunk == rchunk
            np.testing.assert_array_equal(x, rx)
            np.testing.assert_array_equal(y, ry)


def test_state_counts_consumed_not_prefetched(tmp_path):
    pattern, _ = make_shards(tmp_path, [400], seed=6)
    with DistributedTokenLoader(pattern, 2, T, prefetch=0) as plain:
        plain.next_batch()
        expected = plain.state_dict()
    with DistributedTokenLoader(pattern, 2, T, prefetch=5) as loader:
        loader.next_batch()
        wait_until(loader._queue.full, "the prefetch thread filling its queue of 5 batches")
        assert loader.state_dict() == expected


def test_resume_at_step_boundary_on_another_world_size(tmp_path):
    pattern, _ = make_shards(tmp_path, [500, 300], seed=7)
    with DistributedTokenLoader(pattern, 2, T, grad_accum_steps=2) as loader:
        reference = as_numpy(take(loader, 12))
    with DistributedTokenLoader(pattern, 2, T, grad_accum_steps=2) as loader:
        take(loader, 6)  # three whole steps
        state = loader.state_dict()
    for rank in range(2):
        with DistributedTokenLoader(pattern, 2, T, rank=rank, world_size=2) as loader:
            loader.load_state_dict(state)
            for step, (x, y, chunk) in enumerate(as_numpy(take(loader, 3)), start=3):
                assert chunk == rank
                np.testing.assert_array_equal(x, reference[2 * step + rank][0])
                np.testing.assert_array_equal(y, reference[2 * step + rank][1])
    with DistributedTokenLoader(pattern, 4, T) as loader:  # the same 4 rows per step in one micro-batch
        loader.load_state_dict(state)
        for step, (x, _, _) in enumerate(as_numpy(take(loader, 3)), start=3):
            np.testing.assert_array_equal(x, np.concatenate([reference[2 * step][0], reference[2 * step + 1][0]]))


def test_mismatched_resume_raises(tmp_path):
    pattern, _ = make_shards(tmp_path, [500], seed=8)
    with DistributedTokenLoader(pattern, 2, T, grad_accum_steps=2, prefetch=0) as loader:
        loader.next_batch()
        mid_step = loader.state_dict()
    with pytest.raises(ValueError, match="seq_len=8 now 16"):
        DistributedTokenLoader(pattern, 2, 16, grad_accum_steps=2).load_state_dict(mid_step)
    with pytest.raises(ValueError, match="rows_per_step=4 now 6"):
        DistributedTokenLoader(pattern, 2, T, grad_accum_steps=3).load_state_dict(mid_step)
    with pytest.raises(ValueError, match="mid-step"):
        DistributedTokenLoader(pattern, 2, T, world_size=2).load_state_dict(mid_step)
    with pytest.raises(ValueError, match="mid-step .* micro_batch 2"):
        DistributedTokenLoader(pattern, 4, T).load_state_dict(mid_step)
    (tmp_path / "other").mkdir()
    other, _ = make_shards(tmp_path / "other", [500, 200], seed=9)
    with pytest.raises(ValueError, match="another shard list"):
        DistributedTokenLoader(other, 2, T, grad_accum_steps=2).load_state_dict(mid_step)
    with pytest.raises(ValueError, match="missing"):
        DistributedTokenLoader(pattern, 2, T, grad_accum_steps=2).load_state_dict({"epoch": 0})


def test_shard_smaller_than_a_window_raises(tmp_path):
    pattern, _ = make_shards(tmp_path, [400, 20], seed=10)
    with pytest.raises(ShardError, match=r"syn_train_000001\.bin: 20 tokens.*33 tokens"):
        DistributedTokenLoader(pattern, 4, T)


def test_too_few_eot_rows_raises_through_prefetch(tmp_path):
    pattern, _ = make_shards(tmp_path, [400], seed=11, eot_rate=0.0)
    with DistributedTokenLoader(pattern, 2, T, align_to_eot=True, prefetch=2) as loader:
        with pytest.raises(ShardError, match=r"syn_train_000000\.bin: only 0 sequences.*endoftext"):
            loader.next_batch()


def test_vocab_check(tmp_path):
    pattern, (tokens,) = make_shards(tmp_path, [300], seed=12)
    tokens[123] = 60000
    write_shard(tmp_path / shard_name("syn", "train", 0), tokens)
    with DistributedTokenLoader(pattern, 2, T, vocab_size=50257) as loader:
        with pytest.raises(ShardError, match=r"syn_train_000000\.bin: token id 60000 at position 123"):
            loader.next_batch()


def test_vocab_checked_once_per_shard(tmp_path, monkeypatch):
    pattern, _ = make_shards(tmp_path, [100, 120], seed=20)
    calls = []

    def recording_reader(path, vocab_size=None):
        calls.append((path.name, vocab_size))
        return open_shard(path, vocab_size)

    monkeypatch.setattr(loader_module, "open_shard", recording_reader)
    with DistributedTokenLoader(pattern, 2, T, vocab_size=50257, prefetch=2) as loader:
        take(loader, 40)  # several epochs
        assert loader.state_dict()["epoch"] >= 3
    checked = [name for name, vocab_size in calls if vocab_size is not None]
    assert sorted(checked) == ["syn_train_000000.bin", "syn_train_000001.bin"]
    assert len(calls) > len(checked)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_deleted_shard_error_surfaces(tmp_path, prefetch):
    pattern, _ = make_shards(tmp_path, [200, 200], seed=13)
    with DistributedTokenLoader(pattern, 2, T, prefetch=prefetch) as loader:
        (tmp_path / shard_name("syn", "train", 1)).unlink()
        with pytest.raises(ShardError, match=r"syn_train_000001\.bin: no such shard"):
            take(loader, 20)
        with pytest.raises(ShardError, match="no such shard"):  # stays failed rather than hanging
            loader.next_batch()


def test_reader_exception_surfaces_from_prefetch_thread(tmp_path, monkeypatch):
    pattern, _ = make_shards(tmp_path, [200], seed=14)

    def broken_reader(path, vocab_size=None):
        raise RuntimeError(f"simulated read failure of {path}")

    monkeypatch.setattr(loader_module, "open_shard", broken_reader)
    with DistributedTokenLoader(pattern, 2, T, prefetch=3) as loader:
        with pytest.raises(RuntimeError, match="simulated read failure"):
            loader.next_batch()


def test_threads_start_lazily_and_stop_on_close(tmp_path):
    pattern, _ = make_shards(tmp_path, [300, 300], seed=15)
    with DistributedTokenLoader(pattern, 2, T, prefetch=0) as plain:
        reference = as_numpy(take(plain, 4))
    before = set(threading.enumerate())
    loader = DistributedTokenLoader(pattern, 2, T, prefetch=2)
    assert set(threading.enumerate()) == before
    take(loader, 2)
    started = set(threading.enumerate()) - before
    assert started
    loader.close()
    assert not any(thread.is_alive() for thread in started)
    np.testing.assert_array_equal(loader.next_batch()[0].numpy(), reference[2][0])  # close keeps the position
    loader.close()


def test_bad_arguments_raise(tmp_path):
    pattern, _ = make_shards(tmp_path, [300], seed=16)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        DistributedTokenLoader(pattern, 2, T, rank=2, world_size=2)
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        DistributedTokenLoader(pattern, 0, T)
    with pytest.raises(ShardError, match="no shard files match"):
        DistributedTokenLoader(str(tmp_path / "missing_*.bin"), 2, T)


def oracle_val_rows(arrays, seq_len):
    rows = [tokens[s : s + seq_len + 1] for tokens in arrays for s in range(0, len(tokens) - seq_len, seq_len)]
    return np.stack(rows)


def gathered_rows(pattern, micro_batch, budget, world, first_sequence=0):
    """Every rank's validation rows, put back in stream order by their first_row."""
    blocks = [(first, x.numpy(), y.numpy()) for r in range(world)
              for x, y, first in validation_batches(pattern, micro_batch, T, budget, rank=r, world_size=world,
                                                    first_sequence=first_sequence)]
    blocks.sort(key=lambda block: block[0])
    starts = [first for first, _, _ in blocks]
    assert starts == sorted(set(starts))  # no row served twice
    return np.concatenate([x for _, x, _ in blocks]), np.concatenate([y for _, _, y in blocks]), starts


def test_validation_batches(tmp_path):
    pattern, arrays = make_shards(tmp_path, [50, 90, 60], seed=17, split="val")  # 6 + 11 + 7 rows of T + 1
    budget = 21 * T + 5  # 21 sequences: not a whole number of blocks on any of the geometries below
    first = [(x.numpy(), y.numpy()) for x, y, _ in validation_batches(pattern, 2, T, budget, rank=1, world_size=2)]
    second = [(x.numpy(), y.numpy()) for x, y, _ in validation_batches(pattern, 2, T, budget, rank=1, world_size=2)]
    assert len(first) == 5 and all(np.array_equal(a[0], b[0]) for a, b in zip(first, second))
    rows = oracle_val_rows(arrays, T)[:21]  # crosses both shard boundaries; one block straddles two shards
    for world, micro_batch in [(1, 2), (2, 2), (3, 2), (3, 4), (4, 1), (8, 3)]:
        x, y, starts = gathered_rows(pattern, micro_batch, budget, world)
        np.testing.assert_array_equal(x, rows[:, :-1])
        np.testing.assert_array_equal(y, rows[:, 1:])
        assert starts == list(range(0, 21, micro_batch))


def test_validation_window_starts_at_first_sequence(tmp_path):
    pattern, arrays = make_shards(tmp_path, [50, 90, 60], seed=21, split="val")
    x, _, starts = gathered_rows(pattern, 2, 5 * T, 3, first_sequence=7)
    np.testing.assert_array_equal(x, oracle_val_rows(arrays, T)[7:12, :-1])
    assert starts == [7, 9, 11]


def test_validation_budget_errors(tmp_path):
    pattern, _ = make_shards(tmp_path, [50, 90], seed=18, split="val")
    with pytest.raises(ValueError, match="less than one sequence"):
        validation_batches(pattern, 2, T, T - 1, world_size=2)
    with pytest.raises(ShardError, match="hold 17 sequences"):
        validation_batches(pattern, 2, T, 40 * T)
    with pytest.raises(ShardError, match="hold 17 sequences"):
        validation_batches(pattern, 2, T, 10 * T, first_sequence=8)


def test_validation_capacity_is_what_validation_batches_can_serve(tmp_path):
    pattern, arrays = make_shards(tmp_path, [50, 90, 60], seed=20, split="val")
    capacity = validation_capacity(pattern, T)
    assert capacity == len(oracle_val_rows(arrays, T)) * T == 24 * T
    assert sum(x.numel() for x, _, _ in validation_batches(pattern, 1, T, capacity)) == capacity
    with pytest.raises(ShardError):
        validation_batches(pattern, 1, T, capacity + T)


@pytest.mark.cuda
def test_cuda_batches_match_cpu(tmp_path):
    pattern, _ = make_shards(tmp_path, [900, 700], seed=19)
    with DistributedTokenLoader(pattern, 2, T, grad_accum_steps=2, prefetch=0) as plain:
        reference = as_numpy(take(plain, 30))
    with DistributedTokenLoader(pattern, 2, T, grad_accum_steps=2, device="cuda", prefetch=3) as loader:
        for x, y, chunk in reference:
            cx, cy, cchunk = loader.next_batch()
            assert cx.is_cuda and cchunk == chunk
            np.testing.assert_array_equal(cx.cpu().numpy(), x)
            np.testing.assert_array_equal(cy.cpu().numpy(), y)
    for (x, _, _), (cx, _, _) in zip(validation_batches(pattern, 2, T, 64 * T),
                                     validation_batches(pattern, 2, T, 64 * T, device="cuda")):
        np.testing.assert_array_equal(cx.cpu().numpy(), x.numpy())
