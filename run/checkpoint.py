"""The checkpoint format (docs/runs.md#checkpoints), a torch.save'd dict with a sha256 of each of its entries and its
kind (model weights, or the training state a run resumes from): writing it atomically, reading and verifying it
(every entry's checksum and shape; older formats through `upgrade`, so every reader sees today's), the checkpoints of
a run and the one --resume continues from. What a trainer saves and restores is run/training_state.py's. Importing
this module has no side effects."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import typing
import zipfile
from pathlib import Path

import torch
from torch import nn

from fileio import atomic_writer, doing

CHECKPOINT_FORMAT = "symgpt-checkpoint-v4"
V1_FORMAT, V2_FORMAT, V3_FORMAT = (f"symgpt-checkpoint-v{n}" for n in (1, 2, 3))  # read through upgrade
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


class CheckpointUnreadable(CheckpointError):
    """A checkpoint file the operating system does not let this process read (no permission, an I/O error): not a
    damaged file, so nothing falls back from it to an older one."""


def run_dir_of(path: str | os.PathLike) -> Path | None:
    """The run directory a checkpoint belongs to (<run>/checkpoints/FILE -> <run>); None for a file elsewhere."""
    parent = Path(path).absolute().parent
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


SCALARS = (type(None), bool, int, float, str)  # besides tensors, dicts, lists and tuples: what a checkpoint holds


def _digest(node: object, digest: hashlib._Hash, where: str, tensors_only: bool) -> None:
    """Feed `node` to `digest`, dicts in key order and lists in order: each tensor with its place, dtype, shape and
    bytes, and unless tensors_only every container and scalar with its place, type and value too. A value of another
    type is a TypeError (a checkpoint holds none: a checksum over a repr could not be recomputed)."""
    if not tensors_only and not torch.is_tensor(node):
        shape = len(node) if isinstance(node, (dict, list, tuple)) else repr(node)
        if not isinstance(node, (dict, list, tuple, *SCALARS)):
            raise TypeError(f"{where}: a {type(node).__name__}, which a checkpoint does not hold")
        digest.update(f"{where}:{type(node).__name__}:{shape};".encode())
    if isinstance(node, dict):
        for key in sorted(node, key=str):
            _digest(node[key], digest, f"{where}/{key}" if tensors_only else f"{where}/{key!r}", tensors_only)
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            _digest(item, digest, f"{where}/{i}", tensors_only)
    elif torch.is_tensor(node):
        flat = node.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{where}:{flat.dtype}:{tuple(node.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")  # the buffer, not a copy


def _without_tied_names(model: object, tied: object) -> object:
    """A checkpoint's "model" without the names a tied weight is filled in under on load (link_tied): they do not
    count in a checksum, so a loaded checkpoint saved again keeps it."""
    if not (isinstance(model, dict) and isinstance(tied, dict)):
        return model
    return {name: tensor for name, tensor in model.items() if name not in tied}


def tensor_checksum(ckpt: dict) -> str:
    """v3's checksum, one sha256 over every tensor of a checkpoint (not its other values), verified when a v3 file
    is upgraded."""
    digest = hashlib.sha256()
    entries = {k: v for k, v in ckpt.items() if k != "checksum"}
    if "model" in entries:
        entries["model"] = _without_tied_names(entries["model"], entries.get("tied"))
    _digest(entries, digest, "", tensors_only=True)
    return digest.hexdigest()


def entry_checksums(ckpt: dict, strict: bool = True) -> dict[str, str]:
    """{entry: sha256} over everything a reader or a resume reads: each entry of the checkpoint but the checksum
    itself, each section of its config on its own (config.model, config.attention, ...), every value with its place
    and type and every tensor's bytes, so a mismatch names the entry that changed (docs/runs.md#checkpoints). A value
    of a type no checkpoint holds is a TypeError when strict (writing), a mismatch otherwise (reading)."""
    entries = {}
    for key, value in ckpt.items():
        if key == "config" and isinstance(value, dict):
            entries.update({f"config.{section}": part for section, part in value.items()})
        elif key != "checksum":
            entries[key] = value
    if "model" in entries:
        entries["model"] = _without_tied_names(entries["model"], entries.get("tied"))
    sums = {}
    for name, value in entries.items():
        digest = hashlib.sha256()
        try:
            _digest(value, digest, "", tensors_only=False)
        except TypeError:
            if strict:
                raise
            digest.update(b"a value of a type no checkpoint holds")  # never what a writer stored
        sums[name] = digest.hexdigest()
    return sums


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False,
                    verify: bool = False) -> dict:
    """Load and check a checkpoint written by `save_checkpoint` (mmap: tensors are read only when touched; verify:
    recompute the checksum of every entry and compare it with the stored one): an entry missing, not matching its
    checksum or of another shape than the format's is a CheckpointError naming it. A tied weight stored once (see
    checkpoint_model_state) is filled in under each of its names."""
    try:
        with open(path, "rb") as f:  # a file that cannot be opened is not a damaged one
            complete = zipfile.is_zipfile(f)  # torch.save writes a zip archive; a cut one has no central directory
    except OSError as exc:
        raise CheckpointUnreadable(f"{path}: cannot read it ({exc.strerror}): make the file readable, or give "
                                   "another checkpoint", reason=f"cannot be read: {exc.strerror}") from exc
    try:
        if not complete:
            raise ValueError("not a complete torch.save archive: empty, truncated or another kind of file")
        ckpt = torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as exc:  # torch reports a foreign or truncated file through several types, none naming it
        reason = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({reason}); give a file written by train_gpt.py "
                              "(<run>/checkpoints/latest.pt or step_XXXXXX.pt) or its run directory",
                              reason=f"unreadable: {reason}") from exc
    form = ckpt.get("format") if isinstance(ckpt, dict) else None
    if form in (V1_FORMAT, V2_FORMAT, V3_FORMAT):
        ckpt = upgrade(ckpt, Path(path), verify)
    elif form != CHECKPOINT_FORMAT:
        newer = isinstance(form, str) and form.startswith("symgpt-checkpoint-")
        raise CheckpointError(f"{path}: " + (f"format {form}, which this version does not read (it reads "
                                             f"{CHECKPOINT_FORMAT}, v3, v2 and v1): update the code" if newer else
                                             f"not a {CHECKPOINT_FORMAT} checkpoint"),
                              reason=f"format {form}" if newer else f"not {CHECKPOINT_FORMAT}")
    saved_config = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
    missing = [key for key in ENTRIES if key not in ckpt] + [f"config.{key}" for key in CONFIG_ENTRIES
                                                               if key not in saved_config]
    missing += [key for key in TRAINING_ENTRIES if ckpt.get("kind") == TRAINING and key not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: a {form} checkpoint without {', '.join(missing)}; it was not written by "
                              "train_gpt.py, or not whole", reason=f"incomplete: no {', '.join(missing)}")
    if verify and form == CHECKPOINT_FORMAT:
        verify_checksum(ckpt, Path(path))
    if ckpt["kind"] not in (WEIGHTS, TRAINING):
        raise CheckpointError(f"{path}: a checkpoint of kind {ckpt['kind']!r}, which this version does not know "
                              f"({WEIGHTS} or {TRAINING}): update the code", reason=f"kind {ckpt['kind']!r}")
    if damage := entry_problem(ckpt):
        entry, problem = damage
        raise CheckpointError(f"{path}: its {entry} entry is damaged ({problem}); it was not written so by "
                              "train_gpt.py: restore the file, or use another checkpoint",
                              reason=f"{entry} damaged: {problem}")
    return link_tied(ckpt)


def verify_checksum(ckpt: dict, path: Path) -> None:
    """CheckpointError naming the entries of `ckpt`, as read from `path`, that do not match the checksum written with
    them (entry_checksums; an entry added or dropped since counts too)."""
    stored = ckpt.get("checksum")
    if not (isinstance(stored, dict) and all(isinstance(v, str) for v in stored.values())):
        raise CheckpointError(f"{path}: its checksum entry is damaged (not a sha256 per entry); the file was damaged "
                              "after it was written: restore it, or use another checkpoint",
                              reason="its checksum entry is damaged")
    computed = entry_checksums(ckpt, strict=False)
    bad = [name for name in sorted(computed.keys() | stored.keys()) if computed.get(name) != stored.get(name)]
    if bad:
        names = f"{', '.join(bad)} " + ("entries do not match their checksums" if len(bad) > 1 else
                                        "entry does not match its checksum")
        raise CheckpointError(f"{path}: its {names} (the file was damaged after it was written): restore it, or use "
                              "another checkpoint", reason=f"its {names}")


def _fits(value: object, hint: object) -> bool:
    """Whether `value` is of the type `hint` (a class, or a union of classes and None; an int fits a float)."""
    options = typing.get_args(hint) or (hint,)
    return any(value is None if kind is type(None) else
               type(value) is kind or (kind is float and type(value) is int) for kind in options)


def entry_problem(ckpt: dict) -> tuple[str, str] | None:
    """(entry, what is wrong) for the first entry of a complete checkpoint whose shape is not the format's (a step
    that is no count, a tied name pointing nowhere, a metric of another type, a training entry that is no table...);
    None when every entry has its shape. The values of the config sections are the configuration's to check
    (config.read_checkpoint)."""
    if not (type(ckpt["step"]) is int and ckpt["step"] >= 0):
        return "step", f"{ckpt['step']!r} is not a step count"
    model, tied, metrics = ckpt["model"], ckpt["tied"], ckpt["metrics"]
    if not (isinstance(model, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in model.items())):
        return "model", "not a table of named tensors"
    if not (isinstance(tied, dict) and all(isinstance(k, str) and v in model for k, v in tied.items())):
        return "tied", "not a table of names of the model's tensors"
    if not isinstance(metrics, dict):
        return "metrics", f"a {type(metrics).__name__}, not a table"
    hints = typing.get_type_hints(Progress)
    for name, value in metrics.items():
        if name in hints and not _fits(value, hints[name]):
            return "metrics", f"{name} is {value!r}"
    for section, value in ckpt["config"].items():
        shape = str if section == "preset" else dict
        if section in CONFIG_ENTRIES and not (isinstance(value, shape) or (value is None and section in
                                                                            ("data", "preset", "attention"))):
            return f"config.{section}", f"a {type(value).__name__}, not a {shape.__name__}"
    for entry in TRAINING_ENTRIES if ckpt["kind"] == TRAINING else ():
        if not isinstance(ckpt[entry], dict):  # what each holds, --resume checks as it puts it back
            return entry, f"a {type(ckpt[entry]).__name__}, not a table"
    return None


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


def save_run_checkpoint(run_dir: Path, ckpt: dict, keep: int) -> None:
    """A run's checkpoint: checkpoints/latest.pt and, unless keep is 0, checkpoints/step_XXXXXX.pt of its step;
    then every step file up to this step but the newest `keep` is removed (keep -1: all are kept). Step files of
    later steps (left by an earlier stretch of the run that this one replaces) are not counted."""
    folder = Path(run_dir) / "checkpoints"
    step = ckpt["step"]
    save_checkpoint([folder / "latest.pt"] + [folder / f"step_{step:06d}.pt"] * bool(keep), ckpt)
    if keep >= 0:
        earlier = [p for p in run_checkpoints(run_dir) if p.name != "latest.pt" and step_of(p) <= step]
        for path in earlier[:len(earlier) - keep]:
            path.unlink(missing_ok=True)


def resolve_resume(source: str | os.PathLike) -> tuple[Path, list[str]]:
    """The checkpoint `--resume SOURCE` continues from, verified, and notes on what was passed over. A file is
    used as given; a run directory uses checkpoints/latest.pt, or when that is missing or damaged the newest intact
    step_XXXXXX.pt (--keep-checkpoints K). Raises CheckpointError when nothing intact is found, and
    CheckpointUnreadable at once for a file this process may not read (which is not damage)."""
    source = Path(source)
    latest = source / "checkpoints" / "latest.pt"
    steps = [p for p in reversed(run_checkpoints(source)) if p != latest] if source.is_dir() else []
    if not steps:
        path = resolve_checkpoint_path(source)
        try:
            load_checkpoint(path, mmap=True, verify=True)
        except CheckpointError as exc:
            if not source.is_dir() or isinstance(exc, CheckpointUnreadable):
                raise
            raise CheckpointError(f"--resume {source}: {path} is damaged ({exc.reason}) and the run kept no "
                                  "step_XXXXXX.pt to fall back on (--keep-checkpoints K); start a new run") from exc
        return path, []
    passed = [] if latest.is_file() else [f"{latest} (missing)"]
    for path in [latest] * latest.is_file() + steps:
        try:
            load_checkpoint(path, mmap=True, verify=True)
        except CheckpointUnreadable:  # intact, maybe: never passed over for an older one
            raise
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


def _checkpoint(kind: str, model_state: dict, saved_config: dict, metrics: dict, **entries) -> dict:
    missing = [key for key in CONFIG_ENTRIES if key not in saved_config]
    if missing:
        raise ValueError(f"a checkpoint's config needs {', '.join(CONFIG_ENTRIES)}; it has no {', '.join(missing)}")
    state, tied = checkpoint_model_state(model_state)
    return {"format": CHECKPOINT_FORMAT, "kind": kind, "step": metrics["step"], "config": saved_config,
            "model": state, "tied": tied, "metrics": metrics, **entries}


def weights_checkpoint(model: nn.Module, saved_config: dict, metrics: dict, **notes) -> dict:
    """A checkpoint of kind weights (docs/runs.md#checkpoints): `model` with `saved_config` (CONFIG_ENTRIES) and
    `metrics` (with its "step"); `export from-hf` writes one, with a note of where it came from."""
    return _checkpoint(WEIGHTS, model.state_dict(keep_vars=True), saved_config, metrics, **notes)


def training_checkpoint(saved_config: dict, state: dict) -> dict:
    """A checkpoint of kind training, to resume from: `state` is TrainingState.state_dict() and `saved_config` the
    run's configuration (CONFIG_ENTRIES)."""
    return _checkpoint(TRAINING, state["model"], saved_config, state["metrics"],
                       **{k: state[k] for k in TRAINING_ENTRIES})


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


def save_checkpoint(paths: str | os.PathLike | list, ckpt: dict) -> None:
    """Write to each of `paths` atomically with the checksum (computed once): a failure leaves the previous
    checkpoint intact and no temporary file, and raises the OSError of the file (named, with the operation: the
    policy of docs/runs.md#filesystem-errors says it in one line), never torch's wrapper of it."""
    ckpt["checksum"] = entry_checksums(ckpt)
    for path in map(Path, paths if isinstance(paths, list) else [paths]):
        try:
            with atomic_writer(path) as f:
                torch.save(ckpt, f)
        except RuntimeError as exc:  # torch wraps the error of the file it writes
            if not isinstance(exc.__context__, OSError):
                raise
            with doing("write the checkpoint", path):
                raise exc.__context__ from None


# ---------------------------------------------------------------------------------------------------------------
# Reading older formats (docs/runs.md#reading-older-checkpoints): the layouts they took, in the order they changed.

# Fields of the research section that v1 checkpoints written before it existed kept in the train section.
RESEARCH_FIELDS_ONCE_IN_TRAIN = ("dynamics_every", "gauge", "gauge_correction", "gauge_every", "gauge_damping",
                                 "gauge_group", "hyperball_lr", "gauge_diagnostic_every")
# --decay-groups from the two switches that came before it (decay_embeddings, decay_norms_and_biases).
DECAY_GROUPS_OF_SWITCHES = {(False, False): "matrices", (True, False): "matrices+embeddings",
                            (False, True): "all-but-embeddings", (True, True): "all"}


def upgrade(ckpt: dict, path: Path, verify: bool) -> dict:
    """A v1, v2 or v3 checkpoint read from `path` in today's layout, so that no reader knows the older formats (each
    change, none of which a resumed run computes with: docs/runs.md#reading-older-checkpoints); verify: its checksum
    first, v3's and v2's over the tensors in the layout they were written in, where it has one. An entry the file
    lacks stays missing, for load_checkpoint to name."""
    ckpt.setdefault("tied", {})  # the oldest v1 files stored both names of the tied embedding
    if verify and "checksum" in ckpt and tensor_checksum(ckpt) != ckpt["checksum"]:
        raise CheckpointError(f"{path}: its tensors do not match the checksum written with them (the file was "
                              "damaged after it was written)", reason="its tensors do not match its checksum")
    ckpt.pop("checksum", None)  # it covers the old layout; save_checkpoint writes a new one
    if ckpt["format"] == V3_FORMAT:  # v3 -> v4: a checksum per entry, over every value (written when saved again)
        ckpt["format"] = CHECKPOINT_FORMAT
        return ckpt
    if ckpt["format"] == V1_FORMAT:  # v1 -> v2
        saved_config = ckpt.get("config", {})
        train = dict(saved_config.get("train", {}))
        research = {name: train.pop(name) for name in RESEARCH_FIELDS_ONCE_IN_TRAIN if name in train}
        research = {"gauge_project_velocity": False, **research, **saved_config.get("research", {})}
        if isinstance(train.get("keep_checkpoints"), bool):
            train["keep_checkpoints"] = -int(train["keep_checkpoints"])
        optim = dict(saved_config.get("optim", {}))
        if "decay_groups" not in optim:
            switches = bool(optim.pop("decay_embeddings", False)), bool(optim.pop("decay_norms_and_biases", False))
            optim["decay_groups"] = DECAY_GROUPS_OF_SWITCHES[switches]
        preset = saved_config["preset"] if "preset" in saved_config else recorded_preset(path)
        ckpt["config"] = {**saved_config, "train": train, "research": research, "optim": optim,
                          "data": saved_config.get("data"), "preset": preset}
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


def recorded_preset(path: Path) -> str | None:
    """The preset config.json of the checkpoint's run directory records (None: none, or no readable record)."""
    home = run_dir_of(path)
    if home is None:
        return None
    try:
        return json.loads((home / "config.json").read_text())["preset"]["name"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
