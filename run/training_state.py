"""What a trainer keeps in its checkpoints and takes from others: its restorable parts gathered once
(`TrainingState`: saved into a checkpoint of kind training, restored by --resume) and --init-from's weights
(`load_initial_weights`). The format itself is run/checkpoint.py's. Importing this module has no side effects."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from cli import option
from run.checkpoint import TRAINING, CheckpointError, Progress, load_checkpoint, resolve_checkpoint_path


@dataclasses.dataclass(kw_only=True)
class TrainingState:
    """The trainer's restorable parts, gathered once (torchtitan's Stateful shape): `state_dict()` is what a
    checkpoint of kind training holds besides its config (training_checkpoint), `load_state_dict(ckpt)` puts it
    back. The optimizer keeps this run's hyperparameters (`peak_settings`: each parameter group's as built from the
    flags, which on --resume may differ from the saved ones), so flags given on --resume take effect."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    peak_settings: list[dict]  # lr: the peak, which the schedule scales
    loader: object  # data.loader.DistributedTokenLoader
    hooks: object  # hooks.TrainingHooks
    device: torch.device
    progress: Progress = dataclasses.field(default_factory=Progress)

    def state_dict(self) -> dict:
        """The model's tensors (not copies: the checkpoint copies them), the optimizer's state (a collective for the
        sharded optimizers: call it on every rank), the loader's position, the torch RNG and the number of threads
        torch computes with on the host (which can change a CPU run's sums), the hooks' state and the progress
        ("metrics")."""
        return {"model": self.model.state_dict(keep_vars=True), "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "threads": torch.get_num_threads()},
                "hooks": self.hooks.state_dict(), "metrics": dataclasses.asdict(self.progress)}

    def load_state_dict(self, ckpt: dict, path: Path) -> list[str]:
        """Put back what state_dict returned, from a checkpoint of kind training read from `path` onto `device`, with
        the number of threads the run computed with (docs/runs.md#resume); returns the note when that differs from
        what this process was given. An entry that does not fit this run is a CheckpointError naming it."""
        if ckpt["kind"] != TRAINING:
            raise CheckpointError(f"a checkpoint of kind {ckpt['kind']} holds no training state to resume from")
        fields = {f.name for f in dataclasses.fields(Progress)}
        parts = {"model": lambda state: self.model.load_state_dict(state),
                 "optimizer": lambda state: self.optimizer.load_state_dict(state),
                 "loader": lambda state: self.loader.load_state_dict(state),
                 "hooks": lambda state: self.hooks.load_state_dict(state, self.device),
                 "rng": lambda state: torch.set_rng_state(state["torch"]),
                 "metrics": lambda state: setattr(self, "progress", Progress(**{k: v for k, v in state.items()
                                                                                  if k in fields}))}
        for entry, load in parts.items():
            try:
                load(ckpt[entry])
            except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CheckpointError(f"--resume {path}: its {entry} entry does not fit this run ({reason}); restore "
                                      "the file, or resume from another checkpoint") from exc
        for group, values in zip(self.optimizer.param_groups, self.peak_settings, strict=True):
            group.update(values)
        recorded, given = ckpt["rng"].get("threads"), torch.get_num_threads()
        if type(recorded) is not int or recorded == given or recorded < 1:
            return []
        torch.set_num_threads(recorded)
        return [f"threads: {recorded}, as the run computed with before (this process was given {given}); a resumed "
                "run keeps its number of threads, so that its sums are those of the run it continues"]


def load_initial_weights(model: nn.Module, source: str | os.PathLike) -> str:
    """Copy the model weights of a checkpoint (file or run directory) into `model` for --init-from; returns a line
    saying what was adapted: a larger vocabulary keeps its initialisation in the extra rows, positions beyond
    block_size are dropped, and parameters of another bias mode (learned b_q, b_v) are skipped or keep theirs."""
    path = resolve_checkpoint_path(source, flag="--init-from")
    ckpt = load_checkpoint(path, mmap=True)
    saved, model_config = ckpt["config"]["model"], model.config
    for name in ("n_layer", "n_head", "n_embd", "activation"):
        if saved.get(name, getattr(model_config, name)) != getattr(model_config, name):
            raise CheckpointError(f"--init-from {path}: its model has {option(name)} {saved[name]}, this run "
                                  f"{getattr(model_config, name)}; set {option(name)} {saved[name]}")
    if saved["block_size"] < model_config.block_size:
        raise CheckpointError(f"--init-from {path}: its model has --block-size {saved['block_size']}, this run "
                              f"{model_config.block_size}; set --block-size {saved['block_size']} or less")
    notes = [f"initial weights from {path}"]
    if saved["vocab_size"] != model_config.vocab_size:
        notes.append(f"vocabulary {saved['vocab_size']} -> {model_config.vocab_size}"
                     + (" (the extra rows keep their initialisation)"
                        if model_config.vocab_size > saved["vocab_size"] else ""))
    if saved["block_size"] != model_config.block_size:
        notes.append(f"positions {saved['block_size']} -> {model_config.block_size}")
    if saved.get("bias_mode", model_config.bias_mode) != model_config.bias_mode:
        notes.append(f"bias mode {saved['bias_mode']} -> {model_config.bias_mode}")
    state = model.state_dict()  # shares storage with the parameters
    skipped = []
    with torch.no_grad():
        for name, tensor in ckpt["model"].items():
            if name not in state or tensor.shape[1:] != state[name].shape[1:]:
                skipped.append(name)
                continue
            rows = min(tensor.size(0), state[name].size(0))
            state[name][:rows].copy_(tensor[:rows])
    if skipped:
        notes.append(f"not used: {', '.join(skipped)}")
    return " | ".join(notes)
