"""Load a checkpoint (Hugging Face directory or GGUF file) into a name -> tensor dict.

A GGUF file is dequantized once and written, with its config, as a Hugging Face directory under
the user's cache directory, keyed by the file's content (its SHA-256); later starts read that
directory, which takes about a second instead of ten. The ranks of a tensor-parallel worker
share it: the first to arrive converts under a file lock, the others wait and read it. Each rank
reads only its ``Shard`` of every tensor.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.files import ModelFiles, cache_root
from worker.model.gguf import Q4Tensor, check_gguf, read_gguf_tensors, read_q4_tensors
from worker.parallel.sharding import Shard

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class Checkpoint:
    """A model's config and weights, in Hugging Face names, in the requested dtype."""

    config: Any  # transformers.PretrainedConfig
    weights: dict[str, torch.Tensor]
    eos_token_ids: list[int]


def load_checkpoint(
    files: ModelFiles,
    dtype: torch.dtype,
    progress: bool = True,
    shard_of: Callable[[Any], Shard] | None = None,
) -> Checkpoint:
    """Read config and weights, converting (and caching) a GGUF file first. ValueError on bad
    input: a missing path, an unsupported architecture or an undequantizable tensor type.
    ``shard_of(config)`` names the part of every tensor to read (default: all of it); it is
    asked before any weight is read, so a size that does not fit fails at once."""
    if not files.source.exists():
        raise ValueError(f"model path does not exist: {files.source}")
    directory = files.directory if files.gguf_file is None else gguf_to_hf_dir(files, progress)
    config = _load_config(directory)
    shard = None if shard_of is None else shard_of(config)
    weights = _read_safetensors(directory, dtype, progress, shard)
    return Checkpoint(config=config, weights=weights, eos_token_ids=_eos_ids(directory, config))


def load_config(files: ModelFiles, progress: bool = True) -> Any:
    """The model's transformers config alone (converting a GGUF file first, once)."""
    if not files.source.exists():
        raise ValueError(f"model path does not exist: {files.source}")
    return _load_config(
        files.directory if files.gguf_file is None else gguf_to_hf_dir(files, progress)
    )


def gguf_to_hf_dir(files: ModelFiles, progress: bool = True) -> Path:
    """The cached Hugging Face directory for a GGUF file, converting it on first use."""
    source = files.source.resolve()
    stat = source.stat()
    key = _content_key(source, stat.st_size, stat.st_mtime_ns)
    target = cache_root() / "gguf" / f"{source.stem}-{key[:16]}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank (or server) may be converting it now
        if not (target / "model.safetensors").is_file():
            _convert_gguf(files, source, target, progress)
    return target


@functools.lru_cache(maxsize=8)
def _content_key(source: Path, size: int, mtime_ns: int) -> str:
    """The file's SHA-256 (once a process for a given path, size and mtime): the same GGUF
    installed again, in another clone's venv or by another wheel install, finds its conversion
    (hashing the default 98 MB file takes 0.24 s here; converting it again took 74 s)."""
    with open(source, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _convert_gguf(files: ModelFiles, source: Path, target: Path, progress: bool) -> None:
    """Dequantize ``source`` into the Hugging Face directory ``target``."""
    architecture = check_gguf(source)
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(files.directory, gguf_file=files.gguf_file)
    tensors = read_gguf_tensors(
        source, architecture, config.num_attention_heads, config.num_key_value_heads
    )
    weights: dict[str, torch.Tensor] = {}
    with tqdm(desc=f"dequantizing {source.name}", unit="tensor", disable=not progress) as bar:
        for name, tensor, total in tensors:
            bar.total = total
            weights[name] = tensor
            bar.update()
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(staging)
    save_file(weights, str(staging / "model.safetensors"))
    # Rename last, so a crash mid-write never leaves a half-written cache entry behind.
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def load_q4(files: ModelFiles, model_type: str, n_heads: int, n_kv_heads: int):
    """A GGUF's 4-bit matrices (``read_q4_tensors``), cached beside its converted directory:
    reading them from the GGUF means parsing its whole metadata (mostly the tokenizer's
    vocabulary), where the cached copy only maps its tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    # v2: Q8_0 matrices too (as 4-bit halves); a cache written before them is read afresh.
    path = gguf_to_hf_dir(files, progress=False) / "q4" / "weights-v2.safetensors"
    if not path.is_file():
        tensors = read_q4_tensors(files.source.resolve(), model_type, n_heads, n_kv_heads)
        flat = {}
        for name, q4 in tensors.items():
            flat[f"{name}.q"] = q4.q  # uint8, values 0..15
            flat[f"{name}.scale"], flat[f"{name}.zero"] = q4.scale, q4.zero
        path.parent.mkdir(exist_ok=True)
        staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
        save_file(flat, str(staging))
        staging.replace(path)  # atomic: a crash never leaves a half-written file behind
    with safe_open(str(path), framework="pt") as handle:
        names = {key.rpartition(".")[0] for key in handle.keys()}
        return {
            name: Q4Tensor(
                handle.get_tensor(f"{name}.q"),
                handle.get_tensor(f"{name}.scale"),
                handle.get_tensor(f"{name}.zero"),
            )
            for name in names
        }


def _load_config(directory: Path) -> Any:
    from transformers import AutoConfig

    raw = json.loads((directory / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"unsupported architecture {model_type!r} (supported: {supported})")
    return AutoConfig.from_pretrained(directory)


def _read_safetensors(
    directory: Path, dtype: torch.dtype, progress: bool, shard: Shard | None
) -> dict:
    from safetensors import safe_open
    from tqdm import tqdm

    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise ValueError(f"no *.safetensors files in {directory}")
    weights: dict[str, torch.Tensor] = {}
    with tqdm(desc=f"loading {directory.name}", unit="tensor", disable=not progress) as bar:
        for path in paths:
            with safe_open(str(path), framework="pt") as handle:
                names = list(handle.keys())
                bar.total = (bar.total or 0) + len(names)
                for name in names:
                    if shard is None:
                        weights[name] = handle.get_tensor(name).to(dtype)
                    else:
                        weights[name] = shard.read(handle, name, dtype)
                    bar.update()
    return weights


def _eos_ids(directory: Path, config: Any) -> list[int]:
    """EOS ids from config.json and generation_config.json, in that order, deduplicated."""
    found: list[int] = []
    sources: list[Any] = [config.eos_token_id]
    generation = directory / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in found:
                found.append(token)
    return found
