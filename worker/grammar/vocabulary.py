"""``tokenizer_json``: the model's tokenizer as the JSON text llguidance reads.

A Hugging Face directory has it (``tokenizer.json``). A GGUF file's tokenizer is rebuilt from
its metadata by ``models.tokenizer``, which reads the whole header in Python (4 s for the
default model here, holding the GIL beside the worker's own start), so its JSON is kept under
the cache directory, keyed like the file's converted weights (by its content); later starts read
it in milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.files import ModelFiles, cache_root
from models.tokenizer import load_tokenizer


def tokenizer_json(files: ModelFiles) -> str:
    """The tokenizer of ``files`` as Hugging Face tokenizer JSON."""
    if files.gguf_file is None:
        return load_tokenizer(files).tokenizer.to_str()
    cached = _cached_path(files)
    if cached.is_file():
        return cached.read_text()
    text = load_tokenizer(files).tokenizer.to_str()
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    staging.write_text(text)
    staging.replace(cached)  # whole or absent: another worker may read it at any moment
    return text


def _cached_path(files: ModelFiles) -> Path:
    """Where a GGUF file's tokenizer JSON is kept: named after its converted weights'
    directory, which names the file and its content's digest."""
    from worker.model.loader import gguf_to_hf_dir  # converted already: a lookup

    converted = gguf_to_hf_dir(files, progress=False)
    return cache_root() / "tokenizers" / f"{converted.name}.json"
