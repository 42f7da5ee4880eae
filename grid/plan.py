"""What a grid runs: axes of train_gpt.py flags and the flags every run shares (from the command line or a TOML
file), at the paper's scale or the CPU's (the trainer's cpu preset), one run per combination of axis values with a
readable, stable name, each run's flags checked by train_gpt.py's own parser, and the command that trains or resumes
it (docs/grid.md). The trainer's modules import torch: the functions that ask them import them, so that what only
reads a grid (`python -m grid status`, a Slurm task) never imports torch."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import io
import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cli import option
from run.directory import directory_name_problem, run_holder

if TYPE_CHECKING:
    import config

TRAIN_SCRIPT = Path(importlib.util.find_spec("train_gpt").origin).resolve()  # found, not imported
RESERVED = {"run-dir": "give --run-dir to the grid (before --): runs go to <run-dir>/<name>/<run>",
            "run-name": "the grid names each run after its axis values",
            "resume": "the grid resumes interrupted runs itself: run the same grid command again"}
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
TOML_KEYS = ("name", "run_dir", "axes", "flags")
TOML_SCALARS = (str, int, float, bool)  # what a TOML value of an axis or a flag may be
SCALES = ("paper", "cpu")  # --scale: the grid as given, or its runs resized by the trainer's preset of that name


class GridError(ValueError):
    """A grid that cannot be planned as given (the message names the flag, value or file and the fix)."""


@functools.cache
def train_flags() -> dict[str, bool]:
    """Every train_gpt.py flag (dash-separated, no leading dashes) -> whether it is a boolean, over every
    optimizer's flags."""
    import config
    import train_gpt
    from optim import OPTIMIZERS

    flags = {"preset": False}
    for optimizer in OPTIMIZERS:
        for cls in config.section_classes(train_gpt.GPTConfig, train_gpt.TrainConfig, optimizer).values():
            flags.update({f.name.replace("_", "-"): f.type in (bool, "bool") for f in dataclasses.fields(cls)})
    return flags


def unknown_flag(name: str, known: dict[str, bool], where: str) -> GridError:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean --{close[0]}?)" if close else " (python train_gpt.py --help lists them)"
    return GridError(f"{where}: train_gpt.py has no flag --{name}{hint}")


@dataclass
class Axis:
    """One axis: a train_gpt.py flag (dash-separated, no dashes in front) and its values, in order."""

    flag: str
    values: list[str]

    @classmethod
    def parse(cls, text: str) -> Axis:
        """`FLAG=V1,V2,...` (the flag with or without its leading dashes)."""
        flag, sep, values = text.partition("=")
        flag = flag.strip().removeprefix("--")
        items = [v.strip() for v in values.split(",")]
        if not sep or not flag or not all(items):
            raise GridError(f"--axis {text}: write FLAG=V1,V2,... (e.g. --axis optimizer=ecd,adamw)")
        return cls(flag, items)


@dataclass
class GridSpec:
    """A grid as the user gave it: its name, the parent of its directory, the axes and the shared flags."""

    name: str
    run_dir: Path
    axes: list[Axis]
    flags: list[str] = field(default_factory=list)

    @property
    def directory(self) -> Path:
        return self.run_dir / self.name


def _flag_words(name: str, value: object) -> list[str]:
    if isinstance(value, bool):
        return [f"--{name}" if value else f"--no-{name}"]
    return [f"--{name}={value}"]


def _flag_table(path: Path, section: str, table: dict) -> dict[str, object]:
    """A TOML table of flags ([axes] or [flags]) keyed by each flag's spelling (underscores as dashes); GridError
    where two keys name one flag (bias_mode and bias-mode) or a value is not a string, number or boolean (in [axes]:
    a non-empty list of them)."""
    flags: dict[str, object] = {}
    for key, value in table.items():
        name = key.replace("_", "-")
        if name in flags:
            other = next(k for k in table if k != key and k.replace("_", "-") == name)
            raise GridError(f"--grid {path}: [{section}] names --{name} twice ({other} and {key}): keep one")
        if section == "axes":
            fits = isinstance(value, list) and value and all(isinstance(v, TOML_SCALARS) for v in value)
            shape = "a non-empty list of strings, numbers or booleans, e.g. seed = [42, 83]"
        else:
            fits, shape = isinstance(value, TOML_SCALARS), "a string, a number or a boolean, e.g. steps = 100"
        if not fits:
            raise GridError(f"--grid {path}: [{section}] {key} = {value!r}: give {shape}")
        flags[name] = value
    return flags


def read_toml(path: Path) -> dict:
    """A grid file: {"name", "run_dir", "axes": {flag: [values]}, "flags": table or list}; every key and the type
    of every value checked (one-line GridErrors naming the file and the key)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise GridError("--grid: reading TOML needs Python 3.11 or newer, or on Python 3.10 the tomli package "
                            "(`pip install tomli`)") from None
    try:
        data = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as exc:
        raise GridError(f"--grid {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise GridError(f"--grid {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                        "save the file as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise GridError(f"--grid {path}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - set(TOML_KEYS))
    if unknown:
        raise GridError(f"--grid {path}: unknown keys {', '.join(unknown)} (a grid file holds {', '.join(TOML_KEYS)})")
    for key, example in (("name", 'name = "paper"'), ("run_dir", 'run_dir = "runs"')):
        if key in data and not (isinstance(data[key], str) and data[key]):
            raise GridError(f"--grid {path}: {key} = {data[key]!r}: give a non-empty string, e.g. {example}")
    axes = data.get("axes", {})
    if not isinstance(axes, dict):
        raise GridError(f"--grid {path}: axes is a table ([axes]) that maps each flag to its values, e.g. seed = [42, "
                        "83]")
    axes = _flag_table(path, "axes", axes)
    flags = data.get("flags", [])
    if isinstance(flags, dict):
        known = train_flags()
        words = []
        for name, value in _flag_table(path, "flags", flags).items():
            if isinstance(value, bool) and known.get(name) is False:
                raise GridError(f"--grid {path}: [flags] {name} = {str(value).lower()}: --{name} takes a value, not "
                                f"true or false (python train_gpt.py --help describes it)")
            words += _flag_words(name, value)
        flags = words
    elif not (isinstance(flags, list) and all(isinstance(w, str) for w in flags)):
        raise GridError(f"--grid {path}: flags is a table (steps = 100) or a list of strings ([\"--steps\", \"100\"])")
    return {"name": data.get("name"), "run_dir": data.get("run_dir"), "flags": flags,
            "axes": [Axis(name, [str(v).lower() if isinstance(v, bool) else str(v) for v in values])
                     for name, values in axes.items()]}


def build_spec(name: str | None, run_dir: str | None, axes: list[str], flags: list[str],
               grid_file: Path | None) -> GridSpec:
    """The grid from a TOML file (if any) and the command line, which wins: its --name and --run-dir replace the
    file's, an --axis of a flag the file has replaces that axis, and its shared flags come after the file's."""
    base = read_toml(grid_file) if grid_file else {"name": None, "run_dir": None, "axes": [], "flags": []}
    merged, given = {axis.flag: axis for axis in base["axes"]}, {}
    for text in axes:
        axis = Axis.parse(text)
        if axis.flag in given:
            raise GridError(f"--axis {axis.flag} is given twice ({given[axis.flag]} and {text}): give one --axis per "
                            f"flag with all its values, e.g. --axis {axis.flag}="
                            + ",".join(merged[axis.flag].values + axis.values))
        given[axis.flag] = text
        merged[axis.flag] = axis
    name = name or base["name"]
    if not name:
        raise GridError("name the grid: --name NAME (or name = \"...\" in the --grid file); runs go to "
                        "<run-dir>/<name>/")
    if problem := directory_name_problem("--name", name):
        raise GridError(problem)
    if not merged:
        raise GridError("a grid needs at least one --axis FLAG=V1,V2,... (or an [axes] table in the --grid file)")
    return GridSpec(name, Path(run_dir or base["run_dir"] or "runs"), list(merged.values()), base["flags"] + flags)


def scaled(spec: GridSpec, scale: str, given_flags: int) -> GridSpec:
    """`spec` at `scale` (SCALES): unchanged at the paper's; otherwise with the entries of the trainer's preset of
    that name (config.PRESETS) as flags before its last `given_flags` (those given after `--`, which win) and
    `-<scale>` after its name. As flags, not as --preset, they change only what that preset sets: the grid's own
    preset, optimizer, biases and schedule stay."""
    if scale == "paper":
        return spec
    import config

    words = [word for key, value in config.PRESETS[scale].items() for word in _flag_words(key.replace("_", "-"), value)]
    cut = len(spec.flags) - given_flags
    return dataclasses.replace(spec, name=f"{spec.name}-{scale}", flags=spec.flags[:cut] + words + spec.flags[cut:])


def check_flags(spec: GridSpec, known: dict[str, bool]) -> None:
    """Refuse, before anything runs, an axis or shared flag that train_gpt.py does not have, one the grid sets
    itself, a boolean axis value that is not true/false, and a value repeated on an axis."""
    for axis in spec.axes:
        where = f"--axis {axis.flag}"
        if axis.flag in RESERVED:
            raise GridError(f"{where}: {RESERVED[axis.flag]}")
        if axis.flag not in known:
            raise unknown_flag(axis.flag, known, where)
        if known[axis.flag] and not all(v.lower() in TRUE + FALSE for v in axis.values):
            raise GridError(f"{where}: a boolean flag takes true or false, got {','.join(axis.values)}")
        if len(set(axis.values)) < len(axis.values):
            raise GridError(f"{where}: a value is repeated ({','.join(axis.values)})")
    for word in spec.flags:
        if not word.startswith("--"):
            continue
        name = word[2:].partition("=")[0]
        plain = name[3:] if name.startswith("no-") and known.get(name[3:]) else name
        if plain in RESERVED:
            raise GridError(f"--{plain} after --: {RESERVED[plain]}")
        if plain not in known:
            raise unknown_flag(name, known, f"--{name} after --")
        if plain in {axis.flag for axis in spec.axes}:
            raise GridError(f"--{plain} is an --axis and a shared flag after --: give it once")


def _safe(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", value)


@dataclass
class PlannedRun:
    """One run of the grid: its name (`flag=value,...`), axis values, train_gpt.py flags, directory and what the
    trainer's parser says of them (problem, device, steps, tokens per step, the parsed configuration)."""

    name: str
    values: dict[str, str]
    flags: list[str]
    path: Path
    problem: str | None = None
    device: str = "cpu"
    steps: int = 0
    batch_tokens: int = 0
    stop_at_target: bool = False
    train_files: str = ""
    config: config.RunConfig | None = None

    def record(self) -> dict:
        """The run as grid.jsonl's start record keeps it (what `status`, `report`, the progress table and a Slurm
        array task read)."""
        return {"name": self.name, "values": self.values, "flags": self.flags, "path": str(self.path),
                "steps": self.steps, "batch_tokens": self.batch_tokens, "stop_at_target": self.stop_at_target,
                "device": self.device, "problem": self.problem}

    @classmethod
    def from_record(cls, record: dict) -> PlannedRun:
        """The run a start record keeps (`record`'s inverse, without the parsed configuration)."""
        return cls(record["name"], record["values"], record["flags"], Path(record["path"]), record["problem"],
                   record["device"], record["steps"], record["batch_tokens"], record["stop_at_target"])


def parser_problem(flags: list[str], world: int) -> tuple[str | None, object]:
    """(train_gpt.py's refusal of `flags`, or None; the parsed RunConfig) with the batch split over `world`
    processes checked too. The parser's usage text is dropped: the error line is kept."""
    import train_gpt
    from run.process import batch_layout

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(io.StringIO()):
            cfg = train_gpt.parse_config(flags)
    except SystemExit:
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        last = lines[-1] if lines else "train_gpt.py refused these flags"
        return last.split("error: ", 1)[-1], None
    try:
        batch_layout(cfg.train, world)
    except ValueError as exc:
        return str(exc), cfg
    return None, cfg


def plan_runs(spec: GridSpec, known: dict[str, bool], gpus_per_run: int, have_gpus: bool) -> list[PlannedRun]:
    """One PlannedRun per combination of axis values (the first axis varying slowest), each checked by train_gpt.py's
    parser (`known`: train_flags()); a refused combination keeps its reason in `problem`. Raises GridError when
    names collide."""
    runs, directory = [], spec.directory.absolute()
    for combo in itertools.product(*(axis.values for axis in spec.axes)):
        values = {axis.flag: value for axis, value in zip(spec.axes, combo)}
        name = ",".join(f"{flag}={_safe(value)}" for flag, value in values.items())
        flags = list(spec.flags)
        for flag, value in values.items():
            flags += _flag_words(flag, value.lower() in TRUE) if known[flag] else _flag_words(flag, value)
        problem, cfg = parser_problem(flags, gpus_per_run)
        run = PlannedRun(name, values, flags, directory / name, problem)
        if cfg is not None:
            hp = cfg.train
            run.device = "cuda" if hp.device == "cuda" or (hp.device == "auto" and have_gpus) else "cpu"
            run.steps, run.batch_tokens, run.stop_at_target = hp.steps, hp.batch_tokens, hp.stop_at_target
            run.train_files, run.config = hp.train_files, cfg
        runs.append(run)
    names = [r.name for r in runs]
    if len(set(names)) < len(names):
        raise GridError("two runs get the same directory name (values that differ only in characters outside "
                        "A-Z a-z 0-9 . _ + -): choose values that differ in those")
    same: dict[str, PlannedRun] = {}
    for run in runs:
        if run.problem is None and (twin := same.setdefault(json.dumps(run.config.to_dict()), run)) is not run:
            axis = next(a.flag for a in spec.axes if twin.values[a.flag] != run.values[a.flag])
            raise GridError(f"--axis {axis}: {twin.values[axis]} and {run.values[axis]} are one value to train_gpt.py "
                            f"(runs {twin.name} and {run.name} would train the same configuration): give it once")
    return runs


def recorded_changes(run: PlannedRun) -> list[str]:
    """How the configuration the run's trainer recorded (its config.json, or where that is gone the configuration
    its latest checkpoint holds) differs from what the grid asks now: `--flag OLD (now NEW)` for every flag but those
    the grid sets itself (RESERVED); empty when they agree or while a trainer that holds the run has not yet written
    config.json (it does just after taking it). A run that trained but records its flags nowhere is a difference
    too: it cannot count as this grid's run."""
    try:
        recorded = json.loads((run.path / "config.json").read_text())
    except FileNotFoundError:
        recorded = checkpoint_config(run.path)
        if recorded is None:
            return [] if run_holder(run.path) else ["neither a config.json nor a checkpoint records the flags it was "
                                                    "trained with (restore its config.json, or move the run away)"]
    except (OSError, ValueError) as exc:
        return [f"its config.json cannot be read ({exc})"]
    import config

    try:
        changed = config.changed_settings(run.config, recorded)
    except (KeyError, TypeError, AttributeError) as exc:
        return [f"its recorded configuration is damaged ({type(exc).__name__}: {exc})"]
    return [f"{option(flag)} {old} (now {new})" for key, (old, new) in changed.items()
            if (flag := key.partition(".")[2]).replace("_", "-") not in RESERVED]


def checkpoint_config(run_dir: Path) -> dict | None:
    """The configuration the newest readable checkpoint of a run holds (None: it has none)."""
    from run.checkpoint import CheckpointError, load_checkpoint, run_checkpoints

    for path in reversed(run_checkpoints(run_dir)):
        with contextlib.suppress(CheckpointError):
            return load_checkpoint(path, mmap=True)["config"]
    return None


def train_command(run: PlannedRun, gpus_per_run: int, resume: bool, python: str = sys.executable) -> list[str]:
    """The command that trains `run` (in its directory), or continues it with --resume; under torchrun on
    `gpus_per_run` GPUs when that is more than one."""
    where = ["--resume", str(run.path)] if resume else ["--run-dir", str(run.path.parent), "--run-name", run.path.name]
    launcher = ([python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus_per_run}"]
                if gpus_per_run > 1 and run.device == "cuda" else [python])
    return launcher + [str(TRAIN_SCRIPT)] + run.flags + where
