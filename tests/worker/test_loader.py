"""Loading: bad input gives one-line ValueErrors; the cache budget and config are checked."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.files import ModelFiles
from tests.worker.conftest import make_worker
from worker.config import WorkerConfig
from worker.model.loader import load_checkpoint


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def write_gguf(path, architecture: str, tensor: np.ndarray, raw_dtype=None):
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_norm.weight", tensor, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelFiles(model_id="x", directory=path.parent, gguf_file=path.name)


def test_missing_path(tmp_path):
    files = ModelFiles(model_id="x", directory=tmp_path / "nope")
    with pytest.raises(ValueError) as excinfo:
        load_checkpoint(files, torch.float32, progress=False)
    assert "does not exist" in one_line(excinfo)


def test_missing_model_name():
    with pytest.raises(ValueError) as excinfo:
        make_worker("/no/such/model.gguf")
    assert "not found" in one_line(excinfo)


def test_unsupported_architecture_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError) as excinfo:
        load_checkpoint(ModelFiles("x", tmp_path), torch.float32, progress=False)
    assert "'gpt2'" in one_line(excinfo)


def test_unsupported_architecture_gguf(tmp_path):
    files = write_gguf(tmp_path / "m.gguf", "gpt2", np.ones(4, dtype=np.float32))
    with pytest.raises(ValueError) as excinfo:
        load_checkpoint(files, torch.float32, progress=False)
    assert "'gpt2'" in one_line(excinfo)


def test_undequantizable_gguf_tensor(tmp_path):
    files = write_gguf(tmp_path / "m.gguf", "llama", np.ones(4, dtype=np.int8))
    with pytest.raises(ValueError) as excinfo:
        load_checkpoint(files, torch.float32, progress=False)
    assert "blk.0.attn_norm.weight has type I8" in one_line(excinfo)


def test_kv_budget_too_small(tiny_dir):
    with pytest.raises(ValueError) as excinfo:
        make_worker(tiny_dir, num_blocks=None, kv_cache_memory=10_000, max_model_len=512)
    assert "max_model_len=512" in one_line(excinfo)


def test_budget_sizes_the_pool(tiny_dir):
    # tiny: 2 layers * K,V * 4 tokens * 2 kv heads * 16 dims * 4 bytes = 2048 bytes a block
    worker = make_worker(tiny_dir, num_blocks=None, kv_cache_memory=300 * 2048, max_model_len=64)
    assert worker.ready().num_blocks == 300
    assert worker.ready().max_model_len == 64


@pytest.mark.parametrize(
    "bad",
    [
        dict(dtype="float16"),
        dict(device="tpu"),
        dict(block_size=0),
        dict(num_blocks=-1),
        dict(num_slots=0),
        dict(seed=-1),
    ],
)
def test_config_validation(bad):
    with pytest.raises(ValueError):
        WorkerConfig(**bad)


def test_ready_reports_geometry(tiny_dir):
    ready = make_worker(tiny_dir).ready()
    assert (ready.block_size, ready.num_blocks, ready.num_slots) == (4, 256, 8)
    assert (ready.vocab_size, ready.eos_token_ids, ready.max_model_len) == (256, [2], 512)
    assert (ready.device, ready.dtype) == ("cpu", "float32")


def test_a_gguf_conversion_is_found_again_by_content(tmp_path, monkeypatch):
    """The same file at another path (another clone's venv) reuses its conversion; other bytes
    do not."""
    import os

    from worker.model import loader

    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    converted = []

    def convert(files, source, target, progress):  # the real one dequantizes a whole model
        converted.append(source)
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    tensors = np.ones(4, dtype=np.float32), np.full(4, 2.0, dtype=np.float32)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    first = write_gguf(tmp_path / "a" / "m.gguf", "llama", tensors[0])
    again = write_gguf(tmp_path / "b" / "m.gguf", "llama", tensors[0])
    other = write_gguf(tmp_path / "c" / "m.gguf", "llama", tensors[1])
    os.utime(again.source, ns=(1, 1))  # another install's time stamps too
    home = loader.gguf_to_hf_dir(first, progress=False)
    assert loader.gguf_to_hf_dir(again, progress=False) == home
    assert loader.gguf_to_hf_dir(other, progress=False) != home
    assert converted == [first.source.resolve(), other.source.resolve()]
