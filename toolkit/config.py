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
        if meta.pop("flag", True) is False:  # set by parse_config itself (print_config), not a flag of its own
            continue
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
    parser.add_argument("--config", metavar="FILE", action=_ConfigFile, default=argparse.SUPPRESS,
                        help="read settings from a YAML or TOML file of the flags' names (a run's config.yaml); "
                             "flags after it override it, flags before it are overridden")
    parser.add_argument("--print-config", nargs="?", const="same", type=_config_format_name, metavar="yaml|toml",
                        help="print the resolved settings (in --config's format, else YAML) and exit")
    return parser


def parse_config(config_class, argv=None, description: str | None = None):
    """Parse flags (and --config files, where they stand among them) into an instance of `config_class`.
    --print-config is kept in the class's `print_config` field when it has one (TrainingConfig prints once the
    presets have filled it); else it prints here and exits."""
    install_excepthook()  # a UserError raised while checking flags is one line, exit 2
    namespace = vars(build_parser(config_class, description).parse_args(argv))
    namespace.pop("local_rank", None)
    source, shown = namespace.pop("config", None), namespace.pop("print_config", None)
    if shown == "same":
        shown = config_format(source) if source else "yaml"
    if shown and "print_config" not in {field.name for field in dataclasses.fields(config_class)}:
        print(config_text(namespace, shown), end="")
        raise SystemExit(0)
    return config_class(**namespace, **({"print_config": shown} if shown else {}))


# --config and --print-config: a run described by one file, in the flags' names.
CONFIG_FORMATS = ("yaml", "toml")


def _config_format_name(text: str) -> str:
    if text not in CONFIG_FORMATS + ("same",):
        raise argparse.ArgumentTypeError(f"{text!r} is not yaml or toml")
    return text


def config_format(path: str) -> str:
    """"toml" for a .toml file, else "yaml" (a run's config.yaml, .yml)."""
    return "toml" if str(path).lower().endswith(".toml") else "yaml"


def read_config_file(path: str) -> dict:
    """The settings in a YAML or TOML file: a mapping of flag names (`lr`, `micro_batch_size` or
    `micro-batch-size`) to values; one sentence (UserError) when it cannot be read as one."""
    try:
        with open(path, "rb") as file:
            text = file.read()
    except OSError as error:
        raise UserError(f"--config {path}: {error.strerror or error}.") from None
    try:
        if config_format(path) == "toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            values = tomllib.loads(text.decode())
        else:
            import yaml

            values = yaml.safe_load(text)
    except Exception as error:  # yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError
        mark = getattr(error, "problem_mark", None)  # YAML's: the problem and where it stands
        where = (f"{error.problem} at line {mark.line + 1}" if mark is not None and getattr(error, "problem", None)
                 else str(error).splitlines()[0] if str(error) else type(error).__name__)
        raise UserError(f"--config {path} is not valid {config_format(path).upper()}: {where}.") from None
    if values is None:  # an empty file
        return {}
    if not isinstance(values, dict):
        raise UserError(f"--config {path} must hold a mapping of setting names to values, not a "
                        f"{type(values).__name__}.")
    return {str(key).replace("-", "_"): value for key, value in values.items()}


def config_values(cfg) -> dict:
    """A config dataclass's settings by flag name, as a config file holds them (print_config left out)."""
    return {field.name: getattr(cfg, field.name) for field in dataclasses.fields(cfg)
            if field.metadata.get("flag", True) is not False}


def config_text(values: dict, form: str) -> str:
    """`values` (flag names to scalars) as a YAML or TOML file that --config reads back. TOML has no null: a
    None is left out, which --config reads as the flag's default (None for every flag a None can reach)."""
    if form == "yaml":
        import yaml

        return yaml.safe_dump(values, sort_keys=False)
    import json

    def toml(value):
        if isinstance(value, bool):
            return "true" if value else "false"
        return repr(value) if isinstance(value, (int, float)) else json.dumps(str(value))

    return "".join(f"{name} = {toml(value)}\n" for name, value in values.items() if value is not None)


class _ConfigFile(argparse.Action):
    """--config FILE: set each named setting where the flag stands, so flags after it override the file and the
    file overrides flags before it (LightningCLI's --config, jsonargparse's order). Each value goes through its
    flag's own type and choices; an unknown name is one sentence with the closest valid one."""

    def __call__(self, parser, namespace, path, option_string=None):
        import difflib

        actions = {action.dest: action for action in parser._actions
                   if action.option_strings and action.help != argparse.SUPPRESS and action.dest != "config"}
        for name, value in read_config_file(path).items():
            action = actions.get(name)
            if action is None or name == "print_config":
                close = difflib.get_close_matches(name, [n for n in actions if n != "print_config"], n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; valid names: {listing(sorted(actions))}"
                parser.error(f"--config {path}: unknown setting {name!r}{hint}")
            setattr(namespace, name, _config_value(parser, action, path, name, value))
        setattr(namespace, self.dest, path)


def _config_value(parser, action, path, name, value):
    """`value` from a config file as `action`'s flag would have parsed it, or parser.error naming it."""
    def refuse(why):
        parser.error(f"--config {path}: {name}: {value!r} {why}")

    if value is None:
        if action.default is not None:
            refuse(f"is not allowed; leave {name} out for its default {action.default!r}")
        return None
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            refuse("is not true or false")
        return value
    if isinstance(value, (dict, list)):
        refuse("is not a single value")
    if isinstance(value, bool):  # YAML reads an unquoted no/yes/off/on as a boolean
        refuse("is a boolean, not this flag's value; quote it if a word was meant")
    try:
        value = action.type(value if isinstance(value, str) else str(value)) if action.type else str(value)
    except (TypeError, ValueError):
        refuse({int: "an integer", float: "a number"}.get(action.type, "a valid value").join(("is not ", "")))
    if action.choices is not None and value not in action.choices:
        refuse(f"is not one of {', '.join(map(str, action.choices))}")
    return value
