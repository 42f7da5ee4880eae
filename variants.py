"""Research variants of the model and the training loop (docs/variants.md, docs/gauge.md), kept out of the core.

Model variants are fields of the model config (`ModelVariants`, a base of train_gpt.GPTConfig, so checkpoints keep
them with the model): --attention relational (`RelationalAttention`), --objective mlm (`objective_for`: how a batch
of token rows becomes inputs and targets), --init symmetric (`symmetric_init`). The research tools that act around
an optimizer step are flags of `ResearchConfig`; hooks.py (which only the trainer imports) runs them. A new variant
adds one field group here and one call in the trainer; `variant_problem` says which flags cannot work together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from cli import flag
from optim import OPTIMIZERS


@dataclass
class ModelVariants:
    """Model variants (docs/variants.md); every field is a flag and part of the model's config."""

    init: str = flag("normal", "attention initialisation: normal, or symmetric (W_K := W_Q, so every head's W_QK is "
                               "symmetric; docs/variants.md#symmetric-initialisation)", choices=("normal", "symmetric"),
                     fixed_on_resume=True)
    objective: str = flag("clm", "clm (next-token prediction, causal attention) or mlm (masked tokens, attention "
                                 "in both directions; docs/variants.md#masked-lm-objective)", choices=("clm", "mlm"),
                          fixed_on_resume=True)
    mask_prob: float = flag(0.15, "mlm: fraction of each sequence's positions masked (round(mask_prob x seq_len), "
                                  "at least one)", bounds="(0, 1]", fixed_on_resume=True)
    mask_token: int = flag(50257, "mlm: the [MASK] input id; 50257 is the first padded id, which GPT-2 text never "
                                  "holds", bounds=">= 0", fixed_on_resume=True)
    attention: str = flag("standard", "standard (dot-product heads with the biases) or relational (Gram attention, a "
                                      "pure-PyTorch prototype for small models; docs/variants.md#relational-attention)",
                          choices=("standard", "relational"), fixed_on_resume=True)
    relational_hidden: int = flag(32, "relational attention: hidden width of the score MLP f", bounds="> 0",
                                  fixed_on_resume=True)


@dataclass
class ResearchConfig:
    """Tools that act on the attention heads around the optimizer step, and their diagnostics (docs/gauge.md,
    docs/evaluation.md#angular-momentum-and-rotational-fraction); every field is a flag."""

    gauge: str = flag("none", "post-process each step on the attention heads' factor gauge (docs/gauge.md): "
                              "correct (opposite-Gram), project (orbit-transverse), dress (Gram-balanced "
                              "representatives every --gauge-every steps) or hyperball",
                      choices=("none", "correct", "project", "dress", "hyperball"), fixed_on_resume=True)
    gauge_correction: str = flag("full", "--gauge correct: full, diagonal (Gram diagonals) or periodic (full every "
                                         "--gauge-every steps, diagonal otherwise)",
                                 choices=("full", "diagonal", "periodic"))
    gauge_every: int = flag(10, "--gauge dress: dress every N steps; --gauge-correction periodic: full every N",
                            bounds=">= 1")
    gauge_damping: float = flag(1e-3, "--gauge correct: damping λ added to the opposite Gram", bounds=">= 0")
    gauge_group: str = flag("gl", "--gauge project: remove motion along GL(d) (gl) or only O(d) rotations (o)",
                            choices=("gl", "o"))
    gauge_project_velocity: bool = flag(True, "--gauge project: also remove the orbit component of the optimizer's "
                                              "velocity (ECD's Π, SGDM's and Muon's momentum; not Adam's first "
                                              "moment, whose step is normalised per coordinate), which redirects its "
                                              "motion instead of dropping it (docs/gauge.md#the-velocity)")
    hyperball_lr: float = flag(0.01, "--gauge hyperball: step length η relative to each head factor's norm (times "
                                     "the learning-rate schedule)", bounds="> 0")
    dynamics_every: int = flag(0, "log angular momentum / rotational fraction every N steps (0: off; "
                                  "docs/evaluation.md)", bounds=">= 0", affects_results=False)
    gauge_diagnostic_every: int = flag(0, "log the gauge sensitivity of one fresh-optimizer step every N steps "
                                          "(0: off; docs/structure.md#gauge-sensitivity-diagnostic)", bounds=">= 0",
                                       affects_results=False)


# ---------------------------------------------------------------------------------------------------------------
# Relational attention (docs/variants.md#relational-attention)


class RelationalAttention(nn.Module):
    """Relational (Gram) attention, a pure-PyTorch prototype for small models.

    With X the (T, C) LayerNormed token states and G = XXᵀ/C, head h scores s_ij = f(G_ij, G_ii, G_jj)_h with f a
    small MLP (3 -> relational_hidden -> n_head), masks them (causal under clm), takes the softmax A_h, and the
    output is Y = (Σ_h α_h A_h) X with learned mixing scalars α_h. The values are the token states themselves (no
    W_V, no W_O), so the layer is O(C)-equivariant: X -> XR gives Y -> YR for every orthogonal R. The biases of the
    standard attention have nothing to act on here (the configuration refuses them).
    """

    def __init__(self, model_config) -> None:
        super().__init__()
        self.causal = model_config.objective == "clm"
        self.score = nn.Sequential(nn.Linear(3, model_config.relational_hidden), nn.GELU(),
                                   nn.Linear(model_config.relational_hidden, model_config.n_head))
        self.mix = nn.Parameter(torch.empty(model_config.n_head))

    @torch.no_grad()
    def init_weights(self, model_config) -> None:
        """Called by the model's initialisation, after its own (which reaches the score MLP first): the score MLP
        N(0, 1/fan_in), biases zero; each mixing scalar α_h = 0.02 · 0.02/√(2L) · C / H, so Σ_h α_h
        is the gain 0.02√C · 0.02/√(2L)·√C that a standard layer's W_V W_O has at the model's initialisation."""
        for layer in (self.score[0], self.score[2]):
            nn.init.normal_(layer.weight, std=layer.in_features ** -0.5)
            nn.init.zeros_(layer.bias)
        nn.init.constant_(self.mix, 0.02 * 0.02 / math.sqrt(2 * model_config.n_layer) * model_config.n_embd
                          / model_config.n_head)

    def forward(self, x: Tensor, b_q=None, b_v=None, cache=None) -> Tensor:
        if cache is not None:
            raise ValueError("relational attention keeps no KV cache (kv_cache.for_model gives it none)")
        B, T, C = x.shape
        gram = x @ x.transpose(1, 2) / C
        norms = gram.diagonal(dim1=1, dim2=2)
        pairs = torch.stack([gram, norms[:, :, None].expand(B, T, T), norms[:, None, :].expand(B, T, T)], dim=-1)
        scores = self.score(pairs).permute(0, 3, 1, 2)  # (B, H, T, T): query i, key j
        if self.causal:
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        mixing = torch.einsum("h,bhij->bij", self.mix.to(scores.dtype), scores.softmax(dim=-1))
        return mixing.to(x.dtype) @ x


RELATIONAL_MEMORY_LIMIT = 8 * 2**30  # bytes of score-MLP activations per micro-batch beyond which we refuse


# ---------------------------------------------------------------------------------------------------------------
# Symmetric initialisation (docs/variants.md#symmetric-initialisation)


@torch.no_grad()
def symmetric_init(model: nn.Module) -> None:
    """W_K := W_Q and c_K := c_Q in every layer, after the normal initialisation (which therefore draws the same
    numbers), so M_QK = W_Qᵀ W_K is symmetric per head and per layer."""
    C = model.config.n_embd
    for block in model.transformer.h:
        c_attn = block.attn.c_attn
        c_attn.weight[C:2 * C].copy_(c_attn.weight[:C])
        c_attn.bias[C:2 * C].copy_(c_attn.bias[:C])


# ---------------------------------------------------------------------------------------------------------------
# Objectives: how token rows become inputs and targets (docs/variants.md#masked-lm-objective)

# Distinct first words keep these random streams apart from each other and from the bias sampler's.
TRAINING_MASKS = 0x4D41534B  # "MASK"
VALIDATION_MASKS = 0x56414C4D  # "VALM"


class CausalLM:
    """Next-token prediction: the loader's (x, y) as they are."""

    def batch(self, x: Tensor, y: Tensor, first_row: int, step_key: tuple[int, int] | None = None
              ) -> tuple[Tensor, Tensor]:
        return x, y


class MaskedLM:
    """Masks round(mask_prob · T) positions (at least one) of every sequence: inputs there become mask_token, the
    targets are the original tokens there and -1 (not scored) everywhere else.

    Row r of a training step's global batch (its index in the step's rows, whatever the rank and micro-batch; see
    data/loader.py) draws its positions from numpy's SeedSequence([TRAINING_MASKS, seed, step, r]); row r of the
    validation stream from SeedSequence([VALIDATION_MASKS, r]), the same in every run. No state: a resumed run and a
    run on any number of GPUs mask the same positions of the same data.
    """

    def __init__(self, model_config) -> None:
        self.mask_prob, self.mask_token = model_config.mask_prob, model_config.mask_token

    def masked_count(self, seq_len: int) -> int:
        return max(1, round(self.mask_prob * seq_len))

    def positions(self, first_row: int, n_rows: int, seq_len: int, step_key: tuple[int, int] | None = None
                  ) -> np.ndarray:
        """Boolean (rows, seq_len) mask of rows first_row, first_row + 1, ...: of a training step with
        step_key = (seed, step), of the validation stream with None."""
        stream = [TRAINING_MASKS, *step_key] if step_key is not None else [VALIDATION_MASKS]
        count = self.masked_count(seq_len)
        mask = np.zeros((n_rows, seq_len), dtype=bool)
        for i in range(n_rows):
            rng = np.random.default_rng([*stream, first_row + i])
            mask[i, rng.choice(seq_len, size=count, replace=False)] = True
        return mask

    def batch(self, x: Tensor, y: Tensor, first_row: int, step_key: tuple[int, int] | None = None
              ) -> tuple[Tensor, Tensor]:
        """(masked inputs, targets) of the token rows x (B, T) whose first row is `first_row` (see `positions`);
        y, the next tokens, is not used."""
        mask = torch.from_numpy(self.positions(first_row, x.shape[0], x.shape[1], step_key)).to(x.device)
        return x.masked_fill(mask, self.mask_token), torch.where(mask, x, -1)


def objective_for(model_config) -> CausalLM | MaskedLM:
    return MaskedLM(model_config) if model_config.objective == "mlm" else CausalLM()


# ---------------------------------------------------------------------------------------------------------------
# Which variants and tools can work together


def variant_problem(model_config, research: ResearchConfig, optimizer_name: str, micro_batch: int,
                    seq_len: int) -> str | None:
    """Flags of the variants and research tools that cannot work together, phrased as what to change; None when
    they can."""
    if model_config.objective == "mlm" and not model_config.mask_token < model_config.vocab_size:
        return (f"--mask-token {model_config.mask_token} is not an id of the vocabulary (--vocab-size "
                f"{model_config.vocab_size}): choose an id below the vocabulary size that the data never holds")
    if research.dynamics_every and not OPTIMIZERS[optimizer_name].optimizer.has_velocity:
        having = [name for name, spec in OPTIMIZERS.items() if spec.optimizer.has_velocity]
        return (f"--dynamics-every needs a velocity, which docs/evaluation.md defines for --optimizer "
                f"{', '.join(having)}; {optimizer_name} has none (set --dynamics-every 0)")
    if research.gauge_diagnostic_every and optimizer_name == "soap":
        return ("--gauge-diagnostic-every compares one step of a fresh optimizer, and SOAP's first step only builds "
                "its preconditioner (no motion); set --gauge-diagnostic-every 0")
    if research.gauge == "dress" and model_config.bias_mode == "learned" and not model_config.bias_per_head:
        return ("--gauge dress moves each head by its own gauge, which a learned bias shared by the heads cannot "
                "follow: add --bias-per-head")
    if model_config.attention != "relational":
        return None
    if model_config.bias_mode != "none":
        return "--attention relational has no queries, keys or values to bias: add --bias-mode none"
    if model_config.init == "symmetric":
        return "--init symmetric sets W_K := W_Q, which --attention relational does not have: use --init normal"
    if research.dynamics_every or research.gauge != "none" or research.gauge_diagnostic_every:
        return ("--dynamics-every, --gauge and --gauge-diagnostic-every act on the heads' W_Q, W_K, W_V, W_O, which "
                "--attention relational does not have: leave them off")
    # What relational attention keeps for the backward pass per micro-batch: per layer and token pair the three Gram
    # features, the score MLP's hidden layer before and after the activation, and per head the score, its softmax
    # and the masked score (fp32).
    per_pair = 3 + 2 * model_config.relational_hidden + 3 * model_config.n_head
    needed = 4 * model_config.n_layer * micro_batch * seq_len * seq_len * per_pair
    if needed > RELATIONAL_MEMORY_LIMIT:
        return (f"--attention relational is a prototype for small models: --micro-batch {micro_batch} x "
                f"--seq-len {seq_len} over {model_config.n_layer} layers would keep {needed / 2**30:.1f} GiB of "
                f"score activations (limit {RELATIONAL_MEMORY_LIMIT / 2**30:.0f} GiB); lower --micro-batch (the batch "
                "is kept by accumulating gradients), --seq-len or --relational-hidden")
    return None
