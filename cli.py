"""Command-line flags from dataclass fields.

`flag()` declares a field's default, help, choices and what the rest of the code needs to know about it (its
allowed range, whether it changes a run's numbers, whether a resumed run may change it) in one place; `add_flags()`
turns every field of a config dataclass into `--field-name` (booleans also get `--no-field-name`), and
`field_problem()` checks every value against its declared range.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing

_RANGE = re.compile(r"^\s*(?:(>=|>|<=|<)\s*(\S+)|([\[(])\s*([^,]+),\s*([^\])]+)([\])]))\s*$")


def flag(default: object, help: str, choices: tuple[str, ...] | None = None, *, bounds: str | None = None,
         affects_results: bool = True, fixed_on_resume: bool = False) -> typing.Any:
    """A dataclass field that is one command-line flag.

    bounds: the allowed values of a number, as ">= 0", "> 0", "< 1", "[0, 1]", "(0, 1]" ... (NaN and infinity are never
    allowed). affects_results: False for flags that only say where, how often or how fast (logging, checkpoints,
    devices), which the presets' parity report ignores. fixed_on_resume: a resumed run must keep the checkpoint's
    value (it fixes the model, the data order, the biases or the optimizer state).
    """
    if bounds is not None:
        _parse_bounds(bounds)  # a malformed range fails at import, not at the first bad value
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "bounds": bounds, "affects_results": affects_results,
        "fixed_on_resume": fixed_on_resume})


def option(name: str) -> str:
    """The flag spelling of a field name: `micro_batch` -> `--micro-batch`."""
    return "--" + name.replace("_", "-")


def _parse_bounds(bounds: str) -> tuple[float, float, bool, bool]:
    """(low, high, low_inclusive, high_inclusive) of a range written as in `flag`."""
    match = _RANGE.match(bounds)
    if not match:
        raise ValueError(f"bounds {bounds!r}: write '>= a', '> a', '<= a', '< a' or an interval like '[a, b)'")
    if match.group(1):
        bound, inclusive = float(match.group(2)), match.group(1).endswith("=")
        if match.group(1).startswith(">"):
            return bound, math.inf, inclusive, False
        return -math.inf, bound, False, inclusive
    return float(match.group(4)), float(match.group(5)), match.group(3) == "[", match.group(6) == "]"


def value_problem(name: str, value: object, bounds: str | None) -> str | None:
    """Why `value` is not an allowed value of flag `name` (non-finite, or outside `bounds`); None when it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return f"{option(name)} must be a finite number, got {value}"
    if bounds is None:
        return None
    low, high, low_in, high_in = _parse_bounds(bounds)
    inside = (value >= low if low_in else value > low) and (value <= high if high_in else value < high)
    return None if inside else f"{option(name)} must be {bounds.strip()}, got {value}"


def field_problem(config: object) -> str | None:
    """The first field of dataclass instance `config` whose value is outside its declared range; None if none."""
    for f in dataclasses.fields(config):
        problem = value_problem(f.name, getattr(config, f.name), f.metadata.get("bounds"))
        if problem:
            return problem
    return None


def add_flags(group: argparse._ActionsContainer, cls: type, defaults: dict[str, object],
              keep: typing.Callable[[str], bool] | None = None) -> None:
    """Add one flag per field of dataclass `cls` (those whose name `keep` accepts) to `group`, defaulting to
    `defaults[field]`."""
    types = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if keep is not None and not keep(f.name):
            continue
        kind, meta = types[f.name], f.metadata
        if kind not in (bool, int, float, str):
            raise TypeError(f"{cls.__name__}.{f.name}: a flag's type is bool, int, float or str, not {kind}")
        help_text = (meta.get("help", "") + (f" (allowed: {meta['bounds']})" if meta.get("bounds") else "")
                     + (" (fixed on --resume)" if meta.get("fixed_on_resume") else ""))
        kwargs: dict = {"default": defaults[f.name], "dest": f.name, "help": help_text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        else:
            kwargs["type"] = _converter(kind, option(f.name))
            kwargs["metavar"] = kind.__name__.upper()
        group.add_argument(option(f.name), **kwargs)


def _converter(kind: type, flag_name: str):
    def convert(text: str) -> object:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag_name} expects {kind.__name__}, got {text!r}") from None
    return convert


MODEL_HELP = ("run directory (its checkpoints/latest.pt), checkpoint file, or directory written by `python -m export "
              "to-hf`; --run is the same flag")


class _GivenOnce(argparse.Action):
    """Store a flag's value, refusing a second one (the flag's other spelling included)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{' / '.join(self.option_strings)} given twice; name one model")
        setattr(namespace, self.dest, values)


def add_model_flag(parser: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    """`--checkpoint PATH` (alias `--run`): the model every CLI that reads one takes (sample, export to-hf, the
    evaluations), a run directory, a checkpoint file or an exported directory (export.model_file)."""
    parser.add_argument("--checkpoint", "--run", dest="checkpoint", required=True, metavar="PATH",
                        default=argparse.SUPPRESS, action=_GivenOnce, help=help)
