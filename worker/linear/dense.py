"""``OneDnn``: the float weight in oneDNN's pre-packed layout, which oneDNN multiplies faster
than ``F.linear`` does at decode batch sizes on CPU. (``Dense``, plain ``F.linear``, is in
``worker.linear.base``: every layer starts with it.)"""

from __future__ import annotations

import torch

from worker.linear.base import Linear, LinearMethod
from worker.model.gguf import Q4Tensor


class OneDnn(LinearMethod):
    """oneDNN's linear on the packed weight (float32, or bfloat16 where oneDNN packs it; the
    plan decides, ``worker.plan._onednn_packs``). The float weight goes."""

    name = "onednn"

    def prepare(self, layer: Linear, q4: list[Q4Tensor] | None) -> None:
        # The batch size hint (32) barely matters.
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 32)
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")

    def element_size(self, layer: Linear) -> int:
        return layer.packed.element_size()
