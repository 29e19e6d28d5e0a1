"""``ModelOps``: the pointwise operations a layer calls, chosen by the worker's plan.

Eager steps take the plan's (``for_plan``): torch's, or nanoserve's one-pass CPU kernels where
the plan names them (``rms_norm`` and ``silu_mul`` in bfloat16 or float32, ``rotary_`` in
bfloat16; ``worker.cpu.kernels``). Compiled decode steps always trace ``TRACED``, torch's own,
which inductor fuses with their neighbours. The layers never ask which they have.

A module (without weights), so a compiled graph reuses one traced decoder layer for the others
(it reuses a trace only for inputs that are tensors, constants or modules).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.rope import apply_rotary

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight in one fused op. In float32 it equals transformers' formula bit for
    bit; in bfloat16 it rounds once at the end, where transformers rounds before the weight."""
    return F.rms_norm(x, weight.shape, weight, eps)


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # (T, intermediate) each
    return F.silu(gate, inplace=True).mul_(up)


def _torch_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    apply_rotary(qk, cos, sin, out=qk)


def _traced_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # Dynamo refuses ``out=`` on a strided view; in a compiled graph the copy fuses away.
    qk.copy_(apply_rotary(qk, cos, sin))


def _kernel(name: str) -> Callable:
    """A nanoserve operator, looked up when the ops are made (the kernels are loaded then)."""
    return getattr(torch.ops.nanoserve, name)


NORMS: dict[str, Callable[[], Norm]] = {
    "torch": lambda: _torch_norm,
    "kernel": lambda: _kernel("rms_norm"),  # bfloat16, one pass (csrc/rms_norm.cpp)
    "kernel-f32": lambda: _kernel("rms_norm_f32"),  # AVX2, sums in another order
}
ACTIVATIONS = {
    "torch": lambda: _torch_silu_mul,
    "kernel": lambda: _kernel("silu_mul"),  # bfloat16, torch's roundings (csrc/silu_mul.cpp)
    "kernel-f32": lambda: _kernel("silu_mul_f32"),  # AVX2 (csrc/pointwise_f32.cpp)
}
ROTARIES = {
    "torch": lambda: _torch_rotary,
    "kernel": lambda: _kernel("rotary_"),  # bfloat16, in place, torch's roundings
    "traced": lambda: _traced_rotary,
}


class ModelOps(nn.Module):
    """``rms_norm(x (T, d), weight, eps)``, ``silu_mul(gate_up (T, 2h)) -> (T, h)``, and
    ``rotary_(qk (T, heads, hd), cos, sin)`` in place."""

    def __init__(self, norm: str = "torch", activation: str = "torch", rotary: str = "torch"):
        super().__init__()
        self.names = (norm, activation, rotary)
        self.rms_norm = NORMS[norm]()
        self.silu_mul = ACTIVATIONS[activation]()
        self.rotary_ = ROTARIES[rotary]()

    @classmethod
    def for_plan(cls, plan) -> ModelOps:
        """The eager steps' ops of a ``worker.plan.Plan``."""
        return cls(plan.norm, plan.activation, plan.rotary)

    def extra_repr(self) -> str:
        return "norm={}, activation={}, rotary={}".format(*self.names)


EAGER_TORCH = ModelOps()
TRACED = ModelOps(rotary="traced")
