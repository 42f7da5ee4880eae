"""Weight-decay parameter groups of the optimizer registry (docs/optimizers.md#weight-decay-groups)."""
from __future__ import annotations

import dataclasses

import pytest

from optim import OPTIMIZERS, OptimizerConfig, parameter_groups
from optim.registry import DECAY_GROUPS
from optim.torch_optimizers import AdamWConfig
from tests.helpers import tiny_gpt

MATRICES = {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
            "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"}
EMBEDDINGS = {"transformer.wte.weight", "transformer.wpe.weight"}


def grouped_names(cfg: OptimizerConfig) -> tuple[set[str], set[str]]:
    model = tiny_gpt(block_size=8, n_layer=1, n_embd=8, bias_mode="learned", bias_per_head=True)
    groups = parameter_groups(model, cfg)
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    plain = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    assert decayed.isdisjoint(plain) and len(decayed | plain) == len(list(model.parameters()))
    return decayed, plain


def test_each_choice_decays_its_parameters():
    everything = set().union(*grouped_names(AdamWConfig(weight_decay=0.1)))
    rest = everything - MATRICES - EMBEDDINGS
    assert {"transformer.ln_f.weight", "transformer.h.0.attn.b_q", "transformer.h.0.mlp.act.weight",
            "transformer.h.0.attn.c_attn.bias"} <= rest
    expected = {"all": everything, "matrices": MATRICES, "matrices+embeddings": MATRICES | EMBEDDINGS,
                "all-but-embeddings": MATRICES | rest}
    assert set(expected) == set(DECAY_GROUPS)
    for choice, decayed in expected.items():
        assert grouped_names(AdamWConfig(weight_decay=0.1, decay_groups=choice)) == (decayed, everything - decayed)


def test_paper_optimizers_decay_every_parameter_by_default_and_muon_matrices():
    defaults = {name: spec.config.decay_groups for name, spec in OPTIMIZERS.items()}
    assert defaults == {"ecd": "all", "soap": "all", "adamw": "all", "sgdm": "all", "muon": "matrices"}


def test_unknown_choice_is_an_error():
    with pytest.raises(ValueError, match="--decay-groups"):
        grouped_names(AdamWConfig(weight_decay=0.1, decay_groups="biases"))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_build_owns_every_parameter_once_and_refuses_a_build_that_does_not(name):
    model = tiny_gpt(block_size=8, n_layer=1, n_embd=8)
    spec = OPTIMIZERS[name]
    opt = spec.build(model, spec.config())
    owned = [p for group in opt.param_groups for p in group["params"]]
    assert len(owned) == len({id(p) for p in owned}) == len(list(model.parameters()))

    def dropping_one(model, cfg):
        groups = spec.groups(model, cfg)
        groups[0]["params"], groups[0]["names"] = groups[0]["params"][1:], groups[0]["names"][1:]
        return groups

    def repeating_one(model, cfg):
        groups = spec.groups(model, cfg)
        return groups + [{**groups[0], "params": groups[0]["params"][:1], "names": groups[0]["names"][:1]}]

    # a missing parameter is caught by the ownership check; a repeated one already by the optimizer's constructor
    for groups, problem in ((dropping_one, r"not owned: \['transformer"),
                            (repeating_one, "twice|more than one parameter group")):
        with pytest.raises((RuntimeError, ValueError), match=problem):
            dataclasses.replace(spec, groups=groups).build(model, spec.config())
