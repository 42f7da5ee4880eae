"""Shared test setup: the repository root on sys.path, the markers' rules, how pytest-xdist shares the work, and the
fixtures several test modules use (helpers they share are in tests/helpers.py).

Markers (pyproject.toml lists them):
- `@pytest.mark.cuda`: needs a CUDA GPU; skipped with the reason on a machine without one.
- `@pytest.mark.serial`: holds more than one core (torchrun, a grid with two workers, two trainers at once). Under
  `./run.sh test` (pytest-xdist: `-n auto --dist loadgroup`) one worker runs these one after another, starting
  with them, while the other workers take the rest a module at a time (so a module's fixtures are built once per
  run); each worker runs torch on its share of the cores. Without xdist the marker changes nothing. A whole module:
  `pytestmark = pytest.mark.serial`.
- `@pytest.mark.slow` (usually a whole module): takes 10 s or more on 2 busy cores. Under xdist the modules
  holding one go out before the others, so that the short modules come last and the workers end together.
- `@pytest.mark.waits` (usually a whole module): spends most of its time waiting (sleeps, a subprocess's time
  limit) rather than computing. Under xdist these modules go out first, beside the serial tests, whose processes
  keep the cores busy meanwhile.
- `@pytest.mark.slurm`: runs jobs on a real one-node Slurm cluster (the `slurm_cluster` fixture); skipped with the
  reason where Slurm and munge are missing or the tests do not run as root. Under xdist every such test goes to one
  worker (one group), so one cluster serves them all.

Fixtures:
- `corpus` (module scope): read-only shards of the synthetic language of tests.helpers.synthetic_tokens
  (vocabulary tests.helpers.VOCAB), 8,192 validation and 2 x 60,000 training tokens. Train on it with
  `train_gpt.main(tests.helpers.tiny_args(corpus, tmp_path, NAME, **overrides))`: a 2-layer, 32-wide model, 8 steps.
- `one_thread`: one torch thread during the test, as in the subprocesses of tests.helpers.ENV, for bit-exact
  comparisons between a run in the test process and one in a subprocess.
- `slurm_cluster` (session scope): a one-node Slurm cluster of this test process (tests/slurm_cluster.py), stopped
  with every job and process of it at the end of the session.
- `tiny_flags` (module scope): the trainer's flags for a grid's tiny CPU runs on random GPT-2 tokens
  (`python -m grid ... -- *tiny_flags`, with tests.helpers.GRID_ENV).
A tiny model without a run: `tests.helpers.tiny_gpt(seed, noise, **overrides)` (its configuration alone:
`tests.helpers.tiny_config(**overrides)`). A trainer subprocess to signal at a known step:
`tests.helpers.stop_held_trainer(args, step, signum)`, or `env=tests.helpers.held_env(step)` and
`tests.helpers.PipedLines(proc).wait_for("held after step STEP")`.
Waits are bounded by `tests.helpers.wait_until` (never an assertion on how long something took).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import synthetic_tokens  # noqa: E402  (needs the root on sys.path)


def by_groups(config: pytest.Config) -> bool:
    """Whether xdist shares the work by xdist_group (`--dist loadgroup`; a worker sees it as `loadgroup`)."""
    return config.getoption("dist", "no") == "loadgroup" or config.getoption("loadgroup", False)


def pytest_configure(config: pytest.Config) -> None:
    if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # an xdist worker: share the cores, not fight for them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    if by_groups(config):
        config.option.loadscopereorder = False  # the order of pytest_collection_modifyitems: long units first


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    if by_groups(config):
        groups = {item: "serial" if "serial" in item.keywords else "slurm" if "slurm" in item.keywords
                  else Path(item.location[0]).stem for item in items}
        for item, group in groups.items():  # a module's tests together: its fixtures are built once
            item.add_marker(pytest.mark.xdist_group(group))
        marked = {mark: {groups[item] for item in items if mark in item.keywords} for mark in ("waits", "slow")}
        # the serial group, the longest unit, first, then the waiting and the slow modules; stable: each file's
        # order is kept
        items.sort(key=lambda item: (groups[item] != "serial", groups[item] not in marked["waits"],
                                     groups[item] not in marked["slow"]))


@pytest.fixture
def one_thread():
    """One torch thread for the test, as in the subprocesses of tests.helpers.ENV: bit-exact comparisons between a
    run in this process and one in a subprocess."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Shards of the synthetic language (tests.helpers.synthetic_tokens): 8,192 validation and 2 x 60,000 training
    tokens, for tiny trainer runs (tests.helpers.tiny_args)."""
    from data.shards import write_shard

    root = tmp_path_factory.mktemp("corpus")
    write_shard(root / "syn_val_000000.bin", synthetic_tokens(8192, seed=0))
    write_shard(root / "syn_train_000001.bin", synthetic_tokens(60000, seed=1))
    write_shard(root / "syn_train_000002.bin", synthetic_tokens(60000, seed=2))
    return root


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm cluster (tests/slurm_cluster.py): munged, slurmctld and slurmd of this test process, with
    their own files and ports; its jobs and processes are ended when the session ends (or, should this process die
    first, by its watchdog). Skips with the reason where it cannot start."""
    from tests.slurm_cluster import skip_reason, start_cluster, stop_cluster

    if reason := skip_reason():
        pytest.skip(reason)
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    stop_cluster(cluster)


@pytest.fixture(scope="module")
def tiny_flags(tmp_path_factory) -> list[str]:
    """Shared train_gpt.py flags of a grid's runs: a 1-layer, 16-wide model on random GPT-2 tokens (blocks of 64 hold
    the logic prompts of the report), on the CPU."""
    from data.shards import write_shard

    root = tmp_path_factory.mktemp("corpus")
    write_shard(root / "g_val_000000.bin", np.random.default_rng(0).integers(0, 50257, 4096))
    write_shard(root / "g_train_000001.bin", np.random.default_rng(1).integers(0, 50257, 8192))
    return ["--train-files", str(root / "g_train_*.bin"), "--val-files", str(root / "g_val_*.bin"),
            "--block-size", "64", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "16",
            "--batch-tokens", "32", "--micro-batch", "2", "--val-tokens", "32", "--device", "cpu", "--no-compile",
            "--log-every", "1"]
