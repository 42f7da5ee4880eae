"""Command-line flags from dataclass fields: `flag()` declares a field's default, help and choices in one place,
`add_flags()` turns every field of a config dataclass into `--field-name` (booleans also get `--no-field-name`)."""
from __future__ import annotations

import argparse
import dataclasses
import typing


def flag(default: object, help: str, choices: tuple[str, ...] | None = None) -> typing.Any:
    """A dataclass field whose default, help text and (optional) choices define one command-line flag."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def option(name: str) -> str:
    """The flag spelling of a field name: `micro_batch` -> `--micro-batch`."""
    return "--" + name.replace("_", "-")


def add_flags(group: argparse._ActionsContainer, cls: type, defaults: dict[str, object]) -> None:
    """Add one flag per field of dataclass `cls` to `group`, defaulting to `defaults[field]`."""
    types = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, meta = types[f.name], f.metadata
        if kind not in (bool, int, float, str):
            raise TypeError(f"{cls.__name__}.{f.name}: a flag's type is bool, int, float or str, not {kind}")
        kwargs: dict = {"default": defaults[f.name], "dest": f.name, "help": meta.get("help", "")}
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
