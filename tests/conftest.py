"""Shared test setup: the repository root on sys.path, the `cuda` marker's skip rule, and the fixtures several test
modules use (helpers they share are in tests/helpers.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import synthetic_tokens  # noqa: E402  (needs the root on sys.path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
