"""The worker's flags and NANOSERVE_* variables reach its WorkerConfig (the CLI's own parser)."""

from __future__ import annotations

import pytest

from nanoserve.cli import build_parser
from nanoserve.commands.worker import worker_config


def _config(monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str]):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # Built afresh each time: the flags' defaults read the environment when the parser is built.
    return worker_config(build_parser().parse_args(["worker", *argv]))


@pytest.mark.parametrize(
    "argv,env,expected",
    [
        ([], {}, False),
        (["--compile"], {}, True),
        ([], {"NANOSERVE_COMPILE": "1"}, True),
        (["--no-compile"], {"NANOSERVE_COMPILE": "1"}, False),
    ],
)
def test_compile_flag_and_variable(monkeypatch, argv, env, expected):
    monkeypatch.delenv("NANOSERVE_COMPILE", raising=False)
    assert _config(monkeypatch, argv, env).compile is expected


def test_q4_max_tokens_flag_and_variable(monkeypatch):
    monkeypatch.delenv("NANOSERVE_Q4_MAX_TOKENS", raising=False)
    assert _config(monkeypatch, [], {}).q4_max_tokens == 8
    assert _config(monkeypatch, ["--q4-max-tokens", "2"], {}).q4_max_tokens == 2
    assert _config(monkeypatch, [], {"NANOSERVE_Q4_MAX_TOKENS": "0"}).q4_max_tokens == 0
