"""Command-line flags from a hyperparameter dataclass, so a recipe declares each setting once; the parser every
command of the toolkit uses (no abbreviated flags) and `listing`, how a message shortens a list.

>>> from dataclasses import dataclass, field
>>> @dataclass
... class Config:
...     lr: float = field(default=0.1, metadata={"help": "peak learning rate"})
>>> parse_config(Config, ["--lr", "0.5"]).lr
0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from toolkit.errors import UserError, install_excepthook, write_error_file


def listing(items, limit: int = 8) -> str:
    """`items` for a message, comma-separated; past `limit` of them, the rest counted, so a shortened list
    never reads as a complete one.

    >>> listing(["cat", "dog"])
    'cat, dog'
    >>> listing([f"c{i}" for i in range(12)], limit=3)
    'c0, c1, c2, … and 9 more'
    """
    items = [str(item) for item in items]
    if len(items) <= limit + 1:  # "… and 1 more" would take the place of the one name it hides
        return ", ".join(items)
    return f"{', '.join(items[:limit])}, … and {len(items) - limit} more"


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that takes no abbreviations: argparse's default would take `--epoch 2` for `--epochs 2`
    without a word. Every parser of the toolkit is one (`with_suggestion` then names the flag meant)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def with_suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's message, plus the flag of `parser` an unknown one abbreviates or resembles: `unrecognized
    arguments: --epoch 2; did you mean --epochs?`."""
    import difflib

    unknown = next((word.split("=")[0] for word in message.split() if word.startswith("--")), None)
    if not message.startswith("unrecognized arguments:") or unknown is None:
        return message
    names = {}  # every spelling of a flag -> its first spelling
    for action in parser._actions:
        spellings = [s for s in action.option_strings if s.startswith("--")]
        if action.help != argparse.SUPPRESS:
            names.update((s, spellings[0]) for s in spellings)
    close = sorted({names[s] for s in names if s.startswith(unknown)}) or [
        names[s] for s in difflib.get_close_matches(unknown, sorted(names), n=1, cutoff=0.75)]
    return f"{message}; did you mean {' or '.join(close)}?" if close else message


class _Parser(StrictParser):
    def error(self, message):  # one line and exit 2, said by each node's local rank 0 (every rank parses the same)
        speaks = os.environ.get("LOCAL_RANK", "0") in ("", "0")
        sentence = f"{with_suggestion(self, message)} (see --help)"
        write_error_file(UserError(sentence), said=speaks)  # plain torchrun and accelerate launch: their root cause
        self.exit(2, f"error: {sentence}\n" if speaks else None)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default; a None default of a recipe flag means the model's preset fills it."""

    def _get_help_string(self, action):
        if action.default is None and action.help and "default:" in action.help:  # says its own default
            return action.help
        if action.default is None and action.help and "preset" in action.help:
            return action.help + " (default: the model's preset)"
        return super()._get_help_string(action)


def _flag_type(annotation):
    """The argparse type of a field annotated `int`, `float | None`, `str`, ... (bool is a switch)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def build_parser(config_class, description: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(description=description, formatter_class=_DefaultsFormatter)
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        flag = "--" + field.name.replace("_", "-")
        meta = dict(field.metadata)
        kind = meta.pop("type", None) or _flag_type(hints[field.name])
        if not meta.get("help") and meta.get("choices"):  # argparse shows a default only next to a help text
            meta["help"] = "one of " + ", ".join(map(str, meta["choices"]))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=meta.get("help"))
        else:
            parser.add_argument(flag, type=kind, default=field.default, choices=meta.get("choices"),
                                help=meta.get("help"), metavar=meta.get("metavar"))
    # The legacy `python -m torch.distributed.launch` appends --local-rank=N; read_launch_env reads it.
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    return parser


def parse_config(config_class, argv=None, description: str | None = None):
    """Parse flags into a frozen-by-convention instance of `config_class`."""
    install_excepthook()  # a UserError raised while checking flags is one line, exit 2
    namespace = vars(build_parser(config_class, description).parse_args(argv))
    namespace.pop("local_rank", None)
    return config_class(**namespace)
