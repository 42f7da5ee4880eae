"""Muon: Newton–Schulz orthogonalisation, the Muon/AdamW split, and the update against a direct transcription."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from optim import OPTIMIZERS
from optim.muon import Muon, zeropower_via_newtonschulz5


@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (3, 32, 32)])
def test_newton_schulz_singular_values_near_one(shape):
    gen = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(*shape[:-2], shape[-2], shape[-2], generator=gen)).Q
    v = torch.linalg.qr(torch.randn(*shape[:-2], shape[-1], shape[-1], generator=gen)).Q
    k = min(shape[-2:])
    spread = torch.logspace(-1, 1, k)  # singular values over two decades
    g = u[..., :k] @ torch.diag_embed(spread.expand(*shape[:-2], k)) @ v[..., :k].mT
    out = zeropower_via_newtonschulz5(g, 5).float()
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.5 and s.max() < 1.3
    polar = u[..., :k] @ v[..., :k].mT  # the exact orthogonal factor U Vᵀ
    cos = (out * polar).sum((-2, -1)) / (out.norm(dim=(-2, -1)) * polar.norm(dim=(-2, -1)))
    assert cos.min() > 0.95


class Block(nn.Module):
    """A GPT-named toy: embeddings, a fused QKV matrix (3C×C), an MLP matrix, a LayerNorm."""

    def __init__(self, seed: int, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(11, 8)})
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(8, 24)})
        self.mlp = nn.Linear(24, 16)
        self.ln = nn.LayerNorm(16)
        self.b_q = nn.Parameter(0.1 * torch.randn(2, 8))  # a per-head bias: 2-D but not a weight matrix
        self.to(dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer["wte"](idx) + self.b_q.sum(0)
        return self.ln(self.mlp(torch.tanh(self.attn["c_attn"](x))))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(77 + step)
    idx = torch.randint(0, 11, (20,), generator=gen)
    return (model(idx) - torch.randn(20, 16, generator=gen)).square().mean()


def build(model: nn.Module, **flags) -> Muon:
    spec = OPTIMIZERS["muon"]
    return spec.build(model, spec.config(**flags))


def test_hidden_matrices_use_muon_and_the_rest_adamw():
    opt = build(Block(0))
    muon = {n for g in opt.param_groups if g["use_muon"] for n in g["names"]}
    assert muon == {"attn.c_attn.weight", "mlp.weight"}
    assert opt.blocks_of(opt.names.index("attn.c_attn.weight")) == 3
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs == {True: 0.02, False: 3e-4}


def test_steps_match_direct_transcription():
    model, ref = Block(1), Block(1)
    opt = build(model, weight_decay=0.1, decay_groups="all-but-embeddings")
    named = dict(ref.named_parameters())
    muon_names = ["attn.c_attn.weight", "mlp.weight"]
    decayed = [p for n, p in named.items() if n not in muon_names and not n.startswith("transformer")]
    assert len(decayed) == 5  # c_attn.bias, mlp.bias, ln.weight, ln.bias, b_q
    adam = torch.optim.AdamW([{"params": decayed}, {"params": [named["transformer.wte.weight"]], "weight_decay": 0.0}],
                             lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    buffers = {n: torch.zeros_like(named[n]) for n in muon_names}
    for step in range(4):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
        ref.zero_grad()
        loss_of(ref, step).backward()
        with torch.no_grad():
            for n in muon_names:
                p, g = named[n], named[n].grad
                buffers[n].lerp_(g, 0.05)
                nesterov = g.lerp(buffers[n], 0.95)
                blocks = nesterov.view(3, 8, 8) if n.startswith("attn") else nesterov[None]
                update = zeropower_via_newtonschulz5(blocks, 5).reshape(p.shape)
                scale = max(1.0, blocks.shape[1] / blocks.shape[2]) ** 0.5
                p.mul_(1 - 0.02 * 0.1).add_(update.float() * scale, alpha=-0.02)
        adam.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_muon_groups_reject_vectors():
    model = Block(2)
    with pytest.raises(ValueError, match="matrices"):
        Muon([{"params": [model.mlp.weight, model.ln.weight], "use_muon": True}])
