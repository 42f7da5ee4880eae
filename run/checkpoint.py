"""The checkpoint format (docs/runs.md#checkpoints), a torch.save'd dict with a sha256 of its tensors and its kind
(model weights, or the training state a run resumes from): writing it atomically, reading and verifying it (older
formats through `upgrade`, so every reader sees today's), the trainer's restorable parts (`TrainingState`), the
checkpoints of a run and the one --resume continues from, and --init-from's weights. Importing this module has no
side effects."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import torch
from torch import nn

from cli import option
from fileio import atomic_writer

CHECKPOINT_FORMAT = "symgpt-checkpoint-v3"
V1_FORMAT, V2_FORMAT = "symgpt-checkpoint-v1", "symgpt-checkpoint-v2"  # read through upgrade
CONFIG_ENTRIES = ("model", "train", "research", "optim", "data", "preset", "attention")  # a checkpoint's config
WEIGHTS, TRAINING = "weights", "training"  # a checkpoint's kind: model weights only, or a run to resume
ENTRIES = ("step", "config", "model", "tied", "metrics", "kind")  # in every checkpoint
TRAINING_ENTRIES = ("optimizer", "loader", "rng", "hooks")  # in a checkpoint of kind training


class CheckpointError(ValueError):
    """A checkpoint path that is missing, unreadable or damaged; `reason` says what is wrong with the file, without
    the advice of the message."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


def run_dir_of(checkpoint: str | os.PathLike) -> Path | None:
    """The run directory a checkpoint belongs to (<run>/checkpoints/FILE -> <run>); None for a file elsewhere."""
    parent = Path(checkpoint).absolute().parent
    return parent.parent if parent.name == "checkpoints" else None


def resolve_checkpoint_path(path: str | os.PathLike, flag: str = "--resume") -> Path:
    """A checkpoint file, or a run directory (-> its checkpoints/latest.pt); an error naming the flag and file."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoints" / "latest.pt"
    if not path.is_file():
        raise CheckpointError(f"{flag}: no checkpoint at {path}; a run writes one at its end, every "
                              "--checkpoint-every steps and when it is interrupted (SIGINT/SIGTERM)")
    return path


def tensor_checksum(checkpoint: dict) -> str:
    """sha256 over every tensor of a checkpoint (dicts in key order, lists in order; each tensor's place, dtype,
    shape and bytes), so a flipped bit anywhere in weights or optimizer state changes it. The names a tied weight is
    filled in under on load (see link_tied) do not count, so a loaded checkpoint saved again keeps its checksum."""
    digest = hashlib.sha256()
    aliases = {f"/model/{alias}" for alias in checkpoint["tied"]}

    def walk(node: object, where: str) -> None:
        if where in aliases:
            return
        if isinstance(node, dict):
            for key in sorted(node, key=str):
                walk(node[key], f"{where}/{key}")
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                walk(item, f"{where}/{i}")
        elif torch.is_tensor(node):
            flat = node.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{where}:{flat.dtype}:{tuple(node.shape)};".encode())
            digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")  # the buffer, not a copy

    walk({k: v for k, v in checkpoint.items() if k != "checksum"}, "")
    return digest.hexdigest()


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False,
                    verify: bool = False) -> dict:
    """Load and check a checkpoint written by `save_checkpoint` (mmap: tensors are read only when touched; verify:
    recompute the tensors' sha256 and compare it with the stored one). A tied weight stored once (see
    checkpoint_model_state) is filled in under each of its names."""
    try:
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut one has no central directory
            raise ValueError("not a complete torch.save archive: empty, truncated or another kind of file")
        ckpt = torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as exc:  # torch reports a foreign or truncated file through several types, none naming it
        reason = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({reason}); give a file written by train_gpt.py "
                              "(<run>/checkpoints/latest.pt or step_XXXXXX.pt) or its run directory",
                              reason=f"unreadable: {reason}") from exc
    form = ckpt.get("format") if isinstance(ckpt, dict) else None
    if form in (V1_FORMAT, V2_FORMAT):
        ckpt = upgrade(ckpt, Path(path), verify)
    elif form != CHECKPOINT_FORMAT:
        newer = isinstance(form, str) and form.startswith("symgpt-checkpoint-")
        raise CheckpointError(f"{path}: " + (f"format {form}, which this version does not read (it reads "
                                             f"{CHECKPOINT_FORMAT}, v2 and v1): update the code" if newer else
                                             f"not a {CHECKPOINT_FORMAT} checkpoint"),
                              reason=f"format {form}" if newer else f"not {CHECKPOINT_FORMAT}")
    config = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
    missing = [key for key in ENTRIES if key not in ckpt] + [f"config.{key}" for key in CONFIG_ENTRIES
                                                               if key not in config]
    missing += [key for key in TRAINING_ENTRIES if ckpt.get("kind") == TRAINING and key not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: a {form} checkpoint without {', '.join(missing)}; it was not written by "
                              "train_gpt.py, or not whole", reason=f"incomplete: no {', '.join(missing)}")
    if ckpt["kind"] not in (WEIGHTS, TRAINING):
        raise CheckpointError(f"{path}: a checkpoint of kind {ckpt['kind']!r}, which this version does not know "
                              f"({WEIGHTS} or {TRAINING}): update the code", reason=f"kind {ckpt['kind']!r}")
    if verify and form == CHECKPOINT_FORMAT:
        verify_checksum(ckpt, Path(path))
    return link_tied(ckpt)


def verify_checksum(ckpt: dict, path: Path) -> None:
    """CheckpointError unless the tensors of `ckpt`, as read from `path`, match the checksum written with them."""
    if tensor_checksum(ckpt) != ckpt.get("checksum"):
        raise CheckpointError(f"{path}: its tensors do not match the checksum written with them (the file was "
                              "damaged after it was written)", reason="its tensors do not match its checksum")


def step_of(path: Path) -> int:
    """The step in a step checkpoint's name (checkpoints/step_000500.pt -> 500)."""
    return int(re.sub(r"\D", "", path.stem) or 0)


def run_checkpoints(run_dir: Path) -> list[Path]:
    """A run's checkpoints/step_XXXXXX.pt in step order, then latest.pt (if present)."""
    folder = Path(run_dir) / "checkpoints"
    steps = sorted(folder.glob("step_*.pt"), key=step_of)
    latest = folder / "latest.pt"
    return steps + ([latest] if latest.is_file() else [])


def newer_checkpoints(run_dir: Path, step: int) -> list[str]:
    """The checkpoints of a run from later steps than `step`, as "PATH (step N)": step files by their name, and
    latest.pt when it reads (a damaged latest.pt has no step to compare)."""
    newer = []
    for path in run_checkpoints(run_dir):
        if path.name == "latest.pt":
            try:
                later = load_checkpoint(path, mmap=True)["step"]
            except CheckpointError:
                continue
        else:
            later = step_of(path)
        if later > step:
            newer.append(f"{path} (step {later})")
    return newer


def save_run_checkpoint(run_dir: Path, checkpoint: dict, keep: int) -> None:
    """A run's checkpoint: checkpoints/latest.pt and, unless keep is 0, checkpoints/step_XXXXXX.pt of its step;
    then every step file up to this step but the newest `keep` is removed (keep -1: all are kept). Step files of
    later steps (left by an earlier stretch of the run that this one replaces) are not counted."""
    folder = Path(run_dir) / "checkpoints"
    step = checkpoint["step"]
    save_checkpoint([folder / "latest.pt"] + [folder / f"step_{step:06d}.pt"] * bool(keep), checkpoint)
    if keep >= 0:
        earlier = [p for p in run_checkpoints(run_dir) if p.name != "latest.pt" and step_of(p) <= step]
        for path in earlier[:len(earlier) - keep]:
            path.unlink(missing_ok=True)


def resolve_resume(source: str | os.PathLike) -> tuple[Path, list[str]]:
    """The checkpoint `--resume SOURCE` continues from, verified, and notes on what was passed over. A file is
    used as given; a run directory uses checkpoints/latest.pt, or when that is missing or damaged the newest intact
    step_XXXXXX.pt (--keep-checkpoints K). Raises CheckpointError when nothing intact is found."""
    source = Path(source)
    latest = source / "checkpoints" / "latest.pt"
    steps = [p for p in reversed(run_checkpoints(source)) if p != latest] if source.is_dir() else []
    if not steps:
        path = resolve_checkpoint_path(source)
        try:
            load_checkpoint(path, mmap=True, verify=True)
        except CheckpointError as exc:
            if not source.is_dir():
                raise
            raise CheckpointError(f"--resume {source}: {path} is damaged ({exc.reason}) and the run kept no "
                                  "step_XXXXXX.pt to fall back on (--keep-checkpoints K); start a new run") from exc
        return path, []
    passed = [] if latest.is_file() else [f"{latest} (missing)"]
    for path in [latest] * latest.is_file() + steps:
        try:
            load_checkpoint(path, mmap=True, verify=True)
        except CheckpointError as exc:
            passed.append(f"{path} ({exc.reason})")
            continue
        notes = [f"passed over {p}" for p in passed]
        if notes:
            notes.append(f"resuming from {path} instead, the newest intact checkpoint of {source}")
        return path, notes
    raise CheckpointError(f"--resume {source}: no intact checkpoint: {'; '.join(passed)}; start a new run")


def non_finite_weights(model_state: dict[str, torch.Tensor]) -> str | None:
    """Which of a model's floating-point tensors (a checkpoint's "model" or a state_dict) hold NaN or infinite
    values, as the words of a message; None when none does. A diverged run's checkpoint has an intact checksum."""
    bad = [name for name, tensor in model_state.items()
           if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"the weights hold NaN or infinite values ({', '.join(bad[:3])}{more})" if bad else None


def link_tied(ckpt: dict) -> dict:
    """The checkpoint with each tied name of its model (ckpt["tied"], see checkpoint_model_state) pointing at the
    stored tensor."""
    for alias, name in ckpt["tied"].items():
        ckpt["model"].setdefault(alias, ckpt["model"][name])
    return ckpt


def checkpoint_model_state(model_state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state, tied) from a model's state_dict(keep_vars=True): CPU copies of its tensors, each parameter once, and
    {alias: stored name} for the names of a parameter stored under an earlier one (the tied lm_head.weight is
    transformer.wte.weight: one copy, 154 MB at 124M parameters, instead of two). Copies, because sharded optimizers
    make parameters views into padded flat buffers that torch.save would write whole."""
    state, tied, first_name = {}, {}, {}
    for name, tensor in model_state.items():
        if id(tensor) in first_name:
            tied[name] = first_name[id(tensor)]
            continue
        first_name[id(tensor)] = name
        state[name] = tensor.detach().to("cpu", copy=True)
    return state, tied


def _checkpoint(kind: str, model_state: dict, config: dict, metrics: dict, **entries) -> dict:
    missing = [key for key in CONFIG_ENTRIES if key not in config]
    if missing:
        raise ValueError(f"a checkpoint's config needs {', '.join(CONFIG_ENTRIES)}; it has no {', '.join(missing)}")
    state, tied = checkpoint_model_state(model_state)
    return {"format": CHECKPOINT_FORMAT, "kind": kind, "step": metrics["step"], "config": config, "model": state,
            "tied": tied, "metrics": metrics, **entries}


def weights_checkpoint(model: nn.Module, config: dict, metrics: dict, **notes) -> dict:
    """A checkpoint of kind weights (docs/runs.md#checkpoints): `model` with `config` (CONFIG_ENTRIES) and
    `metrics` (with its "step"); `export from-hf` writes one, with a note of where it came from."""
    return _checkpoint(WEIGHTS, model.state_dict(keep_vars=True), config, metrics, **notes)


def training_checkpoint(config: dict, state: dict) -> dict:
    """A checkpoint of kind training, to resume from: `state` is TrainingState.state_dict() and `config` the run's
    (CONFIG_ENTRIES)."""
    return _checkpoint(TRAINING, state["model"], config, state["metrics"], **{k: state[k] for k in TRAINING_ENTRIES})


@dataclasses.dataclass
class Progress:
    """A checkpoint's "metrics": where the run is and what it has measured (also each validation record)."""

    step: int = 0
    tokens: int = 0
    train_time_s: float = 0.0
    val_loss: float | None = None
    val_step: int | None = None
    best_val_loss_batch: float | None = None  # the least single-batch validation estimate (--val-batch-estimate)
    reached_target: dict | None = None

    def reaches(self, target: float) -> bool:
        """Whether the last validation loss reaches --target-val-loss `target` (0: off) for the first time; then
        `reached_target` records when."""
        if not target or self.reached_target is not None or self.val_loss > target:
            return False
        self.reached_target = {"step": self.step, "train_time_s": self.train_time_s, "tokens": self.tokens,
                               "val_loss": self.val_loss}
        return True


@dataclasses.dataclass
class TrainingState:
    """The trainer's restorable parts, gathered once (torchtitan's Stateful shape): `state_dict()` is what a
    checkpoint of kind training holds besides its config (training_checkpoint), `load_state_dict(checkpoint)` puts
    it back. The optimizer keeps this run's hyperparameters (`settings`: each parameter group's as built from the
    flags, which on --resume may differ from the saved ones), so flags given on --resume take effect."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    settings: list[dict]
    loader: object  # data.loader.DistributedTokenLoader
    hooks: object  # hooks.TrainingHooks
    device: torch.device
    progress: Progress = dataclasses.field(default_factory=Progress)

    def state_dict(self) -> dict:
        """The model's tensors (not copies: the checkpoint copies them), the optimizer's state (a collective for the
        sharded optimizers: call it on every rank), the loader's position, the torch RNG, the hooks' state and the
        progress ("metrics")."""
        return {"model": self.model.state_dict(keep_vars=True), "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict(), "rng": {"torch": torch.get_rng_state()},
                "hooks": self.hooks.state_dict(), "metrics": dataclasses.asdict(self.progress)}

    def load_state_dict(self, checkpoint: dict) -> None:
        """Put back what state_dict returned, from a checkpoint of kind training loaded onto `device`."""
        if checkpoint["kind"] != TRAINING:
            raise CheckpointError(f"a checkpoint of kind {checkpoint['kind']} holds no training state to resume from")
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        for group, values in zip(self.optimizer.param_groups, self.settings, strict=True):
            group.update(values)
        self.loader.load_state_dict(checkpoint["loader"])
        self.hooks.load_state_dict(checkpoint["hooks"], self.device)
        torch.set_rng_state(checkpoint["rng"]["torch"])
        fields = {f.name for f in dataclasses.fields(Progress)}
        self.progress = Progress(**{k: v for k, v in checkpoint["metrics"].items() if k in fields})


def save_checkpoint(paths: str | os.PathLike | list, checkpoint: dict) -> None:
    """Write to each of `paths` atomically with the tensors' checksum (computed once): a failure leaves the previous
    checkpoint intact and no temporary file; the error names the file and the free space."""
    checkpoint["checksum"] = tensor_checksum(checkpoint)
    for path in map(Path, paths if isinstance(paths, list) else [paths]):
        try:
            with atomic_writer(path) as f:
                torch.save(checkpoint, f)
        except (OSError, RuntimeError) as exc:
            free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else 0
            os_error = exc if isinstance(exc, OSError) else exc.__context__  # torch wraps the file's own error
            reason = os_error.strerror if isinstance(os_error, OSError) and os_error.strerror else str(exc).strip()
            raise OSError(f"could not write checkpoint {path}: {reason} ({free / 2**20:,.0f} MiB free there); the "
                          "previous checkpoint, if any, is intact") from exc


def load_initial_weights(model: nn.Module, source: str | os.PathLike) -> str:
    """Copy the model weights of a checkpoint (file or run directory) into `model` for --init-from; returns a line
    saying what was adapted: a larger vocabulary keeps its initialisation in the extra rows, positions beyond
    block_size are dropped, and parameters of another bias mode (learned b_q, b_v) are skipped or keep theirs."""
    path = resolve_checkpoint_path(source, flag="--init-from")
    ckpt = load_checkpoint(path, mmap=True)
    saved, cfg = ckpt["config"]["model"], model.config
    for name in ("n_layer", "n_head", "n_embd", "activation"):
        if saved.get(name, getattr(cfg, name)) != getattr(cfg, name):
            raise CheckpointError(f"--init-from {path}: its model has {option(name)} {saved[name]}, this run "
                                  f"{getattr(cfg, name)}; set {option(name)} {saved[name]}")
    if saved["block_size"] < cfg.block_size:
        raise CheckpointError(f"--init-from {path}: its model has --block-size {saved['block_size']}, this run "
                              f"{cfg.block_size}; set --block-size {saved['block_size']} or less")
    notes = [f"initial weights from {path}"]
    if saved["vocab_size"] != cfg.vocab_size:
        notes.append(f"vocabulary {saved['vocab_size']} -> {cfg.vocab_size}"
                     + (" (the extra rows keep their initialisation)" if cfg.vocab_size > saved["vocab_size"] else ""))
    if saved["block_size"] != cfg.block_size:
        notes.append(f"positions {saved['block_size']} -> {cfg.block_size}")
    if saved.get("bias_mode", cfg.bias_mode) != cfg.bias_mode:
        notes.append(f"bias mode {saved['bias_mode']} -> {cfg.bias_mode}")
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


# ---------------------------------------------------------------------------------------------------------------
# Reading older formats (docs/runs.md#reading-older-checkpoints): the layouts they took, in the order they changed.

# Fields of the research section that v1 checkpoints written before it existed kept in the train section.
RESEARCH_FIELDS_ONCE_IN_TRAIN = ("dynamics_every", "gauge", "gauge_correction", "gauge_every", "gauge_damping",
                                 "gauge_group", "hyperball_lr", "gauge_diagnostic_every")
# --decay-groups from the two switches that came before it (decay_embeddings, decay_norms_and_biases).
DECAY_GROUPS_OF_SWITCHES = {(False, False): "matrices", (True, False): "matrices+embeddings",
                            (False, True): "all-but-embeddings", (True, True): "all"}


def upgrade(ckpt: dict, path: Path, verify: bool) -> dict:
    """A v1 or v2 checkpoint read from `path` in today's layout, so that no reader knows the older formats (each
    change, none of which a resumed run computes with: docs/runs.md#reading-older-checkpoints); verify: its checksum
    first, over the layout it was written in, where it has one. An entry the file lacks stays missing, for
    load_checkpoint to name."""
    ckpt.setdefault("tied", {})  # the oldest v1 files stored both names of the tied embedding
    if verify and "checksum" in ckpt:
        verify_checksum(ckpt, path)
    ckpt.pop("checksum", None)  # it covers the old layout; save_checkpoint writes a new one
    if ckpt["format"] == V1_FORMAT:  # v1 -> v2
        config = ckpt.get("config", {})
        train = dict(config.get("train", {}))
        research = {name: train.pop(name) for name in RESEARCH_FIELDS_ONCE_IN_TRAIN if name in train}
        research = {"gauge_project_velocity": False, **research, **config.get("research", {})}
        if isinstance(train.get("keep_checkpoints"), bool):
            train["keep_checkpoints"] = -int(train["keep_checkpoints"])
        optim = dict(config.get("optim", {}))
        if "decay_groups" not in optim:
            switches = bool(optim.pop("decay_embeddings", False)), bool(optim.pop("decay_norms_and_biases", False))
            optim["decay_groups"] = DECAY_GROUPS_OF_SWITCHES[switches]
        preset = config["preset"] if "preset" in config else recorded_preset(path)
        ckpt["config"] = {**config, "train": train, "research": research, "optim": optim,
                          "data": config.get("data"), "preset": preset}
        if "optimizers" in ckpt:
            optimizers = ckpt.pop("optimizers")
            if len(optimizers) != 1:
                raise CheckpointError(f"{path}: a v1 checkpoint with {len(optimizers)} optimizer states; the trainer "
                                      "always wrote one", reason="v1 with several optimizer states")
            ckpt["optimizer"] = optimizers[0]
            gauge = ckpt.pop("gauge", None)
            ckpt["hooks"] = ckpt.get("hooks") or ({"gauge": gauge} if gauge else {})
        ckpt.pop("sampler", None)
    # v2 -> v3: the kind, which v2 left to the presence of an optimizer state, and the attention path, which v2 did
    # not record (a reader takes kernels.attention_paths.DEFAULT_IMPLEMENTATION)
    ckpt["kind"] = TRAINING if "optimizer" in ckpt else WEIGHTS
    if isinstance(ckpt.get("config"), dict):
        ckpt["config"].setdefault("attention", None)
    ckpt["format"] = CHECKPOINT_FORMAT
    return ckpt


def recorded_preset(checkpoint: Path) -> str | None:
    """The preset config.json of the checkpoint's run directory records (None: none, or no readable record)."""
    home = run_dir_of(checkpoint)
    if home is None:
        return None
    try:
        return json.loads((home / "config.json").read_text())["preset"]["name"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
