"""The command line of every tool (train_gpt.py, sample, export, data.*, eval.*, bench.*): one parser class
(`ArgumentParser`), flags declared once as dataclass fields (`flag`, `add_flags`, `field_problem`; booleans also get
`--no-field-name`), and progress bars (`progress_bar`)."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import re
import sys
import typing

_RANGE = re.compile(r"^\s*(?:(>=|>|<=|<)\s*(\S+)|([\[(])\s*([^,]+),\s*([^\])]+)([\])]))\s*$")


def flag(default: object, help: str, choices: typing.Collection[str] | None = None, *, bounds: str | None = None,
         affects_results: bool = True, fixed_on_resume: bool = False) -> typing.Any:
    """A dataclass field that is one command-line flag.

    choices: the allowed strings, read at each parse (a registry's live `keys()` admits what is registered later).
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
        if problem := value_problem(f.name, getattr(config, f.name), f.metadata.get("bounds")):
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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help as written (descriptions keep their lines), with each flag's default said once: appended unless the
    help text already says what the default is, or the default is empty (None, "")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, "", argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every command line here. `module` names the tool as users run it (`python -m eval.val_loss`);
    flags are never abbreviated (`--step 3` is not `--steps 3`); an error is one line, and an unknown flag names the
    known flag it resembles."""

    def __init__(self, *, module: str | None = None, **kwargs) -> None:
        if module is not None:
            kwargs.setdefault("prog", f"python -m {module}")
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        """As argparse's, but an unknown flag is refused first (before a missing required flag that it may be a
        misspelling of), with the flag it resembles."""
        args = sys.argv[1:] if args is None else list(args)
        known = self.known_flags()
        flags = args[:args.index("--")] if "--" in args else args
        unknown = [arg for arg in flags if arg.startswith("--") and arg.split("=", 1)[0] not in known]
        if unknown:
            self.error(unknown_arguments(unknown, known, self.prog))
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_arguments(extras, known, self.prog))
        return namespace

    def known_flags(self) -> list[str]:
        """Every flag this parser and its subcommands accept."""
        flags = []
        for action in self._actions:
            flags += [f for f in action.option_strings if f.startswith("--")]
            for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
                flags += [f for f in sub.known_flags() if f not in flags]
        return flags


def unknown_arguments(extras: list[str], known: list[str], prog: str) -> str:
    """The one-line refusal of arguments no flag took: the first unknown flag and the known flag it abbreviates or
    resembles (difflib), or the stray values."""
    flags = [arg.split("=", 1)[0] for arg in extras if arg.startswith("-") and not _is_number(arg)]
    if not flags:
        return f"unexpected argument{'s' * (len(extras) > 1)}: {' '.join(extras)}"
    flag, others = flags[0], [f for f in flags[1:] if f != flags[0]]
    longer = [k for k in known if k.startswith(flag) and k != flag]
    if longer:
        names = longer[0] if len(longer) == 1 else " or ".join(sorted(longer)[:4])
        message = f"unknown flag {flag} (flags are never abbreviated): did you mean {names}?"
    else:
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        message = (f"unknown flag {flag}: did you mean {close[0]}?" if close
                   else f"unknown flag {flag} ({prog} --help lists the flags)")
    return message + (f" (also unknown: {', '.join(others)})" if others else "")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


LINE_INTERVAL_S = 15.0  # how often a progress line is written where no terminal shows a bar


@functools.cache
def _line_progress() -> type:
    """tqdm for a log file or a pipe: every refresh is one plain line (no carriage returns, no padding). Built on
    first use, so that this module needs only the standard library (bench/gpu_session.py's driver imports it)."""
    from tqdm import tqdm

    class LineProgress(tqdm):
        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            if msg == "":  # tqdm clearing its bar: nothing to clear
                return False
            self.fp.write(f"{self if msg is None else msg}\n")
            self.fp.flush()
            return True

        def close(self) -> None:
            if not self.disable and self.leave is not False and getattr(self, "last_print_t", None) is not None:
                self.display()  # the final count, then nothing more (tqdm would end the bar with a newline)
            self.leave = False
            super().close()

    return LineProgress


def progress_bar(iterable: typing.Iterable | None = None, **kwargs) -> typing.Any:
    """A progress bar (a tqdm) on stderr (or `file=`): tqdm's own on a terminal; elsewhere a plain line every
    LINE_INTERVAL_S (the first after that long) and one with the totals at the end, so a short task writes one
    line."""
    stream = kwargs.setdefault("file", sys.stderr)
    if stream is not None and hasattr(stream, "isatty") and stream.isatty():
        from tqdm import tqdm

        return tqdm(iterable, **kwargs)
    kwargs.setdefault("mininterval", LINE_INTERVAL_S)
    kwargs.setdefault("delay", LINE_INTERVAL_S)
    return _line_progress()(iterable, **kwargs)
