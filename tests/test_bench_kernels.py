"""bench.kernels on the CPU: the GPT-2 training configuration of every Triton kernel built offline for sm_90 and
sm_80 with Triton's run-time specialisation (no spills, within shared memory, wgmma on Hopper, 16-byte loads where
the ECD table is aligned), built in this process as `python -m bench.kernels --subset` builds them; the command's
JSON and exit status. The full set is `python -m bench.kernels` (about a minute more)."""
from __future__ import annotations

import json

import pytest
import torch

from bench import kernels as bench_kernels

pytestmark = pytest.mark.slow  # 24 offline builds: ~15 s on 2 busy cores


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return bench_kernels.build_all(sorted(bench_kernels.TARGETS, reverse=True), subset=True)


def by(rows: list[dict], target: str, kernel: str, config: str = "d64 bf16 biases causal") -> dict:
    [row] = [r for r in rows if r["target"] == target and r["kernel"] == kernel and r["config"] == config]
    return row


def test_every_kernel_builds_for_both_targets_without_spills(rows: list[dict]) -> None:
    kernels = {"key_logit_bias", "attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq",
               "partial_dots_kernel", "apply_update_kernel", "moments_kernel"}
    for target in ("sm_90", "sm_80"):
        assert {r["kernel"] for r in rows if r["target"] == target} == kernels
    for row in rows:
        assert "error" not in row and row["problems"] == [] and row["registers"] > 0 and row["shipped"], row
        assert row["spill_bytes"] == 0 and row["shared_bytes"] <= bench_kernels.SHARED_LIMIT[int(row["target"][3:])]


def test_attention_uses_wgmma_on_hopper_and_mma_on_ampere(rows: list[dict]) -> None:
    for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
        assert by(rows, "sm_90", kernel)["hgmma"] > 0 and by(rows, "sm_80", kernel)["hgmma"] == 0
        assert by(rows, "sm_80", kernel)["hmma"] > 0
    fwd = by(rows, "sm_90", "attn_fwd")  # the shipped Hopper tile: 4 warps, 3 stages
    tile = bench_kernels.attn.TILES[("hopper", "fwd", 64)]
    assert (fwd["warps"], fwd["stages"]) == (tile.num_warps, tile.num_stages)


def test_the_ecd_alignment_hint_gives_16_byte_loads_and_fewer_registers(rows: list[dict]) -> None:
    for target in ("sm_90", "sm_80"):
        aligned = by(rows, target, "apply_update_kernel", "Π fp32")
        unaligned = by(rows, target, "apply_update_kernel", "Π fp32 unaligned")
        assert aligned["widest_load_bits"] == 128
        assert unaligned["widest_load_bits"] < 128
        assert aligned["registers"] < unaligned["registers"] and aligned["instructions"] < unaligned["instructions"]


def test_the_soap_step_loads_16_bytes_at_a_time(rows: list[dict]) -> None:
    for target in ("sm_90", "sm_80"):
        assert by(rows, target, "moments_kernel", "m, v fp32")["widest_load_bits"] == 128


def test_the_capture_specialises_as_the_jit_does() -> None:
    """Every pointer, T = 512 and the row stride 3C = 2304 of q, k, v viewed out of the (B, T, 3C) projection are
    16-divisible, H = 12 is not (the views are made as the model makes them)."""
    [fwd] = [x for x in bench_kernels.attention_launches(90, 64, "bf16", True, True) if x.kernel.fn.__name__ ==
             "_attn_fwd"]
    source, options = bench_kernels.specialise(fwd, bench_kernels.TARGETS["sm_90"])
    divisible = {path[0] for path, attrs in source.attrs.items() if ["tt.divisibility", 16] in attrs}
    tensors = {i for i, v in enumerate(fwd.args) if isinstance(v, torch.Tensor)}
    values = {i: v for i, v in enumerate(fwd.args) if isinstance(v, int)}
    assert tensors and tensors <= divisible and fwd.args[0].dtype == torch.bfloat16
    assert {i for i, v in values.items() if v in (512, 3 * 768)} <= divisible
    assert [i for i, v in values.items() if v == 12] and not {i for i, v in values.items() if v == 12} & divisible
    assert options["num_warps"] == bench_kernels.attn.TILES[("hopper", "fwd", 64)].num_warps


def test_problems_are_spills_and_shared_memory_over_the_limit() -> None:
    ok = {"target": "sm_80", "registers": 100, "spill_bytes": 0, "shared_bytes": 1024}
    assert bench_kernels.problems(ok) == []
    assert bench_kernels.problems({**ok, "spill_bytes": 8}) == ["spills 8 bytes"]
    assert bench_kernels.problems({**ok, "shared_bytes": 200_000}) == ["shared memory 200000 > 166912 bytes"]
    assert bench_kernels.problems({**ok, "target": "sm_90", "shared_bytes": 200_000}) == []


def test_the_command_writes_every_row_and_exits_1_only_for_a_shipped_build_with_a_problem(tmp_path, monkeypatch,
                                                                                          capsys):
    ok = {"kernel": "attn_fwd", "config": "d64", "target": "sm_90", "warps": 4, "stages": 3, "registers": 100,
          "spill_bytes": 0, "shared_bytes": 1024, "instructions": 10, "hgmma": 1, "hmma": 0, "tma": 0,
          "widest_load_bits": 128, "build_s": 0.1, "problems": [], "shipped": True}
    built = []

    def build_all(targets, subset, autotune_tiles, show):
        for row in built:
            show(row)
        return built

    monkeypatch.setattr(bench_kernels, "build_all", build_all)
    for spilled, code in ((False, 0), (True, 1)):
        built[:] = [ok, {**ok, "kernel": "attn_bwd_dq", "spill_bytes": 8, "problems": ["spills 8 bytes"],
                         "shipped": spilled}, {"kernel": "apply_update_kernel", "config": "Π fp32", "target": "sm_80",
                                               "error": "RuntimeError: ptxas failed", "shipped": False}]
        out = tmp_path / f"rows_{spilled}.json"
        assert bench_kernels.main(["--subset", "--json", str(out)]) == code  # autotuning candidates are flagged only
        assert json.loads(out.read_text()) == built
        text = capsys.readouterr().out
        assert "attn_bwd_dq" in text and "<- spills 8 bytes" in text and "build error: RuntimeError" in text
        assert text.rstrip().endswith(f"3 builds, {int(spilled)} shipped with problems")
