"""The fused SOAP step kernel (kernels/soap.py) against its PyTorch reference, and the fused optimizer against the
reference optimizer path over whole runs (docs/optimizers.md#soap).

On CPU the kernel runs in Triton's interpreter: as in test_ecd_kernels.py, this file runs itself once as a subprocess
with TRITON_INTERPRET=1 (`python tests/test_soap_kernels.py RESULT.json`) and each test asserts on its entry of the
JSON it writes. The interpreter has no bf16; bf16 moments travel as int16 bit patterns, so that path runs here too.
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from tests.helpers import relative_difference

pytestmark = pytest.mark.slow  # the interpreter run: ~10 s

STEPS = 20


def tiny_model() -> nn.Module:
    """Two same-shaped matrices (one batch), one of another shape, vectors (plain Adam); one side of the first
    matrices above max_precond_dim (rotated on one side only)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 40),
                         nn.LayerNorm(40))


def make(model: nn.Module, fused: bool, optim_state_dtype: str = "fp32", seed: int = 3):
    from optim.soap import SOAP

    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return SOAP([{"params": matrices, "weight_decay": 0.05}, {"params": vectors, "weight_decay": 0.0}], lr=0.01,
                beta1=0.9, beta2=0.95, eps=1e-6, soap_precondition_frequency=3, soap_max_precond_dim=32,
                optim_seed=seed, optim_state_dtype=optim_state_dtype, fused=fused)


def train(model: nn.Module, opt, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(64, 12, generator=gen), torch.randn(64, 40, generator=gen)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()


def run_soap(fused: bool, optim_state_dtype: str = "fp32", steps: int = STEPS, seed: int = 3) -> dict:
    model = tiny_model()
    opt = make(model, fused, optim_state_dtype, seed)
    assert opt.fused == fused
    train(model, opt, steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def kernel_checks() -> dict:
    """The kernel against its reference on a ragged chunk of three pieces."""
    from kernels import soap as K

    gen = torch.Generator().manual_seed(0)
    n = 2 * K.BLOCK + 123
    pieces = [(5000, 0, 700), (0, 700, K.BLOCK + 9), (9000, K.BLOCK + 9, n)]
    table = K.block_table(pieces, torch.device("cpu"))
    g = torch.randn(n, generator=gen)
    m, v = 0.1 * torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    out = {}
    args = (0.9, 0.95, 1e-8)
    a = [g.clone(), m.clone(), v.clone(), torch.empty(n)]
    b = [g.clone(), m.clone(), v.clone(), torch.empty(n)]
    K.moments(*a, table, *args)
    K.moments_reference(*b, table, *args)
    out["fp32"] = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a[1:], b[1:]))
    in_place = [g.clone(), m.clone(), v.clone()]
    K.moments(in_place[0], in_place[1], in_place[2], in_place[0], table, *args)  # d written over g′
    out["in_place"] = ((in_place[0] - b[3]).abs().max() / b[3].abs().max()).item()
    # bf16 m, v: round-to-nearest bit-identical to torch's, d from the unrounded moments in both
    a = [g.clone(), m.bfloat16(), v.bfloat16(), torch.empty(n)]
    b = [g.clone(), m.bfloat16(), v.bfloat16(), torch.empty(n)]
    K.moments(*a, table, *args, stochastic=False)
    K.moments_reference(*b, table, *args)
    out["bf16_nearest_mismatches"] = sum(int((x.view(torch.int16) != y.view(torch.int16)).sum())
                                         for x, y in zip(a[1:3], b[1:3]))
    out["bf16_direction"] = ((a[3] - b[3]).abs().max() / b[3].abs().max()).item()
    # Stochastic rounding: β = 0 sets m = g′ = x, 1/8 of the way from 1.0 to the next bf16 value, and v = x² (≈ 1/4)
    x, count, seeds = 1.0 + 2.0**-10, 4096, range(1, 33)
    flat = K.block_table([(0, 0, count)], torch.device("cpu"))
    rounded_m, rounded_v = [], []
    for seed in seeds:
        m16, v16 = torch.zeros(count, dtype=torch.bfloat16), torch.zeros(count, dtype=torch.bfloat16)
        K.moments(torch.full((count,), x), m16, v16, torch.empty(count), flat, 0.0, 0.0, 1e-8, seed=seed)
        rounded_m.append(m16.double())
        rounded_v.append(v16.double())
    rounded_m, rounded_v = torch.stack(rounded_m), torch.stack(rounded_v)
    out["sr_values"] = sorted(rounded_m.unique().tolist())
    out["sr_mean_error_m"] = abs(rounded_m.mean().item() - x) / x
    out["sr_mean_error_v"] = abs(rounded_v.mean().item() - x * x) / (x * x)
    out["sr_nearest_error"] = abs(torch.tensor(x).bfloat16().item() - x) / x
    out["sr_seed_differs"] = bool((rounded_m[0] != rounded_m[1]).any())
    # m's and v's bits are different halves of one draw: their rounding directions are not the same coin
    up_m, up_v = rounded_m > x, rounded_v > x * x
    out["sr_m_v_agreement"] = (up_m == up_v).double().mean().item()
    # The bits follow the element key, not the position in the chunk: the same keys laid out in another order
    values = torch.linspace(1.0, 2.0, 3000)
    first = torch.zeros(3000, dtype=torch.bfloat16)
    K.moments(values, first, torch.zeros_like(first), torch.empty(3000),
              K.block_table([(100, 0, 1000), (7000, 1000, 3000)], torch.device("cpu")), 0.0, 0.0, 1e-8, seed=4)
    swapped_values = torch.cat([values[1000:], values[:1000]])
    second = torch.zeros(3000, dtype=torch.bfloat16)
    K.moments(swapped_values, second, torch.zeros_like(second), torch.empty(3000),
              K.block_table([(7000, 0, 2000), (100, 2000, 3000)], torch.device("cpu")), 0.0, 0.0, 1e-8, seed=4)
    out["sr_keyed_by_element"] = bool(torch.equal(torch.cat([second[2000:], second[:2000]]), first))
    return out


def optimizer_checks() -> dict:
    out = {}
    fused, reference = run_soap(True), run_soap(False)
    out["fused_vs_reference"] = relative_difference(fused, reference)
    out["moved"] = relative_difference(fused, tiny_model().state_dict())
    out["fused_bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(fused.values(), run_soap(True).values()))
    out["bf16_sr_40_steps"] = relative_difference(run_soap(True, "bf16", 40), run_soap(False, steps=40))
    out["bf16_seed_matters"] = relative_difference(run_soap(True, "bf16", 10, seed=4), run_soap(True, "bf16", 10))
    # Resume: 7 steps, save, 8 more (two refreshes); again from the saved state in a new optimizer
    model = tiny_model()
    opt = make(model, True, "bf16")
    train(model, opt, 7)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, 8, first=7)
    resumed = tiny_model()
    resumed.load_state_dict(saved["model"])
    opt2 = make(resumed, True, "bf16")
    opt2.load_state_dict(saved["opt"])
    train(resumed, opt2, 8, first=7)
    out["bf16_resume_exact"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                    resumed.state_dict().values()))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.helpers import interpreter_results

    return interpreter_results(__file__, tmp_path_factory)


def test_kernel_matches_its_reference(results: dict) -> None:
    k = results["kernels"]
    assert k["fp32"] < 1e-6 and k["in_place"] < 1e-6, k


def test_bf16_round_to_nearest_matches_torch(results: dict) -> None:
    k = results["kernels"]
    assert k["bf16_nearest_mismatches"] == 0 and k["bf16_direction"] < 1e-6, k


def test_stochastic_rounding_is_unbiased_over_seeds(results: dict) -> None:
    k = results["kernels"]
    assert k["sr_values"] == [1.0, 1.0078125]  # only the two bf16 neighbours of x
    assert k["sr_mean_error_m"] < 0.05 * k["sr_nearest_error"]  # nearest rounding is off by 2^-10 every time
    assert k["sr_mean_error_v"] < 0.05 * k["sr_nearest_error"]
    assert k["sr_seed_differs"]
    # m rounds up 1/8 and v 1/4 of the time: agreement 0.69 for independent bits, 0.875 for the same bits
    assert 0.6 < k["sr_m_v_agreement"] < 0.8


def test_stochastic_rounding_follows_the_element_not_the_layout(results: dict) -> None:
    assert results["kernels"]["sr_keyed_by_element"]


def test_fused_optimizer_equals_reference_over_20_steps(results: dict) -> None:
    o = results["optimizer"]
    assert o["moved"] > 0.05, o
    assert o["fused_vs_reference"] < 1e-5, o


def test_fused_step_is_bitwise_repeatable(results: dict) -> None:
    assert results["optimizer"]["fused_bitwise_repeatable"]


def test_bf16_moments_with_stochastic_rounding_stay_near_fp32(results: dict) -> None:
    o = results["optimizer"]
    assert o["bf16_sr_40_steps"] < 0.02, o
    assert o["bf16_seed_matters"] > 0, o


def test_bf16_resume_is_exact(results: dict) -> None:
    assert results["optimizer"]["bf16_resume_exact"]


@pytest.mark.cuda
def test_fused_soap_on_cuda_equals_reference() -> None:
    """On the GPU (no interpreter): fused = unfused in fp32, bf16 moments near fp32, resume exact."""
    def run(fused: bool, dtype: str, steps: int = STEPS) -> dict:
        model = tiny_model().cuda()
        opt = make(model, fused, dtype)
        assert opt.fused == fused
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(64, 12, generator=gen).cuda(), torch.randn(64, 40, generator=gen).cuda()
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            opt.step()
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    reference = run(False, "fp32")
    assert relative_difference(run(True, "fp32"), reference) < 1e-5
    assert relative_difference(run(True, "bf16", 60), run(False, "fp32", 60)) < 0.02


if __name__ == "__main__":
    from tests.helpers import write_interpreter_results

    write_interpreter_results(sys.argv[1], kernels=kernel_checks, optimizer=optimizer_checks)
