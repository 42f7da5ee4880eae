"""The fused ECD step kernels (kernels/ecd.py) against their PyTorch references, and the fused optimizer against the
reference optimizer path over whole runs (docs/optimizers.md#ecd).

On CPU the kernels run in Triton's interpreter: as in test_attention_kernel.py, this file runs itself once as a
subprocess with TRITON_INTERPRET=1 (`python tests/test_ecd_kernels.py RESULT.json`) and each test asserts on its entry
of the JSON it writes. The interpreter has no bf16; a bf16 Π travels as int16 bit patterns, so that path runs here too.
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tests.helpers import relative_difference

pytestmark = pytest.mark.slow  # the interpreter run: ~15 s

STEPS = 20


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 12), nn.LayerNorm(12))


def groups(model: nn.Module, weight_decay: float | str) -> list[dict]:
    """Matrices decayed by `weight_decay` and the rest not, or every parameter decayed ("all0.05", --decay-groups
    all: one group)."""
    if isinstance(weight_decay, str):
        return [{"params": list(model.parameters()), "weight_decay": float(weight_decay.removeprefix("all"))}]
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]


def run_ecd(fused: bool, projection: str, nu: float, weight_decay: float | str, steps: int = STEPS,
            optim_state_dtype: str = "fp32", device: str = "cpu") -> dict[str, torch.Tensor]:
    from optim.ecd import ECD

    model = tiny_model().to(device)
    opt = ECD(groups(model, weight_decay), lr=0.3, ecd_eta=4.0, ecd_f0=0.0, ecd_nu=nu, ecd_projection=projection,
              optim_seed=5, optim_state_dtype=optim_state_dtype, fused=fused)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = (torch.randn(32, 12, generator=gen).to(device) for _ in range(2))
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step(loss.detach())
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


RAGGED = [(0, 0, 1000), (1, 1000, 4103), (2, 4103, 6267)]  # keys' element ranges: 1000 and 4103 are not multiples of 16
ALIGNED = [(0, 0, 768), (1, 768, 768 + 4096), (2, 4864, 4864 + 2304)]  # GPT-2-like sizes: the alignment hint is on


def compare_kernels(ranges: list[tuple[int, int, int]], device: str = "cpu") -> dict:
    """partial_dots, sum_by_key and apply_update (with and without noise and decay) against their references on one
    chunk of three keys; relative errors."""
    from kernels import ecd as K

    gen = torch.Generator().manual_seed(0)
    n = ranges[-1][2]
    theta, grad, pi, z = (torch.randn(n, generator=gen).to(device) for _ in range(4))
    table = K.block_table(ranges, torch.device(device))
    out = {"align": table.align}
    got = K.partial_dots(theta, grad, pi, table)
    want = K.partial_dots_reference(theta, grad, pi, table)
    out["partial_dots"] = ((got - want).abs().max() / want.abs().max()).item()
    gather = K.key_gather_index(table.keys.tolist(), 3).to(device)
    direct = torch.stack([torch.stack([theta[lo:hi].double().dot(g[lo:hi].double()) for g in (theta, grad)])
                          for _, lo, hi in ranges])
    out["sum_by_key"] = (K.sum_by_key(got, gather)[:, :2] - direct).abs().max().item() / direct.abs().max().item()
    coef = {name: torch.tensor(value, dtype=torch.float64, device=device) for name, value in
            {"A": [0.9, 1.1, 0.7], "neg_k": -0.05, "h": 0.2, "inv_s": 1.3, "nu": 0.01}.items()}
    lam = torch.tensor([0.1, 0.0, 0.02], dtype=torch.float64, device=device)
    for name, zz, ll in (("update", None, None), ("update_noise_decay", z, lam)):
        a = [x.clone() for x in (theta, grad, pi)]
        b = [x.clone() for x in (theta, grad, pi)]
        K.apply_update(a[0], a[1], a[2], zz, table, coef, ll)
        K.apply_update_reference(b[0], b[1], b[2], zz, table, coef, ll)
        out[name] = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))
    return out


def kernel_checks() -> dict:
    """Each kernel against its reference on a ragged chunk of three keys (and an aligned one), bf16 Π's rounding."""
    from kernels import ecd as K

    out = compare_kernels(RAGGED)
    out["aligned"] = compare_kernels(ALIGNED)
    gen = torch.Generator().manual_seed(0)
    n = RAGGED[-1][2]
    theta, grad, pi = (torch.randn(n, generator=gen) for _ in range(3))
    table = K.block_table(RAGGED, torch.device("cpu"))
    coef = {name: torch.tensor(value, dtype=torch.float64) for name, value in
            {"A": [0.9, 1.1, 0.7], "neg_k": -0.05, "h": 0.2, "inv_s": 1.3, "nu": 0.01}.items()}
    # bf16 Π: round-to-nearest bit-identical to torch's; stochastic rounding unbiased and between the neighbours
    pi16 = pi.bfloat16()
    a, b = [theta.clone(), grad.clone(), pi16.clone()], [theta.clone(), grad.clone(), pi16.clone()]
    K.apply_update(*a, None, table, coef, None, stochastic=False)
    K.apply_update_reference(*b, None, table, coef, None)
    out["bf16_nearest_mismatches"] = int((a[2].view(torch.int16) != b[2].view(torch.int16)).sum())
    x = 1.0 + 2.0 ** -10  # a quarter of the way from bf16 1.0 to its next value 1.0078125
    m = 1 << 16
    flat = K.block_table([(0, 0, m)], torch.device("cpu"))
    keep = {"A": torch.tensor([x], dtype=torch.float64), "neg_k": torch.zeros((), dtype=torch.float64),
            "h": torch.zeros((), dtype=torch.float64), "inv_s": torch.ones((), dtype=torch.float64),
            "nu": torch.zeros((), dtype=torch.float64)}  # Π ← x · Π from Π = 1: every element is set to x
    rounded = []
    for seed in (1, 2):
        p16 = torch.ones(m, dtype=torch.bfloat16)
        K.apply_update(torch.zeros(m), torch.zeros(m), p16, None, flat, keep, None, seed=seed)
        rounded.append(p16.float())
    out["sr_mean_error"] = abs(rounded[0].double().mean().item() - x) / x
    out["sr_values"] = sorted({round(v, 8) for v in rounded[0].unique().tolist()})
    out["sr_seed_differs"] = bool((rounded[0] != rounded[1]).any())
    out["sr_nearest_error"] = abs(torch.tensor(x).bfloat16().item() - x) / x
    return out


def optimizer_checks() -> dict:
    out, fused_runs = {}, {}
    for projection in ("global", "per_tensor"):
        for nu in (0.0, 0.3):
            for wd in (0.0, 0.05, "all0.05"):
                name = f"{projection}_nu{nu}_wd{wd}"
                fused = fused_runs[name] = run_ecd(True, projection, nu, wd)
                out[name] = relative_difference(fused, run_ecd(False, projection, nu, wd))
                out[name + "_moved"] = relative_difference(fused, tiny_model().state_dict())
    first, again = fused_runs["global_nu0.3_wd0.05"], run_ecd(True, "global", 0.3, 0.05)
    out["fused_bitwise_repeatable"] = all(torch.equal(first[k], again[k]) for k in first)
    fp32 = run_ecd(False, "global", 0.0, 0.0, steps=100)
    out["bf16_sr_100_steps"] = relative_difference(run_ecd(True, "global", 0.0, 0.0, 100, "bf16"), fp32)
    out["bf16_nearest_100_steps"] = relative_difference(run_ecd(False, "global", 0.0, 0.0, 100, "bf16"), fp32)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.helpers import interpreter_results

    return interpreter_results(__file__, tmp_path_factory)


def assert_kernels_match(k: dict) -> None:
    assert k["partial_dots"] < 1e-5 and k["sum_by_key"] < 1e-6
    assert k["update"] < 1e-6 and k["update_noise_decay"] < 1e-6


def test_kernels_match_their_references(results: dict) -> None:
    assert results["kernels"]["align"] == 1 and results["kernels"]["aligned"]["align"] == 16
    assert_kernels_match(results["kernels"])
    assert_kernels_match(results["kernels"]["aligned"])


def test_the_alignment_hint_is_given_only_where_every_block_starts_and_ends_on_it() -> None:
    from kernels import ecd as K

    assert K.block_table(ALIGNED, torch.device("cpu")).align == K.ALIGN == 16
    assert K.block_table(RAGGED, torch.device("cpu")).align == 1
    assert K.block_table([(0, 16, 48)], torch.device("cpu"), block=24).align == 1  # blocks of 24 end off the grid
    table = K.block_table([(0, 0, 4096 + 32)], torch.device("cpu"))
    assert table.starts.tolist() == [0, 2048, 4096] and table.lengths.tolist() == [2048, 2048, 32]


def test_bf16_pi_round_to_nearest_matches_torch(results: dict) -> None:
    assert results["kernels"]["bf16_nearest_mismatches"] == 0


def test_stochastic_rounding_is_unbiased(results: dict) -> None:
    k = results["kernels"]
    assert k["sr_values"] == [1.0, 1.0078125]  # only the two bf16 neighbours of x
    assert k["sr_mean_error"] < 0.02 * k["sr_nearest_error"]  # nearest rounding is off by 2^-10 every time
    assert k["sr_seed_differs"]


@pytest.mark.parametrize("projection", ["global", "per_tensor"])
@pytest.mark.parametrize("nu", [0.0, 0.3])
@pytest.mark.parametrize("wd", [0.0, 0.05, "all0.05"])
def test_fused_optimizer_equals_reference_over_20_steps(results: dict, projection: str, nu: float, wd) -> None:
    name = f"{projection}_nu{nu}_wd{wd}"
    assert results["optimizer"][name + "_moved"] > 0.05  # the run moved
    assert results["optimizer"][name] < 1e-5


def test_fused_step_is_bitwise_repeatable(results: dict) -> None:
    assert results["optimizer"]["fused_bitwise_repeatable"]


def test_bf16_pi_with_stochastic_rounding_stays_near_fp32(results: dict) -> None:
    o = results["optimizer"]
    assert o["bf16_sr_100_steps"] < 0.05, o


@pytest.mark.cuda
@pytest.mark.parametrize("ranges", [RAGGED, ALIGNED], ids=["ragged", "aligned"])
def test_fp32_kernels_match_the_torch_path_on_cuda(ranges) -> None:
    assert_kernels_match(compare_kernels(ranges, "cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("projection", ["global", "per_tensor"])
def test_fused_optimizer_equals_the_torch_path_on_cuda(projection: str) -> None:
    fused = run_ecd(True, projection, 0.3, 0.05, device="cuda")
    assert relative_difference(fused, tiny_model().state_dict()) > 0.05  # the run moved
    assert relative_difference(fused, run_ecd(False, projection, 0.3, 0.05, device="cuda")) < 1e-5


@pytest.mark.cuda
def test_bf16_pi_stochastic_rounding_is_unbiased_on_cuda() -> None:
    """Π ← A·Π in fp32, stored in bf16 with stochastic rounding: every element lands on one of its two bf16
    neighbours, and over 64 seeds the mean rounding error of 2^18 positive elements (truncation would be biased low)
    lies within 3 standard errors of the per-seed means of zero. Round-to-nearest matches torch's conversion."""
    from kernels import ecd as K

    n, a = 1 << 18, 1.0 + 3 * 2.0 ** -11
    gen = torch.Generator(device="cuda").manual_seed(0)
    pi0 = (torch.randn(n, device="cuda", generator=gen).abs() + 0.5).bfloat16()
    exact = pi0.float() * a  # Π before rounding (θ and g are zero, so only A acts)
    down = (exact.view(torch.int32) >> 16).to(torch.int16)  # the bf16 neighbour towards zero, as bits
    table = K.block_table([(0, 0, n)], torch.device("cuda"))
    coef = {name: torch.tensor(value, dtype=torch.float64, device="cuda")
            for name, value in {"A": [a], "neg_k": 0.0, "h": 0.0, "inv_s": 1.0, "nu": 0.0}.items()}
    zeros = torch.zeros(n, device="cuda")
    means = []
    for seed in range(64):
        pi = pi0.clone()
        K.apply_update(zeros.clone(), zeros, pi, None, table, coef, None, seed=seed)
        bits = pi.view(torch.int16)
        assert ((bits == down) | (bits == down + 1)).all()
        means.append((pi.float() - exact).double().mean().item())
    means_t = torch.tensor(means, dtype=torch.float64)
    standard_error = means_t.std().item() / len(means) ** 0.5
    assert abs(means_t.mean().item()) < 3 * standard_error, (means_t.mean().item(), standard_error)
    nearest = pi0.clone()
    K.apply_update(zeros.clone(), zeros, nearest, None, table, coef, None, stochastic=False)
    assert torch.equal(nearest.view(torch.int16), exact.bfloat16().view(torch.int16))


if __name__ == "__main__":
    from tests.helpers import write_interpreter_results

    write_interpreter_results(sys.argv[1], kernels=kernel_checks, optimizer=optimizer_checks)
