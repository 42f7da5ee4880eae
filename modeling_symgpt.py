"""GPT-2 with a per-feature PReLU in its MLP: the model class of a directory written by symgpt's
`python -m export to-hf` for a PReLU model, loaded by Hugging Face transformers as remote code:

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

Everything but the MLP's activation is transformers' GPT-2 (attention, KV cache, generation, weights layout); each
block's MLP activation is max(x, 0) + a · min(x, 0) with one learned slope a per hidden feature, stored as
`h.N.mlp.act.weight` (n_inner,). The symmetry-breaking attention biases symgpt trains with are already folded
into `c_attn.bias` at their evaluation values. This file imports only torch and transformers.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel


class SymGPTConfig(GPT2Config):
    """GPT2Config whose activation_function may also be "prelu" (FeaturePReLU)."""

    model_type = "symgpt"


class FeaturePReLU(nn.PReLU):
    """PReLU with one learnable negative slope per feature of the last dimension (nn.PReLU's is dim 1): the class of
    symgpt's train_gpt.py, copied because this file imports only torch and transformers (a test keeps the two equal)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x >= 0, x, x * self.weight.to(x.dtype))


class SymGPTForCausalLM(GPT2LMHeadModel):
    """GPT2LMHeadModel whose MLPs use FeaturePReLU when config.activation_function is "prelu"."""

    config_class = SymGPTConfig

    def __init__(self, config: SymGPTConfig) -> None:
        super().__init__(config)
        if config.activation_function == "prelu":  # GPT-2 built nn.PReLU (one slope); ours has one per feature
            for block in self.transformer.h:
                block.mlp.act = FeaturePReLU(block.mlp.c_fc.nf)
