"""Dequantize a llama.cpp GGUF file into Hugging Face tensor names and layout.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of Llama models so that its
rotary embedding can rotate adjacent pairs; Hugging Face rotates halves. We undo that here, so
the cached weights are exactly what ``transformers`` would build from the same file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

# GGUF tensor name (after ``blk.N.``) -> Hugging Face module name (after ``model.layers.N.``).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def check_gguf(path: Path) -> str:
    """Return the file's architecture; ValueError if we cannot serve it or dequantize a tensor."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field else "unknown"
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {supported})")
    for tensor in reader.tensors:
        _check_type(tensor.name, tensor.tensor_type)
    return architecture


def _check_type(name: str, kind) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    if kind not in plain and kind not in _type_traits:
        raise ValueError(f"GGUF tensor {name} has type {kind.name}, which cannot be dequantized")


def hf_name(gguf_name: str) -> str:
    """Map one GGUF tensor name to its Hugging Face name, or raise ValueError."""
    match = _BLOCK.match(gguf_name)
    if match:
        layer, base, kind = match.groups()
        if base in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")


def read_gguf_tensors(
    path: Path, architecture: str, n_heads: int, n_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor, int]]:
    """Yield ``(hf_name, float32 tensor, total)`` for every tensor of the file, dequantized."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    total = len(reader.tensors)
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        _check_type(tensor.name, kind)
        name = hf_name(tensor.name)
        # (rows, cols) in torch layout: GGUF lists dims innermost first.
        array = dequantize(tensor.data, kind).astype(np.float32, copy=False)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weight = torch.from_numpy(array.reshape(shape).copy())
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_heads if "q_proj" in name else n_kv_heads
            weight = unpermute_rope_rows(weight, heads)
        yield name, weight, total


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, interleaved pairs back to two halves."""
    rows, cols = weight.shape
    half = rows // n_heads // 2
    # (n_heads, half, 2, cols) -> (n_heads, 2, half, cols)
    return weight.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)
