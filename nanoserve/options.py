"""The process commands' options, each declared once, on the config field it fills.

The configs are ``WorkerConfig``, ``ParallelConfig``, ``SchedulerConfig`` and ``FrontendConfig``,
and, for what fills none of them, ``nanoserve.launch``'s ``Sockets`` and ``Running``. A field is
an option when its ``metadata`` has a ``help`` line; the other keys are optional:

- ``flag``: where it is not ``--`` and the field's name with dashes;
- ``processes``: the processes that take it (default: the config's own);
- ``choices``; ``parse``: a name in ``option_values.PARSERS``, where the type does not say;
- ``shown``: the default as users should read it, where the value does not say (None, ``()``);
- ``off``: more spellings that turn a switch off; ``serve``: False keeps it out of ``serve``.

From there come the flag, its default, its ``--help`` line, its environment variable
(NANOSERVE_ and the flag's name in capitals) and its row in the README's table (``nanoserve
options-table``). A boolean is a switch, ``--x`` / ``--no-x``. A flag on the command line wins
over the environment (honcho reads .env into it, so the Procfile stays short), and that over
the declared default. ``nanoserve serve`` takes every option and hands them to the processes it
starts as NANOSERVE_* variables (``child_environment``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import types
import typing
from dataclasses import dataclass
from typing import Any

from nanoserve.option_values import PARSERS, as_text, show

ROLES = ("scheduler", "worker", "frontend")
_METAVARS = {int: "N", float: "X", str: "TEXT", "bytes": "SIZE", "ranks": "RANKS"}
_KEYS = {"help", "flag", "processes", "choices", "parse", "shown", "off", "serve"}


class FromEnv(str):
    """A value read from the environment: argparse converts it as it converts a flag's text
    (a string default goes through ``type``), and an error names the variable."""


@dataclass(frozen=True)
class Option:
    """One option: the config field it fills, its default, how it is spelled and read."""

    owner: type  # the config dataclass
    name: str  # the field
    default: Any
    kind: type  # bool, int, float or str (a ``parse`` may make a tuple of it)
    help: str
    processes: tuple[str, ...]
    group: str  # its section of --help
    flag: str
    choices: tuple[str, ...] | None = None
    parse: str | None = None
    shown: str | None = None
    off: tuple[str, ...] = ()
    serve: bool = True

    @property
    def dest(self) -> str:
        """The attribute on the parsed namespace."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        """The environment variable that sets it."""
        return "NANOSERVE_" + self.dest.upper()

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every flag that sets it: a switch's ``--no-`` form and ``off`` spellings too."""
        if self.kind is bool:
            return (self.flag, "--no-" + self.flag.removeprefix("--"), *self.off)
        return (self.flag,)

    @property
    def default_text(self) -> str:
        """The default as ``--help`` and the README show it."""
        return self.shown if self.shown is not None else show(self.default)

    def convert(self, text: str) -> Any:
        """The value of ``text``, a flag's or (``FromEnv``) a variable's; ArgumentTypeError
        with what is wrong, which argparse prints as one line after the flag."""
        try:
            value = PARSERS[self.parse or self.kind.__name__](text)
            if self.choices is not None and value not in self.choices:
                raise ValueError(f"not one of {', '.join(self.choices)}")
        except ValueError as exc:
            where = f"{self.env}={text!r}" if isinstance(text, FromEnv) else repr(text)
            raise argparse.ArgumentTypeError(f"{where}: {exc}") from None
        return value


def _field_options(cls: type, processes: tuple[str, ...], group: str) -> list[Option]:
    """The options declared on the fields of the config dataclass ``cls``; TypeError for a
    declaration that says too little or something this module does not read."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        metadata = dict(field.metadata)
        if "help" not in metadata:
            continue
        where = f"option {cls.__name__}.{field.name}"
        if set(metadata) - _KEYS:
            raise TypeError(f"{where}: unknown metadata {sorted(set(metadata) - _KEYS)}")
        if field.default is dataclasses.MISSING:
            raise TypeError(f"{where}: needs a plain default")
        kind = _kind(hints[field.name])
        if metadata.get("parse", kind.__name__) not in PARSERS:
            raise TypeError(f"{where}: give a 'parse' for {hints[field.name]}")
        if field.default in (None, ()) and "shown" not in metadata:
            raise TypeError(f"{where}: say what a default of {field.default!r} means ('shown')")
        metadata.setdefault("flag", "--" + field.name.replace("_", "-"))
        metadata["processes"] = tuple(metadata.get("processes", processes))
        found.append(Option(cls, field.name, field.default, kind, group=group, **metadata))
    return found


def _kind(hint: Any) -> type:
    """``int`` for ``int | None``, ``tuple`` for ``tuple[int, ...]``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(k for k in typing.get_args(hint) if k is not type(None))
    return typing.get_origin(hint) or hint


@functools.cache
def all_options() -> tuple[Option, ...]:
    """Every option, in the README's order; ValueError if two share a flag."""
    from frontend.config import FrontendConfig
    from nanoserve.fleet import Fleet
    from nanoserve.launch import Running, Sockets
    from scheduler.config import SchedulerConfig
    from worker.config import WorkerConfig
    from worker.parallel.config import ParallelConfig

    found = [
        *_field_options(Sockets, ROLES, "sockets"),
        *_field_options(WorkerConfig, ("worker",), "worker"),
        *_field_options(ParallelConfig, ("worker",), "tensor parallelism"),
        *_field_options(SchedulerConfig, ("scheduler",), "scheduler"),
        *_field_options(FrontendConfig, ("frontend",), "frontend"),
        *_field_options(Running, ROLES, "process"),
        *_field_options(Fleet, ("serve",), "replicas"),
    ]
    return _unique(found)


def _unique(options: list[Option]) -> tuple[Option, ...]:
    """``options``, or ValueError naming a flag that two of them spell."""
    seen: set[str] = set()
    for spelling in (s for o in options for s in o.spellings):
        if spelling in seen:
            raise ValueError(f"two options share {spelling}")
        seen.add(spelling)
    return tuple(options)


def options_for(command: str) -> list[Option]:
    """The options of one process command (``serve``: those of every process it starts)."""
    if command == "serve":
        return [o for o in all_options() if o.serve]
    return [o for o in all_options() if command in o.processes]


def option(dest: str) -> Option:
    """The option whose value lands in ``args.<dest>``."""
    return next(o for o in all_options() if o.dest == dest)


class Switch(argparse.Action):
    """``--x`` turns it on; ``--no-x`` and any ``off`` spelling turn it off."""

    def __init__(self, option_strings: list[str], dest: str, off: tuple[str, ...] = (), **kw):
        self.off = ("--no-" + option_strings[0].removeprefix("--"), *off)
        super().__init__([*option_strings, *self.off], dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string not in self.off)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def add_options(parser: argparse.ArgumentParser, options: list[Option]) -> None:
    """Add ``options`` to ``parser`` in --help sections, each defaulting to its environment
    variable where that is set and not empty, else to its declared default."""
    groups: dict[str, Any] = {}
    for o in options:
        if o.group not in groups:
            groups[o.group] = parser.add_argument_group(o.group)
        raw = os.environ.get(o.env)
        default = FromEnv(raw) if raw else o.default
        # argparse formats help with %: a literal one is doubled.
        text = f"{o.help} (default: {o.default_text}; {o.env})".replace("%", "%%")
        common: dict[str, Any] = dict(dest=o.dest, default=default, type=o.convert, help=text)
        if o.kind is bool:
            groups[o.group].add_argument(o.flag, action=Switch, off=o.off, **common)
        else:
            metavar = "{" + ",".join(o.choices) + "}" if o.choices else _METAVARS[o.parse or o.kind]
            groups[o.group].add_argument(o.flag, choices=o.choices, metavar=metavar, **common)


def config_from(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """An instance of the config dataclass ``cls``: the parsed values of its options that the
    command takes (the others keep their defaults), plus ``given`` for fields that other options
    fill. ValueError from its ``__post_init__``."""
    mine = [o for o in all_options() if o.owner is cls and hasattr(args, o.dest)]
    values = {o.name: getattr(args, o.dest) for o in mine}
    return cls(**values, **given)


def child_environment(args: argparse.Namespace) -> dict[str, str]:
    """This process's environment plus the variable of every option in ``args`` that has a
    value, so a process started with it parses the same values without flags."""
    environment = dict(os.environ)
    for o in all_options():
        value = getattr(args, o.dest, None)
        if value is not None:
            environment[o.env] = as_text(value)
    return environment
