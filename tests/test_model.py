"""The GPT-2 model and the symmetry-breaking biases (docs/model.md)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import train_gpt
from kernels.attention_paths import attention_reference
from tests.helpers import tiny_config, tiny_gpt
from train_gpt import GPT, BiasSampler, GPTConfig, mean_biases
from variants import ModelVariants

SMALL = dict(vocab_size=97, block_size=16, n_embd=16)  # this file's model: the tests' tiny GPT with these fields


def test_gpt2_124m_parameter_count():
    cfg = train_gpt.parse_config(["--preset", "gpt2-124m"])
    model_cfg = cfg.model
    assert cfg.preset == "gpt2-124m"
    with torch.device("meta"):
        model = GPT(model_cfg)  # the preset's full-size model, built on the meta device: not a tiny one
    assert model.get_num_params() == 124_119_552
    assert model_cfg.activation == "prelu" and model_cfg.block_size == 512


def test_gelu_preset_drops_prelu_slopes():
    model_cfg = train_gpt.parse_config(["--preset", "gpt2-124m-gelu"]).model
    with torch.device("meta"):
        model = GPT(model_cfg)  # the preset's full-size model, built on the meta device: not a tiny one
    assert model.get_num_params() == 124_119_552 - 12 * 4 * 768


def test_state_dict_names_follow_nanogpt():
    names = set(tiny_gpt(**SMALL).state_dict())
    for expected in ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                     "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.bias",
                     "transformer.h.1.ln_2.bias", "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.act.weight",
                     "transformer.h.1.mlp.c_proj.weight", "transformer.ln_f.weight", "lm_head.weight"]:
        assert expected in names
    assert not any("mean_biases" in n for n in names)


def test_init_scales_residual_projections():
    model = tiny_gpt(0, block_size=8, n_layer=6, n_head=4, n_embd=256)
    block = model.transformer.h[0]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(12), rel=0.05)
    assert block.mlp.act.weight.mean().item() == pytest.approx(0.2, abs=0.1)
    assert block.attn.c_attn.bias.abs().max().item() == 0.0


def random_qkv(B=2, H=3, T=7, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, H, T, d, generator=g, dtype=dtype) for _ in range(3)]


def manual_attention(q, k, v):
    T, d = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("per_head", [False, True])
def test_value_bias_on_output_equals_bias_on_values(per_head):
    q, k, v = random_qkv()
    b_v = torch.randn(3, 8, dtype=torch.float64) if per_head else torch.randn(8, dtype=torch.float64)
    expected = manual_attention(q, k, v + (b_v.unsqueeze(1) if per_head else b_v))
    torch.testing.assert_close(attention_reference(q, k, v, b_v=b_v), expected)


def test_query_bias_equals_per_key_logit_bias():
    q, k, v = random_qkv()
    b_q = torch.randn(8, dtype=torch.float64)
    key_logit_bias = (k @ b_q) / math.sqrt(8)  # (B, H, T): one additive logit per key
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    mask = key_logit_bias.unsqueeze(-2).masked_fill(causal, float("-inf"))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(attention_reference(q, k, v, b_q=b_q), expected)
    assert (attention_reference(q, k, v, b_q=b_q) - attention_reference(q, k, v)).abs().max() > 1e-3


@pytest.mark.parametrize("per_head", [False, True])
def test_key_bias_is_a_no_op(per_head):
    """A key bias b_K ~ N(μ_Q, σ_Q²) adds (q_i + b_Q)·b_K/√d to every logit of row i, a constant the softmax removes:
    added to every key (through the key rows of c_attn's bias), with sampled b_Q and b_V present, it changes no
    output. The same shift on the query rows does (the check can fail)."""
    model = tiny_gpt(0, **SMALL, bias_per_head=per_head, mean_v=0.5).double()
    cfg = model.config
    idx = torch.randint(0, 97, (2, 16))
    biases = BiasSampler(cfg, seed=3).sample(step=5).double()
    before = model(idx, biases=biases, all_logits=True)[0]
    std_q, _ = train_gpt.bias_stds(cfg)
    C, gen = cfg.n_embd, torch.Generator().manual_seed(4)
    shifts = [cfg.mean_q + std_q.double() * torch.randn(cfg.n_head if per_head else 1, cfg.head_dim,
                                                         generator=gen, dtype=torch.float64) for _ in range(2)]
    with torch.no_grad():
        for block, b_k in zip(model.transformer.h, shifts):
            block.attn.c_attn.bias[C:2 * C] += b_k.expand(cfg.n_head, -1).reshape(C)
    torch.testing.assert_close(model(idx, biases=biases, all_logits=True)[0], before, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        for block, b_k in zip(model.transformer.h, shifts):
            block.attn.c_attn.bias[:C] += b_k.expand(cfg.n_head, -1).reshape(C)
    assert (model(idx, biases=biases, all_logits=True)[0] - before).abs().max() > 1e-5


def test_without_targets_the_head_projects_the_last_position_only():
    """Generation reads the last position's logits: without targets the head runs on B rows, not B·T; all_logits
    (evaluations, export checks) and a loss see every position, the same numbers."""
    model = tiny_gpt(0, **SMALL).double()
    idx = torch.randint(0, 97, (3, 16))
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:2]))
    last, every = model(idx)[0], model(idx, all_logits=True)[0]
    assert last.shape == (3, 1, 97) and every.shape == (3, 16, 97) and rows == [(3, 1), (3, 16)]
    torch.testing.assert_close(last, every[:, -1:], rtol=1e-12, atol=1e-12)  # a (B, C) product rounds alike
    logits, loss = model(idx, idx)
    torch.testing.assert_close(logits, every, rtol=0, atol=0)
    assert rows[-1] == (3, 16) and loss is not None


def test_the_model_config_lists_the_architecture_before_the_variants():
    names = [f.name for f in dataclasses.fields(GPTConfig)]
    variants = [f.name for f in dataclasses.fields(ModelVariants)]
    assert names[:5] == ["vocab_size", "block_size", "n_layer", "n_head", "n_embd"]
    assert names[-len(variants):] == variants


@pytest.mark.parametrize("mode", ["bq", "bv", "bqbv"])
def test_evaluation_uses_the_means(mode):
    model = tiny_gpt(0, **SMALL, bias_mode=mode, mean_v=0.5).double()
    cfg = model.config
    idx = torch.randint(0, 97, (2, 16))
    at_means = model(idx, biases=mean_biases(cfg).double(), all_logits=True)[0]
    torch.testing.assert_close(model(idx, all_logits=True)[0], at_means)
    sampled = model(idx, biases=BiasSampler(cfg, seed=0).sample(0).double(), all_logits=True)[0]
    assert (sampled - at_means).abs().max() > 1e-6


def test_mean_biases_fold_into_a_standard_gpt2():
    """At the means, q + μ_Q = x A_Q + (c_Q + μ_Q) and c_proj(y + μ_V) = c_proj(y) + W_O μ_V (docs/model.md)."""
    broken = tiny_gpt(0, **SMALL, bias_mode="bqbv", mean_v=0.5).double()
    cfg = broken.config
    plain = tiny_gpt(**SMALL, bias_mode="none").double()
    plain.load_state_dict(broken.state_dict())
    C = cfg.n_embd
    with torch.no_grad():
        for block in plain.transformer.h:
            block.attn.c_attn.bias[:C] += cfg.mean_q
            block.attn.c_proj.bias += block.attn.c_proj.weight @ torch.full((C,), cfg.mean_v, dtype=torch.float64)
    idx = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(broken(idx, all_logits=True)[0], plain(idx, all_logits=True)[0])


def test_sampler_draws_nothing_when_the_mode_samples_no_bias():
    for mode, key_bias in (("none", False), ("none", True), ("learned", False), ("learned", True)):
        assert BiasSampler(tiny_config(**SMALL, bias_mode=mode, key_bias=key_bias), seed=0).sample(0) is None
    for mode in ("bq", "bv", "bqbv"):
        assert BiasSampler(tiny_config(**SMALL, bias_mode=mode), seed=0).sample(0) is not None


@pytest.mark.parametrize("per_head", [False, True])
def test_sampler_keeps_the_stream_of_three_rows_per_layer(per_head):
    """Layer i's draw at a step is rows 0 and 2 of default_rng([seed, step, i]).standard_normal((3, [H,] d)) (the
    stream's rows b_Q, b_K, b_V; b_K's unused): b_Q and b_V are the draws of runs that also drew b_K."""
    cfg = tiny_config(**SMALL, bias_per_head=per_head, mean_v=0.3)
    std_q, std_v = train_gpt.bias_stds(cfg)
    std = torch.stack([std_q, std_v]).double()[:, None] if per_head else torch.stack([std_q, std_v]).double()
    mean = torch.tensor([cfg.mean_q, cfg.mean_v]).double().view(2, *[1] * (std.dim() - 1))
    draws = BiasSampler(cfg, seed=11).sample(step=7)
    for layer in range(cfg.n_layer):
        z = np.random.default_rng([11, 7, layer]).standard_normal((3, *draws.shape[2:]))
        torch.testing.assert_close(draws[layer], (mean + std * torch.from_numpy(z[[0, 2]])).float(), rtol=0, atol=0)


def test_sampler_is_a_function_of_seed_and_step():
    cfg = tiny_config(**SMALL)
    a, b = BiasSampler(cfg, seed=7), BiasSampler(cfg, seed=7)
    torch.testing.assert_close(a.sample(10), b.sample(10))
    assert not torch.equal(a.sample(10), a.sample(11))
    assert not torch.equal(a.sample(10), BiasSampler(cfg, seed=8).sample(10))
    assert not torch.equal(a.sample(10)[0], a.sample(10)[1])  # each layer has its own draw
    # layer i's draw does not depend on how many layers the model has
    deeper = BiasSampler(tiny_config(**SMALL, n_layer=4), seed=7)
    torch.testing.assert_close(deeper.sample(10)[:2], a.sample(10))


@pytest.mark.parametrize("per_head", [False, True])
def test_sampler_distribution_matches_spec(per_head):
    cfg = GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=128, bias_per_head=per_head,
                    mean_v=0.5, std_v_min=0.02, std_v_max=0.05)
    sampler = BiasSampler(cfg, seed=0)
    draws = torch.stack([sampler.sample(step)[0] for step in range(3000)])  # (N, 2, [H,] d)
    if per_head:
        assert draws.shape == (3000, 2, 2, 64)
        draws = draws.transpose(1, 2).reshape(6000, 2, 64)
    std_q = torch.linspace(0.05, 0.15, 64)
    std_v = torch.linspace(0.02, 0.05, 64)
    torch.testing.assert_close(draws[:, 0].mean(0), torch.full((64,), 0.5), atol=0.012, rtol=0)
    torch.testing.assert_close(draws[:, 1].mean(0), torch.full((64,), 0.5), atol=0.005, rtol=0)
    torch.testing.assert_close(draws[:, 0].std(0), std_q, rtol=0.1, atol=0)
    torch.testing.assert_close(draws[:, 1].std(0), std_v, rtol=0.1, atol=0)


def test_learned_biases_are_parameters_and_get_gradients():
    model = tiny_gpt(0, **SMALL, bias_mode="learned", bias_per_head=True)
    names = dict(model.named_parameters())
    assert names["transformer.h.0.attn.b_q"].shape == (2, 8)
    assert names["transformer.h.1.attn.b_v"].mean().item() == pytest.approx(0.0, abs=0.1)
    idx = torch.randint(0, 97, (2, 16))
    model(idx, idx)[1].backward()
    assert names["transformer.h.0.attn.b_q"].grad.abs().sum() > 0
    assert names["transformer.h.0.attn.b_v"].grad.abs().sum() > 0


def test_symmetric_model_ignores_biases():
    model = tiny_gpt(0, **SMALL, bias_mode="none")
    idx = torch.randint(0, 97, (1, 16))
    sampled = BiasSampler(model.config, seed=0).sample(0)
    torch.testing.assert_close(model(idx, all_logits=True)[0], model(idx, biases=sampled, all_logits=True)[0])
