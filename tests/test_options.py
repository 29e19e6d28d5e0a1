"""Each option is declared once (nanoserve/options.py): the README's configuration table, the
process commands' parsers and their NANOSERVE_* variables agree, and what ``serve`` passes on
reaches its processes."""

from __future__ import annotations

import argparse
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

from nanoserve.cli import build_parser
from nanoserve.commands.options_table import HEADING, replace_table, table
from nanoserve.option_values import show
from nanoserve.options import (
    ROLES,
    _field_options,
    _unique,
    all_options,
    child_environment,
    option,
)

README = Path(__file__).resolve().parents[1] / "README.md"
COMMANDS = (*ROLES, "serve")


@contextmanager
def _environment(variables: dict[str, str] | None = None):
    """os.environ without any NANOSERVE_* variable but ``variables``, restored afterwards."""
    with mock.patch.dict(os.environ):
        for name in [n for n in os.environ if n.startswith("NANOSERVE_")]:
            del os.environ[name]
        os.environ.update(variables or {})
        yield


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """The process commands' parsers, built now (their defaults read the environment)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in COMMANDS}


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"
    }


def _rows(text: str) -> dict[str, dict]:
    """The table under the README's configuration heading, by each row's first flag."""
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue  # prose, the header, its rule
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        flags, env, default, process, meaning = cells
        spellings = tuple(re.findall(r"`(--[\w-]+)`", flags))
        rows[spellings[0]] = {
            "spellings": spellings,
            "env": env.strip("`"),
            "default": default,
            "processes": set(ROLES) if process == "all" else set(process.split(", ")),
            "meaning": meaning,
        }
    return rows


def _sample(dest: str) -> str:
    """A valid value for the option, other than its default, as a variable spells it."""
    o = option(dest)
    if o.kind is bool:
        return "0" if o.default else "1"
    if o.choices:
        return next(c for c in reversed(o.choices) if c != o.default)
    return {"bytes": "3KiB", "ranks": "0", "int": "7", "float": "7.5"}.get(
        o.parse or o.kind.__name__, "x7"
    )


def disagreements(text: str) -> list[str]:
    """Where the README ``text``'s table and the process commands' parsers disagree: a flag
    one has and the other lacks, its spellings, processes, default, variable or meaning."""
    problems = []
    rows = _rows(text)
    with _environment():
        parsers = {name: _flags(parser) for name, parser in _parsers().items()}
        defaults = {name: vars(p.parse_args([])) for name, p in _parsers().items()}
    every = {flag: a for flags in parsers.values() for flag, a in flags.items()}
    samples = {row["env"]: _sample(every[f].dest) for f, row in rows.items() if f in every}
    with _environment(samples):  # each variable the README names must set its option
        from_env = {name: vars(p.parse_args([])) for name, p in _parsers().items()}
    for flag in dict.fromkeys(f for flags in parsers.values() for f in flags if f not in rows):
        commands = ", ".join(name for name in COMMANDS if flag in parsers[name])
        problems.append(f"{flag}: in `nanoserve {commands}`, not in the README table")
    for flag, row in rows.items():
        where = {name for name in ROLES if flag in parsers[name]} or {"serve"}  # serve's own
        command = next((name for name in COMMANDS if flag in parsers[name]), None)
        if command is None:
            problems.append(f"{flag}: in the README table, in no parser")
            continue
        action = parsers[command][flag]
        help_default, help_env = re.search(r"\(default: (.*); (\w+)\)$", action.help).groups()
        value, sample = defaults[command][action.dest], samples.get(row["env"])
        if set(row["spellings"]) != set(action.option_strings):
            problems.append(
                f"{flag}: README spells {row['spellings']}, the parser {action.option_strings}"
            )
        if row["processes"] != where:
            problems.append(
                f"{flag}: README says {sorted(row['processes'])}, parsers {sorted(where)}"
            )
        if row["default"] != help_default.replace("%%", "%"):
            problems.append(f"{flag}: README default {row['default']!r}, --help {help_default!r}")
        if value not in (None, ()) and row["default"] != show(value):
            problems.append(f"{flag}: README default {row['default']!r}, parsed {show(value)!r}")
        if row["env"] != help_env or from_env[command][action.dest] != action.type(sample):
            problems.append(f"{flag}: README's {row['env']} does not set it ({help_env} does)")
        if not action.help.replace("%%", "%").startswith(row["meaning"] + " (default:"):
            problems.append(f"{flag}: README meaning {row['meaning']!r}, --help {action.help!r}")
    return problems


def test_the_readme_table_agrees_with_the_parsers():
    assert disagreements(README.read_text()) == []


def test_the_readme_table_is_the_generated_one():
    text = README.read_text()
    assert replace_table(text, table()) == text, "run: nanoserve options-table --write README.md"


def _row_of(text: str, flag: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| `{flag}`"))


def _edit_row(flag: str, old: str, new: str):
    def edit(text: str) -> str:
        row = _row_of(text, flag)
        assert old in row
        return text.replace(row, row.replace(old, new, 1))

    return edit


@pytest.mark.parametrize(
    "corrupt,expected",
    [
        (
            _edit_row("--token-budget", "| 2048 |", "| 512 |"),
            "--token-budget: README default '512'",
        ),
        (
            _edit_row("--token-budget", "NANOSERVE_TOKEN_BUDGET", "NANOSERVE_BUDGET"),
            "--token-budget: README's NANOSERVE_BUDGET does not set it",
        ),
        (
            lambda t: t.replace(_row_of(t, "--seed") + "\n", ""),
            "--seed: in `nanoserve worker, serve`, not",
        ),
        (
            lambda t: t.replace(
                _row_of(t, "--seed"),
                _row_of(t, "--seed") + "\n| `--turbo` | `NANOSERVE_TURBO` "
                "| off | worker | go faster |",
            ),
            "--turbo: in the README table, in no parser",
        ),
        (_edit_row("--pin-cpu", "scheduler, frontend", "scheduler"), "--pin-cpu: README says"),
        (_edit_row("--overlap", " / `--disable-overlap`", ""), "--overlap: README spells"),
        (_edit_row("--max-n", "the most choices", "the choices"), "--max-n: README meaning"),
        (_edit_row("--model", "worker, frontend", "all"), "--model: README says"),
    ],
)
def test_a_wrong_row_is_found(corrupt, expected):
    problems = disagreements(corrupt(README.read_text()))
    flag = expected.split(":")[0]
    assert problems and all(p.startswith(flag + ":") for p in problems), problems
    assert any(p.startswith(expected) for p in problems), problems


def test_token_budget_has_one_default():
    from scheduler.config import SchedulerConfig

    with _environment():
        parsers = _parsers()
        parsed = {c: parsers[c].parse_args([]).token_budget for c in ("scheduler", "serve")}
    assert parsed == {"scheduler": 2048, "serve": 2048}
    assert SchedulerConfig().token_budget == 2048


def _parse(command: str, argv: list[str], variables: dict[str, str] | None = None):
    with _environment(variables):
        return _parsers()[command].parse_args(argv)


def test_a_flag_wins_over_its_variable_and_that_over_the_default():
    assert _parse("worker", []).block_size == 16
    assert _parse("worker", [], {"NANOSERVE_BLOCK_SIZE": "32"}).block_size == 32
    assert _parse("worker", ["--block-size", "8"], {"NANOSERVE_BLOCK_SIZE": "32"}).block_size == 8
    assert _parse("frontend", [], {"NANOSERVE_MAX_N": "4"}).max_n == 4  # frontend ones too
    assert _parse("worker", [], {"NANOSERVE_BLOCK_SIZE": ""}).block_size == 16  # empty: unset


@pytest.mark.parametrize(
    "argv,variables,expected",
    [
        ([], {}, True),
        (["--disable-overlap"], {}, False),  # the old spelling
        (["--no-overlap"], {}, False),
        ([], {"NANOSERVE_OVERLAP": "off"}, False),
        (["--overlap"], {"NANOSERVE_OVERLAP": "0"}, True),
    ],
)
def test_switches_take_both_spellings(argv, variables, expected):
    assert _parse("scheduler", argv, variables).overlap is expected


def test_audit_and_prefix_caching_keep_their_spellings():
    assert _parse("scheduler", ["--audit"]).audit is True
    assert _parse("scheduler", ["--no-audit"], {"NANOSERVE_AUDIT": "1"}).audit is False
    caching = _parse("scheduler", ["--no-enable-prefix-caching"]).enable_prefix_caching
    assert caching is False
    assert _parse("worker", ["--threads", "3"]).threads == 3


def test_serve_hands_its_values_to_every_process():
    argv = ["--threads", "3", "--no-audit", "--disable-overlap", "--tp-ranks", "0-1"]
    argv += ["--tensor-parallel-size", "2", "--kv-cache-memory", "1MiB", "--max-n", "5"]
    argv += ["--api-key", "k", "--worker-timeout", "9", "--no-pin-cpu"]
    served = _parse("serve", argv)
    with _environment():
        variables = child_environment(served)
    given = {k: v for k, v in variables.items() if k.startswith("NANOSERVE_")}
    for role in ROLES:
        args = _parse(role, [], given)
        for dest, value in vars(args).items():
            if dest != "func" and dest in served:
                assert value == getattr(served, dest), (role, dest)
    assert served.kv_cache_memory == 2**20 and served.tp_ranks == (0, 1)
    assert served.overlap is False and given["NANOSERVE_OVERLAP"] == "0"


def test_serve_takes_every_option_but_another_schedulers_addresses():
    with _environment():
        parsers = {name: set(_flags(p)) for name, p in _parsers().items()}
    union = parsers["worker"] | parsers["scheduler"] | parsers["frontend"]
    fleet = {"--replicas", "--router", "--router-port", "--router-policy"}  # serve's own
    assert parsers["serve"] == (union - {"--frontend-address", "--monitor-address"}) | fleet


def test_a_bad_variable_is_an_error_that_names_it(capsys):
    with pytest.raises(SystemExit) as exited:
        _parse("scheduler", [], {"NANOSERVE_TOKEN_BUDGET": "lots"})
    assert exited.value.code == 2
    assert "NANOSERVE_TOKEN_BUDGET='lots': not an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("scheduler", [], {"NANOSERVE_AUDIT": "maybe"})
    assert "NANOSERVE_AUDIT='maybe': not a switch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("worker", ["--dtype", "float64"])
    assert "'float64': not one of auto, float32, bfloat16" in capsys.readouterr().err


def test_each_declaration_check_fires():
    @dataclass(frozen=True)
    class Odd:
        a: int = field(default=1, metadata={"help": "a", "flga": "--b"})

    @dataclass(frozen=True)
    class Unsaid:
        a: int | None = field(default=None, metadata={"help": "a"})

    @dataclass(frozen=True)
    class Unread:
        a: tuple[int, ...] = field(default=(), metadata={"help": "a", "shown": "none"})

    @dataclass(frozen=True)
    class Factory:
        a: list = field(default_factory=list, metadata={"help": "a"})

    for cls, message in [
        (Odd, "unknown metadata ['flga']"),
        (Unsaid, "say what a default of None means"),
        (Unread, "give a 'parse' for tuple"),
        (Factory, "needs a plain default"),
    ]:
        with pytest.raises(TypeError, match=re.escape(message)):
            _field_options(cls, ("worker",), "worker")

    @dataclass(frozen=True)
    class Twice:
        overlap: bool = field(default=True, metadata={"help": "a", "off": ("--x",)})
        x: int = field(default=1, metadata={"help": "b"})

    with pytest.raises(ValueError, match="two options share --x"):
        _unique(_field_options(Twice, ("worker",), "worker"))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--token-budget", "0"], "token_budget must be >= 1, got 0"),
        (["--tensor-parallel-size", "2", "--tp-ranks", "3"], "tensor parallel ranks [3]"),
        (["--api-key", ""], "api_key must not be empty"),
        (["--worker-timeout", "0"], "worker_timeout must be > 0"),
    ],
)
def test_serve_refuses_a_bad_value_before_it_starts_anything(monkeypatch, capsys, argv, message):
    from nanoserve.cli import main
    from nanoserve.commands import serve

    def start(*args, **kwargs):
        raise AssertionError("serve started a process")

    monkeypatch.setattr(serve.subprocess, "Popen", start)
    with _environment():
        assert main(["serve", "--run-id", f"opts-{os.getpid()}", *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("nanoserve serve: error: ") and message in line, line


def test_every_variable_in_dotenv_is_an_option_each_process_reads():
    lines = (README.parent / ".env").read_text().splitlines()
    variables = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    known = {o.env: o for o in all_options()}
    assert set(variables) <= set(known), set(variables) - set(known)
    for role in ROLES:  # honcho gives every process all of them
        args = _parse(role, [], variables)
        for name, text in variables.items():
            if role in known[name].processes:
                assert getattr(args, known[name].dest) == known[name].convert(text), name
