"""Weight-decay parameter groups of the optimizer registry."""
from __future__ import annotations

from optim import OptimizerConfig, parameter_groups
from optim.torch_optimizers import AdamWConfig
from train_gpt import GPT, GPTConfig


def grouped_names(cfg: OptimizerConfig) -> tuple[set[str], set[str]]:
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=8, bias_mode="learned",
                          bias_per_head=True))
    groups = parameter_groups(model, cfg)
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    plain = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    assert decayed.isdisjoint(plain) and len(decayed | plain) == len(list(model.parameters()))
    return decayed, plain


def test_only_linear_matrices_decay_by_default():
    decayed, plain = grouped_names(AdamWConfig(weight_decay=0.1))
    assert decayed == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                       "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"}
    assert {"transformer.h.0.attn.b_q", "transformer.h.0.attn.b_v", "transformer.wte.weight",
            "transformer.h.0.mlp.act.weight", "transformer.ln_f.bias"} <= plain


def test_flags_extend_decay_to_embeddings_and_norms():
    decayed, _ = grouped_names(AdamWConfig(weight_decay=0.1, decay_embeddings=True))
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= decayed
    assert "transformer.ln_f.weight" not in decayed
    decayed, plain = grouped_names(AdamWConfig(weight_decay=0.1, decay_norms_and_biases=True))
    assert {"transformer.ln_f.weight", "transformer.h.0.attn.b_q", "transformer.h.0.mlp.act.weight"} <= decayed
    assert plain == {"transformer.wte.weight", "transformer.wpe.weight"}
