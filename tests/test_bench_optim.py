"""bench.optim on a tiny model: every variant reports median, min and max step times and the state size; variants
are compared with the peers of their optimizer measured in the same run; the peers load from files given on the
command line (stand-ins here: the repository carries no peer code)."""
from __future__ import annotations

import re
import textwrap

import pytest
import torch

from bench import optim as bench_optim
from tests.helpers import PUBLISHED_SOAP

LINE = re.compile(r"^\s*(\S+):\s+([\d.]+) ms/step \(min ([\d.]+), max ([\d.]+)\) \|\s+([\d.]+) bytes/param")
RATIO = re.compile(r"([\d.]+)x (\S+) \(([\d.]+)-([\d.]+)\)")
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--batch", "1", "--seq-len", "16", "--steps", "2",
        "--rounds", "2", "--warmup", "2", "--device", "cpu"]

# Stand-ins with the peers' interfaces: a published-SOAP-like class (tests.helpers.PUBLISHED_SOAP), and a
# modded-nanogpt-like train_gpt.py whose Muon calls torch.distributed collectives and whose script part must not run.
MODDED = textwrap.dedent('''
    import torch
    raise SystemExit("the training script ran")

    @torch.compile
    def zeropower_via_newtonschulz5(G: Tensor, steps: int) -> Tensor:
        return G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)

    class Muon(torch.optim.Optimizer):
        def __init__(self, params, lr=0.02, weight_decay=0.01, momentum=0.95):
            super().__init__(list(params), dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

        @torch.no_grad()
        def step(self):
            assert dist.get_rank() == 0 and dist.get_world_size() == 1
            futures = []
            for group in self.param_groups:
                for p in group["params"]:
                    futures.append(dist.reduce_scatter(p.grad, [p.grad], op=dist.ReduceOp.AVG, async_op=True)
                                   .get_future())
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    p.add_(zeropower_via_newtonschulz5(p.grad.lerp_(buf, group["momentum"]).bfloat16(), 5),
                           alpha=-group["lr"])
                    futures.append(dist.all_gather([p], p, async_op=True).get_future())
            torch.futures.collect_all(futures).wait()
''')


def run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[dict, dict, str]:
    monkeypatch.setattr(bench_optim, "copy_bandwidth", lambda device: 1e10)  # skip the 256 MiB copies
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and immune to other processes holding the cores
    try:
        bench_optim.main([*argv, *TINY])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows, ratios, last = {}, {}, None
    for line in out.splitlines():
        if m := LINE.match(line):
            last = m.group(1)
            rows[last] = [float(g) for g in m.groups()[1:]]
        elif last and (found := RATIO.findall(line)):
            ratios[last] = {ref: tuple(map(float, (mid, low, high))) for mid, ref, low, high in found}
    return rows, ratios, out


def test_reports_median_min_max_and_state_bytes(capsys, monkeypatch) -> None:
    rows, ratios, out = run(capsys, monkeypatch, "--optimizers", "sgdm,muon,soap:bf16,adamw")
    header = out.splitlines()[0]
    assert "bf16 matmul" in header and "threads" in header and "load" in header, header
    assert set(rows) == {"sgdm", "muon", "soap:bf16", "adamw"}, out
    for name, (median, low, high, state_bytes) in rows.items():
        assert 0 < low <= median <= high, (name, low, median, high)
    assert rows["sgdm"][3] == pytest.approx(4.0)  # one fp32 momentum buffer per parameter
    assert rows["soap:bf16"][3] < rows["adamw"][3]  # bf16 m and v (4 bytes) plus the factors and bases
    assert set(ratios["muon"]) == {"adamw"} and "adamw" not in ratios  # the baseline; itself not compared
    median, low, high = ratios["muon"]["adamw"]
    assert low <= median <= high


def test_peers_load_from_their_files_and_are_compared_with_their_optimizer(capsys, monkeypatch, tmp_path) -> None:
    (tmp_path / "soap.py").write_text(PUBLISHED_SOAP)
    (tmp_path / "train_gpt.py").write_text(MODDED)
    rows, ratios, out = run(capsys, monkeypatch, "--optimizers", "soap,soap:published,muon,muon:modded",
                            "--published-soap", str(tmp_path / "soap.py"),
                            "--modded-nanogpt", str(tmp_path / "train_gpt.py"))
    assert set(rows) == {"soap", "soap:published", "muon", "muon:modded"}, out
    assert set(ratios["soap"]) == {"soap:published"} and set(ratios["muon"]) == {"muon:modded"}, out
    assert rows["soap:published"][3] == pytest.approx(12.0)  # Adam's m and v, and the "factor" kept in a list


@pytest.mark.parametrize("argv, message", [
    (["--optimizers", "soap:published"], "soap:published needs --published-soap FILE"),
    (["--optimizers", "muon:modded", "--modded-nanogpt", "/nonexistent/train_gpt.py"], "muon:modded needs"),
])
def test_a_peer_without_its_file_is_refused(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_optim.main([*argv, *TINY])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_file_without_a_plain_muon_is_refused(tmp_path) -> None:
    (tmp_path / "train_gpt.py").write_text("import torch\n\ndef polar_express(G):\n    return G\n")
    with pytest.raises(SystemExit, match="no plain-PyTorch zeropower_via_newtonschulz5 and Muon"):
        bench_optim.load_modded_muon(tmp_path / "train_gpt.py")
