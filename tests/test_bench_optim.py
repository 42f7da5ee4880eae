"""bench.optim on a tiny model: every optimizer line reports median, min and max step times and the state size."""
from __future__ import annotations

import re

import pytest
import torch

from bench import optim as bench_optim

LINE = re.compile(r"^\s*(\S+):\s+([\d.]+) ms/step \(min ([\d.]+), max ([\d.]+)\) \|\s+([\d.]+) bytes/param")


def test_reports_median_min_max_and_state_bytes(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_optim, "copy_bandwidth", lambda device: 1e10)  # skip the 256 MiB copies
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and immune to other processes holding the cores
    try:
        bench_optim.main(["--optimizers", "sgdm,muon", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
                          "--batch", "1", "--seq-len", "16", "--steps", "3", "--warmup", "1", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "bf16 matmul" in header and "threads" in header, header
    rows = {m.group(1): [float(g) for g in m.groups()[1:]] for m in map(LINE.match, out.splitlines()) if m}
    assert set(rows) == {"sgdm", "muon"}, out
    for name, (median, low, high, state_bytes) in rows.items():
        assert 0 < low <= median <= high, (name, low, median, high)
    assert rows["sgdm"][3] == pytest.approx(4.0)  # one fp32 momentum buffer per parameter
