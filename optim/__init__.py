"""Optimizers and the registry the trainer builds them from.

Adding an optimizer: write a module in `optim/` that defines an `OptimizerSpec` (a builder plus the SPEC §2
defaults of its hyperparameters), add any new hyperparameters to `OptimizerConfig`, and list the spec in
`OPTIMIZERS` below. The trainer's `--optimizer NAME` then selects it and every field of `OptimizerConfig`
becomes a CLI flag.
"""
from __future__ import annotations

from optim.registry import (
    OptimizerConfig,
    OptimizerSpec,
    optimizer_state_bytes,
    parameter_groups,
    resolve_config,
)
from optim.ecd import ECD_SPEC
from optim.muon import MUON_SPEC
from optim.soap import SOAP_SPEC
from optim.torch_optimizers import ADAMW, SGDM

OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (ECD_SPEC, SOAP_SPEC, MUON_SPEC, ADAMW, SGDM)}

__all__ = [
    "OPTIMIZERS",
    "OptimizerConfig",
    "OptimizerSpec",
    "optimizer_state_bytes",
    "parameter_groups",
    "resolve_config",
]
