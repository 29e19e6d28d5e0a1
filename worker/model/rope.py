"""Rotary position embeddings: inverse frequencies (with llama3/linear scaling) and rotation.

Uses Hugging Face's "rotate half" layout (the GGUF loader undoes llama.cpp's pair layout), and
computes angles in float32 like transformers does, so float32 results match it bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of a transformers config: ``rope_parameters`` (transformers 5) or the
    older ``rope_theta`` plus ``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    merged = {**scaling, **params}
    merged.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    merged.setdefault("rope_type", merged.get("type", "default"))
    return merged


def inverse_frequencies(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies, scaled as ``rope_type`` says."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    match params["rope_type"]:
        case "default":
            return inv_freq
        case "linear":
            return inv_freq / float(params["factor"])
        case "llama3":
            return _llama3(inv_freq, params)
        case other:
            raise ValueError(f"unsupported rope scaling {other!r} (supported: linear, llama3)")


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's piecewise scaling: long wavelengths divided by ``factor``, short ones kept,
    and a smooth blend in between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


def rotary_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each (T, 1, head_dim), for positions (T,). The first half of the
    sin is negated, so ``apply_rotary`` can rotate with one roll instead of neg + cat."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    sin = angles.sin().to(dtype)
    half = sin.shape[-1] // 2
    sin[:, :half] = -sin[:, :half]
    return angles.cos().to(dtype)[:, None, :], sin[:, None, :]


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate x (T, heads, head_dim) by the angles of its token's position, into ``out`` if
    given (``out=x`` rotates in place: both products are taken before it is written).

    transformers' ``x * cos + cat(-x2, x1) * sin`` with the sign moved into ``sin``: negation
    is exact, so the result is the same bit for bit.
    """
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return torch.add(x * cos, rolled * sin, out=out)
