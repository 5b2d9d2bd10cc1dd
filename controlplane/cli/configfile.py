"""``cachettl serve --config FILE``: the server's settings in a TOML file.

Every flag of ``serve`` is a key of the file, spelt as the flag without its two dashes
(``--max-concurrent-rpcs 512`` is ``max-concurrent-rpcs = 512``). The keys are read from the
command's argparse parser (:func:`config_keys`), so a flag added to ``serve`` is a key at once,
with the type its flag parses: an integer, a number, a string (a path, an address, an age such
as ``"7d"`` for the flags that take one; those also take a number), ``true``/``false`` for a
flag that takes no value. The file is flat: no tables.

Precedence, highest first: a flag on the command line; an environment variable that stands
for a key (:data:`ENV_KEYS`: ``$CACHETTL_DB`` for ``db``, ``$CACHETTL_CONSOLE_ADMIN_TOKEN`` for
``console-admin-token-file``); the file; the flag's default. A bad file (not TOML, an unknown
key, a value of the wrong type) stops the command with one line that names the file and the
key, before anything starts.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controlplane.cli.database import DB_ENV
from controlplane.console.cli import ADMIN_TOKEN_ENV

__all__ = [
    "ENV_KEYS",
    "add_config_flag",
    "config_keys",
    "key_kind",
    "load_config",
    "parse_with_config",
]

#: Keys an environment variable overrides when it is set (see the module's docstring).
ENV_KEYS = {"db": DB_ENV, "console-admin-token-file": ADMIN_TOKEN_ENV}
_NOT_KEYS = {"help", "config"}


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="read settings from this TOML file: every flag is a key, spelt without its "
        'dashes (listen = "0.0.0.0:50051"); flags and environment variables override it',
    )


def config_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each key of ``parser``'s configuration file and the flag's action, in the parser's
    order: every long option but ``--help`` and ``--config``."""
    keys = {}
    for action in parser._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if long and action.dest not in _NOT_KEYS and not isinstance(action, _NO_VALUE):
            keys[max(long, key=len)[2:]] = action
    return keys


_NO_VALUE = (argparse._HelpAction, argparse._VersionAction)


def key_kind(action: argparse.Action) -> str:
    """The TOML type a key takes, as the reference and the errors say it.

    >>> parser = argparse.ArgumentParser()
    >>> flags = [("--n", {"type": int}), ("--p", {"choices": "ab"}), ("--x", {"nargs": "+"})]
    >>> [key_kind(parser.add_argument(flag, **options)) for flag, options in flags]
    ['integer', 'string: a or b', 'array of string']
    """
    if action.nargs == 0:
        return "boolean"
    kind = action.type
    if kind is int:
        one = "integer"
    elif kind is float:
        one = "number"
    elif kind in (None, str, Path):
        one = "string"
    else:
        one = "string or number"
    if action.choices is not None:
        one += ": " + " or ".join(str(c) for c in action.choices)
    if _is_list(action):
        return f"array of {one}"
    return one


def _is_list(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?", 0)


def load_config(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``dest -> value`` of the file's keys that no set environment variable overrides;
    ValueError with one line naming the file and the key."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise ValueError(f"--config: cannot read {str(path)!r}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    keys = config_keys(parser)
    values = {}
    for key, value in data.items():
        action = keys.get(key)
        if action is None:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{path}: unknown key {key!r}{hint}; the keys are the flags of "
                f"`cachettl {parser.prog.split()[-1]} --help` without their dashes"
            )
        if os.environ.get(ENV_KEYS.get(key, "")):
            continue  # the environment overrides the file
        values[action.dest] = _value(f"{path}: key {key!r}", action, value)
    return values


def _value(where: str, action: argparse.Action, value: Any) -> Any:
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {_shown(value)}")
        return action.const if value else action.default
    if _is_list(action):
        if not isinstance(value, list):
            raise ValueError(f"{where} must be an array, got {_shown(value)}")
        return [_one(where, action, item) for item in value]
    return _one(where, action, value)


def _one(where: str, action: argparse.Action, value: Any) -> Any:
    kind = action.type
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int and not (number and isinstance(value, int)):
        raise ValueError(f"{where} must be an integer, got {_shown(value)}")
    if kind is float and not number:
        raise ValueError(f"{where} must be a number, got {_shown(value)}")
    if kind in (None, str, Path) and not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {_shown(value)}")
    if kind not in (None, str, Path, int, float) and not (number or isinstance(value, str)):
        raise ValueError(f"{where} must be a string or a number, got {_shown(value)}")
    if callable(kind) and kind is not int:  # the flag's own parser: a path, an age, ...
        try:
            value = kind(value if isinstance(value, str) or kind is float else str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
            raise ValueError(f"{where}: {error}") from None
    if action.choices is not None and value not in action.choices:
        valid = ", ".join(repr(c) for c in action.choices)
        raise ValueError(f"{where} must be one of {valid}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A TOML value as an error names it: its type and a short prefix.

    >>> _shown("12"), _shown(True), _shown([1, 2])
    ("string '12'", 'boolean true', 'array [1, 2]')
    """
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    names = {str: "string", int: "integer", float: "number", list: "array", dict: "table"}
    name = names.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{name} {text[:40]}{'...' if len(text) > 40 else ''}"


def parse_with_config(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, args: argparse.Namespace
) -> argparse.Namespace:
    """``args`` again, with the file named by ``args.config`` under the command line: its
    values become the subcommand's defaults, then ``argv`` is parsed once more."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices[args.command]
    command.set_defaults(**load_config(args.config, command))
    return parser.parse_args(argv)
