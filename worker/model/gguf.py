"""Dequantize a llama.cpp GGUF file into Hugging Face tensor names and layout.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of Llama models so that its
rotary embedding can rotate adjacent pairs; Hugging Face rotates halves. We undo that here, so
the cached weights are exactly what ``transformers`` would build from the same file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
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
        heads = _permuted_heads(name, architecture, n_heads, n_kv_heads)
        if heads:
            weight = unpermute_rope_rows(weight, heads)
        yield name, weight, total


def _permuted_heads(name: str, architecture: str, n_heads: int, n_kv_heads: int) -> int | None:
    """The head count of a matrix whose rows llama.cpp permuted (Llama's q and k), else None."""
    if architecture != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    return n_heads if "q_proj" in name else n_kv_heads


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, interleaved pairs back to two halves."""
    rows, cols = weight.shape
    half = rows // n_heads // 2
    # (n_heads, half, 2, cols) -> (n_heads, 2, half, cols)
    return weight.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


@dataclass(frozen=True)
class Q4Tensor:
    """A 4-bit GGUF matrix kept as its own integers: weight = (q - 8) * scale + zero, per row
    and group of 32 columns (Q4_1: d * q + m, so scale = d and zero = m + 8 * d).

    An 8-bit (Q8_0) matrix of K columns is two such halves side by side, K columns each: the
    weight is their sum, and a linear feeds its input to both (``Linear.attach_q4``)."""

    q: torch.Tensor  # (N, K) uint8 in [0, 16)
    scale: torch.Tensor  # (N, K // 32) float32
    zero: torch.Tensor  # (N, K // 32) float32


def read_q4_tensors(
    path: Path, architecture: str, n_heads: int, n_kv_heads: int
) -> dict[str, Q4Tensor]:
    """Every Q4_0 and Q4_1 matrix of the file by Hugging Face name, rows in Hugging Face order,
    and every Q8_0 matrix as two 4-bit halves. Other types are left out: their values have no
    exact 4-bit form."""
    from gguf import GGMLQuantizationType, GGUFReader

    readers = {
        GGMLQuantizationType.Q4_0: partial(_q4_blocks, has_min=False),
        GGMLQuantizationType.Q4_1: partial(_q4_blocks, has_min=True),
        GGMLQuantizationType.Q8_0: _q8_blocks,
    }
    tensors = {}
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.tensor_type not in readers:
            continue
        name = hf_name(tensor.name)
        q4 = readers[tensor.tensor_type](np.asarray(tensor.data))
        heads = _permuted_heads(name, architecture, n_heads, n_kv_heads)
        if heads:
            q4 = Q4Tensor(*(unpermute_rope_rows(t, heads) for t in (q4.q, q4.scale, q4.zero)))
        tensors[name] = q4
    return tensors


def _q4_blocks(data: np.ndarray, has_min: bool) -> Q4Tensor:
    """Rows of ggml blocks -> integers and per-group scale and zero. A block of 32 weights is
    an f16 scale d, (Q4_1 only) an f16 minimum m, then 16 bytes: weight j in the low nibble of
    byte j, weight j + 16 in its high nibble."""
    rows = data.shape[0]
    header = 4 if has_min else 2
    blocks = data.reshape(rows, -1, header + 16)  # (N, K / 32, bytes per block)
    d = _f16_field(blocks, 0)  # (N, K / 32)
    zero = _f16_field(blocks, 2) + 8 * d if has_min else np.zeros_like(d)  # Q4_0: d * (q - 8)
    nibbles = torch.from_numpy(blocks[..., header:].copy())  # (N, K / 32, 16) uint8
    q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).reshape(rows, -1)  # (N, K)
    return Q4Tensor(q, torch.from_numpy(d), torch.from_numpy(zero))


def _q8_blocks(data: np.ndarray) -> Q4Tensor:
    """Rows of Q8_0 blocks (an f16 scale d, then 32 int8 q: weight d * q) -> two 4-bit halves
    side by side, (N, 2K). With q = 16 * hi + lo, hi in [-8, 8) and lo in [0, 16): the first
    half holds hi + 8 with scale 16 * d and zero 0, the second lo with scale d and zero 8 * d.
    Exact: 16 * d and 8 * d are d shifted, and the halves sum to d * q."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 2 + 32)  # (N, K / 32, bytes per block)
    d = _f16_field(blocks, 0)  # (N, K / 32)
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, -1)  # (N, K)
    hi, lo = (q >> 4) + 8, q & 15  # arithmetic shift: hi = floor(q / 16)
    halves = torch.cat((hi, lo), dim=1).to(torch.uint8)  # (N, 2K), values 0..15
    d = torch.from_numpy(d)
    scale = torch.cat((16 * d, d), dim=1)  # (N, 2K / 32)
    zero = torch.cat((torch.zeros_like(d), 8 * d), dim=1)
    return Q4Tensor(halves, scale, zero)


def _f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of every block, as float32: (N, K / 32)."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)
