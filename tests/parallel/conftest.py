"""Fixtures for the tensor-parallel tests: the seeded tiny Llama, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads and 2 KV heads: sizes 2 (KV heads split) and 4 (KV heads replicated)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-tp"))
