"""Bad input on the command line: one line on stderr that names the problem, a non-zero exit,
no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.files import cache_root
from tests.tiny_model import make_tiny_llama


def _nanoserve(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "nanoserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _assert_one_line_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_missing_model_path():
    _assert_one_line_error(_nanoserve("worker", "--model", "/no/such/model"), "/no/such/model")


def test_unsupported_architecture(tmp_path, tiny):
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (odd / "config.json").write_text(json.dumps(config))
    (odd / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    _assert_one_line_error(_nanoserve("worker", "--model", str(odd)), "gpt2")


def test_kv_budget_too_small_for_one_request(tiny, tmp_path):
    # A private cache, but the CPU kernels shared as tests/worker/conftest.py shares them: the
    # worker builds them before it sizes the pool, a minute on two cores.
    shared = cache_root() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(shared, target_is_directory=True)
    done = _nanoserve(
        "worker",
        "--model",
        str(tiny),
        "--kv-cache-memory",
        "4KiB",
        "--max-model-len",
        "512",
        env_extra={"NANOSERVE_CACHE_DIR": str(tmp_path)},
    )
    _assert_one_line_error(done, "max_model_len=512")


def test_generate_without_a_prompts_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    _assert_one_line_error(_nanoserve("generate", "--prompts-file", str(missing)), "nope.jsonl")


def test_negative_q4_max_tokens():
    _assert_one_line_error(_nanoserve("worker", "--q4-max-tokens", "-1"), "q4_max_tokens", "-1")
    _assert_one_line_error(
        _nanoserve("bench", "forward", "--q4-max-tokens", "-1"), "--q4-max-tokens"
    )


def test_a_bad_variable_names_itself():
    done = _nanoserve("scheduler", env_extra={"NANOSERVE_TOKEN_BUDGET": "lots"})
    _assert_one_line_error(done, "--token-budget", "NANOSERVE_TOKEN_BUDGET='lots'", "integer")
    done = _nanoserve("frontend", env_extra={"NANOSERVE_PIN_CPU": "maybe"})
    _assert_one_line_error(done, "NANOSERVE_PIN_CPU='maybe'", "not a switch")


def test_a_bad_flag_value_is_one_line():
    _assert_one_line_error(_nanoserve("frontend", "--port", "http"), "--port", "'http'")
    _assert_one_line_error(_nanoserve("worker", "--kv-cache-memory", "lots"), "not a size")
