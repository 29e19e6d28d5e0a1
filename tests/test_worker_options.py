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
        ([], {}, None),  # on where it pays, the worker decides
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


def test_w4a8_flag_and_variable(monkeypatch):
    monkeypatch.delenv("NANOSERVE_W4A8", raising=False)
    assert _config(monkeypatch, [], {}).w4a8 is True
    assert _config(monkeypatch, ["--no-w4a8"], {}).w4a8 is False
    assert _config(monkeypatch, [], {"NANOSERVE_W4A8": "0"}).w4a8 is False
    assert _config(monkeypatch, ["--w4a8"], {"NANOSERVE_W4A8": "0"}).w4a8 is True


@pytest.mark.parametrize(
    "argv,env,expected",
    [
        ([], {}, False),
        (["--generic-path"], {}, True),
        ([], {"NANOSERVE_GENERIC_PATH": "1"}, True),
        (["--no-generic-path"], {"NANOSERVE_GENERIC_PATH": "1"}, False),
    ],
)
def test_generic_path_flag_and_variable(monkeypatch, argv, env, expected):
    monkeypatch.delenv("NANOSERVE_GENERIC_PATH", raising=False)
    assert _config(monkeypatch, argv, env).generic_path is expected


def test_generic_path_does_not_compile(monkeypatch):
    monkeypatch.delenv("NANOSERVE_GENERIC_PATH", raising=False)
    monkeypatch.delenv("NANOSERVE_COMPILE", raising=False)
    with pytest.raises(ValueError, match="CUDA does not compile"):
        _config(monkeypatch, ["--generic-path", "--compile"], {})


def test_serve_passes_the_generic_path_to_its_worker(monkeypatch):
    from nanoserve.commands.serve import child_environment

    monkeypatch.delenv("NANOSERVE_GENERIC_PATH", raising=False)
    args = build_parser().parse_args(["serve", "--generic-path"])
    assert child_environment(args)["NANOSERVE_GENERIC_PATH"] == "1"
    # Switches travel as 1 or 0, so one that defaults to on can be turned off.
    assert child_environment(build_parser().parse_args(["serve"]))["NANOSERVE_GENERIC_PATH"] == "0"


def test_dtype_defaults_to_auto(monkeypatch):
    monkeypatch.delenv("NANOSERVE_DTYPE", raising=False)
    assert _config(monkeypatch, [], {}).dtype == "auto"
    assert _config(monkeypatch, [], {"NANOSERVE_DTYPE": "float32"}).dtype == "float32"
    assert _config(monkeypatch, ["--dtype", "bfloat16"], {}).dtype == "bfloat16"


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({"avx512f", "avx512_bf16"}, "bfloat16"),
        ({"amx_tile", "amx_bf16"}, "bfloat16"),
        ({"avx512f", "avx2"}, "float32"),
        (set(), "float32"),
    ],
)
def test_auto_dtype_is_bfloat16_where_the_cpu_computes_it(monkeypatch, flags, expected):
    from worker.config import WorkerConfig
    from worker.cpu import kernels
    from worker.plan import resolve_dtype

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype(WorkerConfig(device="cpu"), "cpu") == expected
    assert resolve_dtype(WorkerConfig(device="cpu", dtype="float32"), "cpu") == "float32"
