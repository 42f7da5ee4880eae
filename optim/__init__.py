"""Optimizers and the registry the trainer builds them from:

    optim.registry          each optimizer's config (its flags), its spec, the weight-decay parameter groups
    optim.base              the contract between an optimizer and the trainer and tools, with a default for all but
                            the update; what the implementations share
    optim.torch_optimizers  AdamW and SGD with Nesterov momentum from torch.optim, with the paper's defaults
    optim.ecd               ECD q=1, energy conserving descent
    optim.soap              SOAP: Adam in the eigenbasis of Shampoo's preconditioner
    optim.muon              Muon for the hidden matrices with AdamW for everything else
    optim.distributed       owner-computes sharding: parameters, gradients and state as views into flat buffers

Adding an optimizer (docs/optimizers.md#adding-an-optimizer): write a module in `optim/` with a config dataclass (a
subclass of `OptimizerConfig` whose fields, declared with `cli.flag`, are its hyperparameters with their defaults and
ranges), the optimizer class (a torch.optim.Optimizer with `optim.base.OptimizerInterface` mixed in first), whose
constructor takes the parameter groups and those fields as keyword arguments and whose `step()` is the update, and an
`OptimizerSpec`; list the spec in `OPTIMIZERS` below. `--optimizer NAME` then selects it, and its config's fields
become the trainer's optimizer flags.
"""
from __future__ import annotations

from optim.ecd import ECD_SPEC
from optim.muon import MUON_SPEC
from optim.registry import (OptimizerConfig, OptimizerSpec, optimizer_state_bytes, optimizer_state_tensors,
                            parameter_groups)
from optim.soap import SOAP_SPEC
from optim.torch_optimizers import ADAMW_SPEC, SGDM_SPEC

OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec
                                        for spec in (ADAMW_SPEC, ECD_SPEC, MUON_SPEC, SGDM_SPEC, SOAP_SPEC)}

__all__ = [
    "OPTIMIZERS",
    "OptimizerConfig",
    "OptimizerSpec",
    "optimizer_state_bytes",
    "optimizer_state_tensors",
    "parameter_groups",
]
