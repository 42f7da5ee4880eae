"""SOAP against docs/optimizers.md: Adam when the basis is the identity, a float64 NumPy transcription, a rotated
quadratic."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import optim.soap
from optim.soap import SOAP
from tests.helpers import published_eigenbasis, reference_soap


class Net(nn.Module):
    """Matrices with one side above max_precond_dim=8, 1-D biases and a 3-D tensor (for merge_dims).

    Every rotated side has a full-rank Gram after one batch (docs/optimizers.md numerics): otherwise the eigenbasis of
    the null space is arbitrary and two correct implementations legitimately disagree.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = nn.Linear(10, 6)
        self.l2 = nn.Linear(6, 6)
        self.mix = nn.Parameter(0.3 * torch.randn(2, 3, 6))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        return torch.cat([self.l2(h), torch.einsum("bij,ijk->bk", h.view(-1, 2, 3), self.mix)], dim=1)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(32, 10, generator=gen, dtype=torch.float64)
    y = torch.randn(32, 12, generator=gen, dtype=torch.float64)
    return ((model(x) - y) ** 2).mean()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()


def groups(model: nn.Module, weight_decay: float) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("merge", [False, True])
def test_matches_numpy_transcription(merge):
    pre1d = False  # a 1-D factor g gᵀ has rank 1: its null-space basis is arbitrary (covered by the identity test)
    settings = dict(lr=0.02, beta1=0.9, beta2=0.95, eps=1e-8, soap_precondition_frequency=3, soap_max_precond_dim=8,
                    soap_merge_dims=merge, soap_precondition_1d=pre1d, soap_shampoo_beta=0.9)
    model = Net(0)
    opt = SOAP(groups(model, 0.05), **settings)
    train(model, opt, 14)
    ref_model = Net(0)
    order = [p for g in groups(ref_model, 0.05) for p in g["params"]]
    wds = [g["weight_decay"] for g in groups(ref_model, 0.05) for _ in g["params"]]

    def grad_fn(arrays, step):
        with torch.no_grad():
            for p, a in zip(order, arrays):
                p.copy_(torch.from_numpy(a))
        ref_model.zero_grad()
        loss_of(ref_model, step).backward()
        return [p.grad.numpy().copy() for p in order]

    start = [p.detach().numpy().copy() for p in order]
    ref = reference_soap([a.copy() for a in start], grad_fn, 14, settings["lr"], (0.9, 0.95), settings["eps"],
                         wds, 3, 8, merge, pre1d, 0.9)
    got = [p.detach().numpy() for p in opt.params_in_order]
    moved = np.sqrt(sum(np.sum((r - s) ** 2) for r, s in zip(ref, start)))
    assert moved > 0.05
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-9 * moved)


class Square(nn.Module):
    """One 8×8 matrix fed `rows` samples per step: its first gradient, and so its first Kronecker factors, have rank
    min(rows, 8); fewer than 8 rows leave null spaces whose eigenbasis is arbitrary. (A non-square matrix always
    has one: G Gᵀ and Gᵀ G of a 6×10 gradient have rank 6.)"""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.w = nn.Parameter(0.3 * torch.randn(8, 8, dtype=torch.float64))


def square_soap_runs(rows: int, steps: int, eigenbases) -> tuple[list[np.ndarray], list[list[np.ndarray]], float]:
    """Ours and the published transcription (once per first-basis rule in `eigenbases`) on Square for `steps`
    steps of a least-squares loss; returns ours, the transcriptions and the distance the transcription moved."""
    settings = dict(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, soap_precondition_frequency=5, soap_max_precond_dim=100)

    def grad(w: np.ndarray, step: int) -> np.ndarray:
        gen = np.random.default_rng(1000 + step)
        x, y = gen.standard_normal((rows, 8)), gen.standard_normal((rows, 8))
        return 2 * (x @ w.T - y).T @ x / rows

    model = Square()
    start = model.w.detach().numpy().copy()
    opt = SOAP([model.w], weight_decay=0.0, **settings)
    for step in range(steps):
        opt.zero_grad()
        model.w.grad.copy_(torch.from_numpy(grad(model.w.detach().numpy(), step)))
        opt.step()
    refs = [reference_soap([start.copy()], lambda arrays, step: [grad(arrays[0], step)], steps, settings["lr"],
                           (0.9, 0.95), settings["eps"], [0.0], 5, 100, False, False, None, basis)[0]
            for basis in eigenbases]
    return model.w.detach().numpy(), refs, float(np.linalg.norm(refs[0] - start))


def null_space_rotated(factor):
    """Another exact eigenbasis of `factor`: the eigenvectors of its (numerically) zero eigenvalues turned by a
    random rotation within that null space."""
    values, vectors = np.linalg.eigh(factor)
    null = values < 1e-12 * values.max()
    turn = np.linalg.qr(np.random.default_rng(7).standard_normal((null.sum(), null.sum())))[0]
    vectors[:, null] = vectors[:, null] @ turn
    return np.flip(vectors, 1)


def test_matches_the_published_soap_over_60_steps_with_full_rank_factors():
    ours, (ref,), moved = square_soap_runs(rows=32, steps=60, eigenbases=[published_eigenbasis])
    assert moved > 0.1
    assert np.linalg.norm(ours - ref) < 1e-9 * moved


def test_rank_deficient_factors_leave_the_trajectory_to_the_choice_of_null_space_basis():
    """With 3 rows per step the first factors have rank 3: ours departs from the published transcription, and so
    does the transcription itself when only its first bases' null-space vectors are turned (another exact
    eigendecomposition of the same factors): the difference is which null-space basis eigh returns, not the update
    (docs/optimizers.md#soap)."""
    ours, (ref, turned), moved = square_soap_runs(rows=3, steps=60,
                                                eigenbases=[published_eigenbasis, null_space_rotated])
    ours_off, turned_off = np.linalg.norm(ours - ref) / moved, np.linalg.norm(turned - ref) / moved
    assert ours_off > 1e-3 and turned_off > 1e-3
    assert turned_off > 0.1 * ours_off


def adam_reference(model: nn.Module, steps: int, lr: float, betas, eps: float) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=eps)
    train(model, opt, steps)


def test_without_rotation_equals_adam():
    model, ref = Net(1), Net(1)
    opt = SOAP(model.parameters(), lr=0.01, beta1=0.9, beta2=0.99, eps=1e-16, weight_decay=0.0, soap_max_precond_dim=0)
    assert all(not r.tensor_owned for r in opt.regions)
    opt.zero_grad()
    loss_of(model, 0).backward()
    opt.step()  # the skipped first step: no update
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    train(model, opt, 8)
    adam_reference(ref, 8, 0.01, (0.9, 0.99), 1e-16)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_basis_frozen_at_identity_equals_adam(monkeypatch):
    monkeypatch.setattr(optim.soap, "eigenbasis", lambda f: torch.eye(f.shape[-1], dtype=f.dtype).expand_as(f).clone())
    model, ref = Net(2), Net(2)
    opt = SOAP(model.parameters(), lr=0.01, beta1=0.9, beta2=0.99, eps=1e-16, weight_decay=0.0,
               soap_precondition_frequency=10**9, soap_max_precond_dim=100, soap_precondition_1d=True)
    assert all(r.tensor_owned for r in opt.regions)
    train(model, opt, 1)
    train(model, opt, 8)
    adam_reference(ref, 8, 0.01, (0.9, 0.99), 1e-16)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def rotated_quadratic(seed: int, n: int = 12):
    """f(X) = ½‖A(X − X*)B‖² with A, B symmetric, randomly rotated, condition 10^1.5 each (Hessian 10^6)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    spread = torch.logspace(0, 1.5, n, dtype=torch.float64)
    a, b = u @ torch.diag(spread) @ u.T, v @ torch.diag(spread) @ v.T
    target = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return lambda x: 0.5 * (a @ (x - target) @ b).square().sum()


def final_loss(make_opt, seed: int, steps: int = 300) -> float:
    f = rotated_quadratic(seed)
    x = nn.Parameter(torch.zeros(12, 12, dtype=torch.float64))
    opt = make_opt([x])
    for _ in range(steps):
        opt.zero_grad()
        f(x).backward()
        opt.step()
    return f(x).item()


def test_beats_adam_on_rotated_ill_conditioned_quadratic():
    lrs = [0.003, 0.01, 0.03, 0.1]
    adam = min(final_loss(lambda p: torch.optim.Adam(p, lr=lr, betas=(0.95, 0.95)), 0) for lr in lrs)
    soap = min(final_loss(lambda p: SOAP(p, lr=lr, weight_decay=0.0), 0) for lr in lrs)
    start = final_loss(lambda p: torch.optim.SGD(p, lr=0.0), 0, steps=1)
    assert soap < 0.1 * adam < 0.1 * start
