"""``Linear`` and ``LinearMethod``: a layer's weights, and how its matmul runs.

A ``Linear`` loads a checkpoint's ``weight`` and ``bias`` under transformers' names, as
``nn.Linear`` does. Its ``method`` does the multiply (vLLM's ``LinearMethodBase`` shape): plain
``F.linear`` until the worker applies its plan (``worker.linear.build``), which gives each linear
one method of one class (dense, oneDNN-packed, 4-bit, w4a8, q4a8). ``prepare`` puts the method's
tensors on the layer (and may drop the float weight), ``apply`` multiplies; the forward never asks
which method it holds.

The tensors live on the layer, an ``nn.Module``, and the methods hold none: a compiled graph's
guards skip the model's modules (``worker.compiled.decode``), so they never check the weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.gguf import Q4Tensor


class Linear(nn.Module):
    """A linear layer: ``weight`` (out, in) and ``bias`` (out,) as loaded, and its ``method``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.method: LinearMethod = DENSE

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """A layer around existing tensors (no initialization of fresh ones)."""
        with torch.device("meta"):
            layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return layer

    def use(self, method: LinearMethod, q4: list[Q4Tensor] | None = None) -> None:
        """Multiply with ``method`` from now on: it prepares its tensors from the float weight
        and, for a 4-bit method, the file's matrices ``q4`` (stacked by rows as ``weight``)."""
        method.prepare(self, q4)
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class LinearMethod(ABC):
    """How a linear multiplies. One instance per layer; the tensors live on the layer."""

    name: str  # the plan's name for it (``worker.plan.LinearPlan``)

    def prepare(self, layer: Linear, q4: list[Q4Tensor] | None) -> None:  # noqa: B027
        """Put this method's tensors on ``layer`` (once, at start). Default: nothing."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, out), bias included."""

    def streamed(self, layer: Linear, rows: int) -> int:
        """Bytes of weights a step of ``rows`` rows reads (``nanoserve bench forward``'s floor).
        Default: the plain matrix (oneDNN's packed layout may pad; the matrix is what must be
        read)."""
        return layer.in_features * layer.out_features * self.element_size(layer)

    def element_size(self, layer: Linear) -> int:
        return layer.weight.element_size()


class Dense(LinearMethod):
    """``F.linear`` on the float weight: what CUDA and the generic path run."""

    name = "dense"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


DENSE = Dense()  # stateless: every layer may share it
