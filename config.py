"""A run's configuration (docs/runs.md#configuration): presets, the command line, the checks, and what a run
reproduces of the published runs. Its sections (`RunConfig`) are the trainer's flag dataclasses, ResearchConfig and
the optimizer's config, every field a flag (cli.flag); values come from defaults <- preset <- the resumed
checkpoint's config <- command-line flags."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cli import ArgumentParser, add_flags, field_problem, option, value_problem
from kernels import attention_paths
from optim import OPTIMIZERS, OptimizerConfig
from run.checkpoint import (
    TRAINING,
    CheckpointError,
    load_checkpoint,
    newer_checkpoints,
    non_finite_weights,
    resolve_checkpoint_path,
    resolve_resume,
    run_dir_of,
)
from run.directory import directory_name_problem, existing_run_problem
from run.log import module_available
from run.process import batch_layout, world_size_from_env
from timing import parse_window
from variants import ModelVariants, ResearchConfig, variant_problem

# The paper's training run (docs/model.md#the-papers-model): 8 x 512 tokens per step in one pass (no gradient
# accumulation on up to 8 ranks), 500M tokens, constant learning rate. Pinned here, though they are the defaults, so
# that the presets keep reproducing the published runs if a default changes. The optimizers' defaults are their
# published updates with the Table 9 hyperparameters (docs/optimizers.md#paper-parity).
PAPER_RUN: dict[str, object] = {
    "activation": "prelu", "seq_len": 512, "batch_tokens": 4096, "micro_batch": 8, "steps": 122070,
    "lr_schedule": "constant", "warmup_steps": 0, "grad_clip": 0.0,
    "initial_velocity_std": 0.1,  # SGDM only: the paper's SGDM runs start with a random velocity (Table 1)
    "std_v_min": 0.05, "std_v_max": 0.05,  # σ_V: the published code's (the paper scanned 0.02 and 0.05)
}
PRESETS: dict[str, dict[str, object]] = {
    "gpt2-124m": PAPER_RUN,
    "gpt2-124m-gelu": {**PAPER_RUN, "activation": "gelu"},
    # A few minutes on a 2-core CPU: a narrow model on the embedded corpus, AdamW with warmup and cosine decay.
    "smoke": {
        "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128,
        "seq_len": 128, "micro_batch": 16, "batch_tokens": 2048, "steps": 100,
        "lr_schedule": "cosine", "warmup_steps": 10, "min_lr_frac": 0.1,
        "val_every": 50, "val_tokens": 16384, "log_every": 10, "device": "cpu", "compile": False,
        "optimizer": "adamw", "lr": 2e-3,  # a preset's optimizer settings apply to its own optimizer only
    },
    # Seconds on a CPU: only the size, the budget and the device. `python -m grid --scale cpu` gives these entries
    # as flags after a grid's own, so its runs keep their preset, optimizer, biases and schedule (docs/reproduce.md).
    "cpu": {
        "device": "cpu", "compile": False, "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64,
        "seq_len": 64, "batch_tokens": 512, "micro_batch": 8, "steps": 20, "val_every": 10, "val_tokens": 4096,
        "log_every": 10, "checkpoint_every": 0,
    },
}
PRESET_NOTES = {
    "gpt2-124m": "the paper's GPT-2 small (PReLU) run: model, 500M tokens, batch 8 x 512 without accumulation, "
                 "constant learning rate, and the optimizer's published update with its Table 9 hyperparameters",
    "gpt2-124m-gelu": "the paper's GPT-2 small run with GELU: as gpt2-124m but the activation",
    "smoke": "no published run (a few minutes on a CPU to check the trainer)",
    "cpu": "no published run (seconds on a CPU: the size a grid's runs take at --scale cpu)",
}
PAPER_OPTIMIZERS = ("adamw", "ecd", "sgdm", "soap")  # Table 9 of the paper
# Where the paper and its published code disagree on an optimizer's settings, and which the presets follow
# (docs/optimizers.md#adamw-and-sgdm); shown with the preset report of a run with that optimizer.
SOURCE_CONFLICTS = {
    "adamw": "sources: Table 9 gives AdamW betas (0.9, 0.999) and weight decay 0 (0.01 also tried), the published "
             "scripts/train.py defaults to betas (0.9, 0.95) and weight decay 0.01; the presets follow Table 9 "
             "(--beta2 0.95 --weight-decay 0.01 for the script's)",
    "sgdm": "sources: Table 1 runs SGDM from a nonzero initial velocity and the published GELU script draws it from "
            "N(0, 0.1^2), while the published PReLU script starts at rest; the presets follow the paper "
            "(--initial-velocity-std 0 for the PReLU script's)",
}
VALIDATION_PROTOCOL_NOTE = ("validation protocol: the published runs report the best validation loss as the minimum "
                            "over single-batch estimates with the last sampled biases (logged here as val_loss_batch "
                            "and best_val_loss_batch with --val-batch-estimate, at the biases --val-biases names); "
                            "val_loss is the mean loss over the same fixed --val-tokens budget each time, at the mean "
                            "biases (docs/evaluation.md#validation-loss)")
PRECISION_NOTES = {
    "bf16": "precision: bf16 autocast on CUDA; the published trainer computes in fp32 with TF32 matmuls (bf16 only "
            "with its --use_bf16)",
    "fp32": "precision: fp32 with fp32 matmuls; the published trainer uses TF32 matmuls",
}


@dataclass
class RunConfig:
    """A run's whole configuration: one dataclass per section, every field a flag."""

    model: object  # train_gpt.GPTConfig (with the ModelVariants fields)
    train: object  # train_gpt.TrainConfig
    research: ResearchConfig
    optim: OptimizerConfig
    preset: str | None = None
    continue_in: Path | None = None  # a resumed run's own directory, when the run goes on there (see resume_home)
    resume_from: Path | None = None  # the verified checkpoint --resume continues from (run.checkpoint.resolve_resume)
    notes: list[str] = field(default_factory=list)  # what resolving --resume passed over, for the log

    def sections(self) -> dict[str, object]:
        return {"model": self.model, "train": self.train, "research": self.research, "optim": self.optim}

    def to_dict(self) -> dict:
        return {name: asdict(section) for name, section in self.sections().items()}


def saved_fields(saved: dict, cls: type) -> dict:
    """The fields of config dataclass `cls` present in `saved` (a saved section, or parsed flags)."""
    return {f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved}


def changed_settings(run_config: RunConfig, saved: dict) -> dict[str, list]:
    """{"section.field": [the checkpoint's value, this run's]} for every flag a resumed run changes."""
    changed = {}
    for name, section in run_config.sections().items():
        old = saved_fields(saved[name], type(section))
        for key, value in asdict(section).items():
            if key != "resume" and key in old and old[key] != value:
                changed[f"{name}.{key}"] = [old[key], value]
    return changed


def config_from_dict(saved: dict, cls: type):
    """A config dataclass from a saved section (see saved_fields): fields it lacks take their defaults, keys that are
    no field are ignored."""
    return cls(**saved_fields(saved, cls))


def section_classes(model_class: type, train_class: type, optimizer_name: str) -> dict[str, type]:
    return {"model": model_class, "train": train_class, "research": ResearchConfig,
            "optim": OPTIMIZERS[optimizer_name].config}


def preset_values(classes: dict[str, type], preset: str | None, optimizer_name: str) -> dict[str, dict]:
    """Each section's values under `preset` for `optimizer_name`: the defaults, then the preset's entries (those of the
    optimizer section only when the preset names no other optimizer)."""
    entries = PRESETS[preset] if preset else {}
    base = {section: asdict(cls()) for section, cls in classes.items()}
    for section, values in base.items():
        if section != "optim" or entries.get("optimizer", optimizer_name) == optimizer_name:
            values.update({k: v for k, v in entries.items() if k in values})
    base["train"]["optimizer"] = optimizer_name
    return base


def single_batch_start(step: int, hp) -> int | None:
    """The first validation sequence of the published runs' single-batch estimate at `step` (hp: the trainer's
    TrainConfig; --val-batch-estimate, docs/optimizers.md#paper-parity): the k-th global batch of the validation
    stream at the k-th multiple of --val-every, cycling within the --val-tokens budget; None when no estimate is
    due."""
    batches = hp.val_tokens // hp.batch_tokens  # whole --batch-tokens batches in the budget
    if not (hp.val_batch_estimate and hp.val_every and batches and step and step % hp.val_every == 0):
        return None
    return (step // hp.val_every - 1) % batches * (hp.batch_tokens // hp.seq_len)


def fields_where(section: object, key: str) -> list[str]:
    """The names of the fields of a config section whose flag metadata `key` is true."""
    return [f.name for f in dataclasses.fields(section) if f.metadata.get(key)]


def preset_report(run_config: RunConfig, dtype: str | None = None) -> dict:
    """What a run reproduces of the published runs and what differs (config.json's "preset" entry, printed at the
    start of log.txt; docs/optimizers.md#paper-parity): every flag that affects results and differs from the paper
    preset. A run without --preset is compared with gpt2-124m, whose values are the defaults. dtype: the precision
    the run computes in (run.process.Runtime.dtype_name; default: --dtype's)."""
    name = run_config.preset
    if name is not None and name not in ("gpt2-124m", "gpt2-124m-gelu"):
        return {"name": name, "reproduces": PRESET_NOTES.get(name, ""), "differs": []}
    reference = name or "gpt2-124m"
    optimizer_name = run_config.train.optimizer
    differs = [] if optimizer_name in PAPER_OPTIMIZERS else [
        f"--optimizer {optimizer_name} is not one of the paper's optimizers ({', '.join(PAPER_OPTIMIZERS)})"]
    classes = {section: type(values) for section, values in run_config.sections().items()}
    paper = preset_values(classes, reference, optimizer_name)
    for section, values in run_config.sections().items():
        for field_name in fields_where(values, "affects_results"):
            value, published = getattr(values, field_name), paper[section][field_name]
            if value != published:
                differs.append(f"{option(field_name)} {value} ({reference}: {published})")
    return {"name": name, "compared_with": reference, "reproduces": PRESET_NOTES[reference],
            "differs": differs + [PRECISION_NOTES[dtype or run_config.train.dtype], VALIDATION_PROTOCOL_NOTE],
            "sources": [SOURCE_CONFLICTS[optimizer_name]] if optimizer_name in SOURCE_CONFLICTS else []}


def preset_lines(report: dict) -> str:
    compared = report.get("compared_with")
    return (f"preset {report['name'] or 'none'}"
            + (f" (compared with {compared})" if compared and compared != report["name"] else "")
            + f": reproduces {report['reproduces']}" + "".join(f"\n  differs: {d}" for d in report["differs"])
            + "".join(f"\n  {note}" for note in report.get("sources", [])))


TRAINER = "train_gpt.py"  # how the trainer is run (python or torchrun): the name its messages give


def build_arg_parser(classes: dict[str, type], optimizer_name: str, base: dict[str, dict]) -> ArgumentParser:
    """A parser with one flag per field of every section, defaulting to `base` (defaults <- preset <- resumed
    config); the epilog lists every optimizer and the others' flags."""
    lines = ["optimizers (--optimizer NAME; its flags replace the optimizer group above):"]
    shared = {f.name for f in dataclasses.fields(OptimizerConfig)} - {"lr", "weight_decay"}
    for name, spec in sorted(OPTIMIZERS.items()):
        lines.append(f"  {name:6} {spec.description}")
        if name != optimizer_name:
            own = [f for f in dataclasses.fields(spec.config) if f.name not in shared]
            lines.append("         " + ", ".join(f"{option(f.name)} {f.default}" for f in own))
    parser = ArgumentParser(prog=TRAINER, epilog="\n".join(lines),
                            description="Train GPT-2 with symmetry-breaking attention biases (see README.md).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=argparse.SUPPRESS,
                        help="named configuration; flags override it. gpt2-124m (and -gelu) pin the paper's run, "
                             "whose values are also the defaults (docs/optimizers.md#paper-parity)")
    variant_fields = {f.name for f in dataclasses.fields(ModelVariants)}
    groups = [("model", f"model ({classes['model'].__name__})", lambda name: name not in variant_fields),
              ("model", "model variants (docs/variants.md)", lambda name: name in variant_fields),
              ("train", f"training ({classes['train'].__name__})", None),
              ("research", "research tools (docs/gauge.md, docs/evaluation.md)", None),
              ("optim", f"optimizer {optimizer_name} ({classes['optim'].__name__})", None)]
    for section, title, keep in groups:
        add_flags(parser.add_argument_group(title), classes[section], base[section], keep)
    return parser


def parse_run_config(argv: list[str] | None, model_class: type, train_class: type) -> RunConfig:
    """Defaults <- preset <- resumed checkpoint's config <- command-line flags, then checked, for the trainer's flag
    dataclasses `model_class` and `train_class` (train_gpt.parse_config passes its GPTConfig and TrainConfig)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = ArgumentParser(prog=TRAINER, add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS))
    pre.add_argument("--resume", default="")
    pre.add_argument("--optimizer", choices=sorted(OPTIMIZERS))
    known, _ = pre.parse_known_args(argv)
    saved, resume_from, notes = None, None, []
    if known.resume:
        try:
            resume_from, notes = resolve_resume(known.resume)
            ckpt = read_checkpoint(resume_from, model_class, train_class, mmap=True)  # reads no tensor
            if ckpt["kind"] != TRAINING:
                raise CheckpointError(f"--resume {known.resume}: a checkpoint of kind {ckpt['kind']} (model "
                                      f"weights, no training state); start a new run from them with --init-from "
                                      f"{known.resume}")
        except CheckpointError as exc:
            pre.error(str(exc))
        saved = ckpt["config"]
    preset = known.preset
    if saved and saved["preset"] in PRESETS:  # a resumed run keeps its preset
        if known.preset and known.preset != saved["preset"]:
            pre.error(f"--preset {known.preset}: the resumed run was started with --preset {saved['preset']}, which "
                      "it keeps (flags given with --resume change single settings)")
        preset = saved["preset"]
    optimizer_name = (known.optimizer or (saved["train"]["optimizer"] if saved else None)
                      or PRESETS.get(preset, {}).get("optimizer") or train_class.optimizer)
    classes = section_classes(model_class, train_class, optimizer_name)
    base = preset_values(classes, preset, optimizer_name)
    if saved:
        same_optimizer = saved["train"]["optimizer"] == optimizer_name
        for section, cls in classes.items():
            if section != "optim" or same_optimizer:
                base[section].update(saved_fields(saved[section], cls))
    base["train"]["optimizer"] = optimizer_name
    parser = build_arg_parser(classes, optimizer_name, base)
    if foreign := _foreign_optimizer_flag(argv, classes, optimizer_name):
        parser.error(foreign)
    args = vars(parser.parse_args(argv))
    run_config = RunConfig(*(config_from_dict(args, cls) for cls in classes.values()), preset,
                           resume_from=resume_from, notes=notes)
    if getattr(run_config.optim, "optim_seed", 0) == -1:  # SGDM's initial velocity: drawn per run seed
        run_config.optim.optim_seed = run_config.train.seed
    if saved:
        given = {arg.split("=")[0].removeprefix("--").replace("-", "_") for arg in argv if arg.startswith("--")}
        run_config.continue_in, note = resume_home(run_config.train, resume_from, ckpt["step"], given)
        run_config.notes += [note] * bool(note)
        if run_config.continue_in is None and "run_name" not in given:
            run_config.train.run_name = ""  # a new directory for a resumed run gets a fresh default name
    if problem := (config_problem(run_config, world_size_from_env())
                   or (resume_problem(run_config, saved) if saved else None)):
        parser.error(problem)
    return run_config


def _foreign_optimizer_flag(argv: list[str], classes: dict[str, type], optimizer_name: str) -> str | None:
    """An error for a flag that belongs to another optimizer's config than the chosen one, or None."""
    own = {f.name for cls in classes.values() for f in dataclasses.fields(cls)}
    for arg in argv:
        name = arg.split("=")[0].removeprefix("--no-").removeprefix("--").replace("-", "_")
        if not arg.startswith("--") or name in own:
            continue
        owners = [n for n, spec in sorted(OPTIMIZERS.items())
                  if name in {f.name for f in dataclasses.fields(spec.config)}]
        if owners:
            return (f"{arg.split('=')[0]} is a flag of --optimizer {' / '.join(owners)}; this run uses "
                    f"{optimizer_name}")
    return None


def config_problem(run_config: RunConfig, world: int = 1) -> str | None:
    """The first value outside its flag's range or inconsistency between flags, phrased as what to change; None
    when the config is valid."""
    for section in run_config.sections().values():
        if problem := field_problem(section):
            return problem
    model_config, hp = run_config.model, run_config.train
    if problem := model_problem(asdict(model_config), type(model_config)):
        return problem
    if hp.seq_len > model_config.block_size:
        return f"--seq-len {hp.seq_len} exceeds --block-size {model_config.block_size}"
    if hp.val_tokens < hp.seq_len:
        return (f"--val-tokens {hp.val_tokens} is less than one sequence of --seq-len {hp.seq_len}; raise --val-tokens "
                f"to at least {hp.seq_len}")
    if hp.init_from and not hp.resume:
        try:
            source = read_checkpoint(resolve_checkpoint_path(hp.init_from, flag="--init-from"),
                                     type(model_config), type(hp), mmap=True, verify=True)
        except CheckpointError as exc:
            return str(exc) if str(exc).startswith("--init-from") else f"--init-from {exc}"
        if problem := non_finite_weights(source["model"]):
            return (f"--init-from {hp.init_from}: {problem}: the run it comes from had diverged; start from a "
                    "checkpoint of an earlier step")
    if problem := variant_problem(model_config, run_config.research, hp.optimizer, hp.micro_batch, hp.seq_len):
        return problem
    if hp.profile_steps:
        try:
            parse_window(hp.profile_steps)
        except ValueError as exc:
            return str(exc)
    if hp.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is available (use --device cpu)"
    if hp.wandb_project and not module_available("wandb"):
        return (f"--wandb-project {hp.wandb_project}: the wandb package is not installed; `pip install wandb` "
                "(then `wandb login`), or leave --wandb-project empty")
    if hp.tensorboard and not module_available("tensorboard"):
        return (f"--tensorboard {hp.tensorboard}: the tensorboard package is not installed (torch.utils.tensorboard "
                "writes through it); `pip install tensorboard`, or leave --tensorboard empty")
    try:
        batch_layout(hp, world)
    except ValueError as exc:
        return str(exc)
    if hp.run_name and run_config.continue_in is None:  # a new run directory, <run-dir>/<run-name>
        return (directory_name_problem("--run-name", hp.run_name)
                or existing_run_problem(Path(hp.run_dir) / hp.run_name))
    return None


def section_problem(values: object, cls: type, built: bool = False) -> str | None:
    """The first value of a configuration section (`values` by field of `cls`, e.g. a checkpoint's "train" section)
    of another type than its field's; with `built` (a section a model is built from) also outside the field's range
    or choices. Fields the section lacks, and keys that are no field, are left alone (older checkpoints)."""
    if not isinstance(values, dict):
        return f"a {type(values).__name__}, not a section of fields"
    types = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, kind, choices = values[f.name], types[f.name], f.metadata.get("choices")
        if type(value) is not kind and not (kind is float and type(value) is int):
            return f"{option(f.name)} must be {kind.__name__}, got {value!r}"
        if built and choices and value not in choices:
            return f"{option(f.name)} must be one of {', '.join(choices)}, got {value!r}"
        if built and (problem := value_problem(f.name, value, f.metadata.get("bounds"))):
            return problem
    return None


def model_problem(values: dict, cls: type) -> str | None:
    """The first value of a model configuration (`values` by field of `cls`, e.g. a checkpoint's "model" section)
    that no model can be built with: another type than its field's, outside the field's range or choices, or heads
    that do not split the width; None when it can be built. The trainer's flags and every checkpoint reader
    (read_checkpoint) check it here."""
    if problem := section_problem(values, cls, built=True):
        return f"the model configuration is {problem}" if not isinstance(values, dict) else problem
    model_config = config_from_dict(values, cls)
    if model_config.n_embd % model_config.n_head:
        return f"--n-embd {model_config.n_embd} must be divisible by --n-head {model_config.n_head}"
    return None


def read_checkpoint(path: str | os.PathLike, model_class: type, train_class: type, **load) -> dict:
    """run.checkpoint.load_checkpoint (keyword arguments `load`), then its configuration checked against the
    trainer's config classes `model_class` and `train_class`: the way every checkpoint reader opens a file (--resume,
    --init-from, sample, eval, export), so a configuration no model can be built with, a section value of another
    type than its flag's or an attention path this version does not have is refused in one line naming the file and
    the entry."""
    ckpt = load_checkpoint(path, **load)
    saved = ckpt["config"]
    if problem := model_problem(saved["model"], model_class):
        raise CheckpointError(f"{path}: its model configuration builds no model ({problem}); it was altered after "
                              "the run wrote it: restore the file or use another checkpoint",
                              reason=f"invalid model configuration: {problem}")
    optimizer_name = saved["train"].get("optimizer", train_class.optimizer)
    known = isinstance(optimizer_name, str) and optimizer_name in OPTIMIZERS
    sections = {"train": train_class, "research": ResearchConfig,
                "optim": OPTIMIZERS[optimizer_name].config if known else OptimizerConfig}
    problems = {f"config.{name}": section_problem(saved[name], cls) for name, cls in sections.items()}
    if not known:
        problems["config.train"] = (f"--optimizer {optimizer_name!r} is none this version has "
                                    f"({', '.join(OPTIMIZERS)})")
    attention = saved["attention"]
    if attention is not None and attention.get("choice") not in (*attention_paths.IMPLEMENTATIONS, None):
        problems["config.attention"] = f"the attention path {attention.get('choice')!r} is none this version has"
    for entry, problem in problems.items():
        if problem:
            raise CheckpointError(f"{path}: its {entry} entry is damaged ({problem}); it was not written so by "
                                  "train_gpt.py: restore the file, or use another checkpoint",
                                  reason=f"{entry} damaged: {problem}")
    return ckpt


def resume_problem(run_config: RunConfig, saved: dict) -> str | None:
    """A flag given on --resume that cannot take effect (fixed_on_resume: the model, the data order, the biases,
    the optimizer's parameter groups), phrased as what to do; None when every flag can."""
    fixed = {f"{name}.{field_name}" for name, section in run_config.sections().items()
             for field_name in fields_where(section, "fixed_on_resume")}
    for key, (old, new) in changed_settings(run_config, saved).items():
        if key in fixed:
            return (f"{option(key.partition('.')[2])} cannot change when resuming (the checkpoint has {old!r}, the "
                    f"flags give {new!r}): it fixes the model, the data order, the biases or the optimizer state; "
                    "start a new run instead")
    return None


def resume_home(hp, checkpoint_path: Path, step: int, given: set[str]) -> tuple[Path | None, str | None]:
    """(directory, note): the directory a resumed run goes on in, the checkpoint's run directory (run_dir_of),
    unless the flags given (`given`) name another with --run-name/--run-dir, or --resume named a checkpoint file of
    a run that holds checkpoints of later steps than `step`, which going on there would replace (then the note says
    so; --resume RUN takes the newest intact checkpoint, see resolve_resume); None means a new run directory."""
    home = run_dir_of(checkpoint_path)
    if home is not None and given & {"run_name", "run_dir"}:
        home = home if hp.run_name and (Path(hp.run_dir) / hp.run_name).absolute() == home else None
    newer = newer_checkpoints(home, step) if home is not None and Path(hp.resume).is_file() else []
    if not newer:
        return home, None
    return None, (f"--resume {checkpoint_path}: {home} holds later checkpoints ({', '.join(newer)}), which going on "
                  "there would replace: this run starts a new run directory (--run-name names it)")
