"""The CPU's weight layouts for a loaded ``LlamaModel``: oneDNN's pre-packed matrices
(``pack_for_cpu``) and the GGUF file's own 4-bit ones (``attach_q4``), each linear's held by
``worker.linear.base.Linear``. The worker calls them once, after loading the model; the forward
never asks which layout a linear holds. What they attach decides what the compiled graphs call, so
``worker.compiled.background`` hashes this file into the graphs' cache key.
"""

from __future__ import annotations

import torch

from worker.linear.base import Linear
from worker.model.gguf import Q4Tensor
from worker.model.llama import LlamaModel

# The lm head's GGUF matrix (usually Q8_0, so two 4-bit halves) runs for one row only: twice the
# columns pay for themselves at one row and not beyond (docs/performance.md). In a float32 model
# too, though nanoserve's AVX2 kernel is faster on both halves up to 32 rows: the head's 8-bit
# activations in many-row steps moved scripts/accuracy.py from 97.5% agreement and a 0.032 mean
# error to 97.2% and 0.035, past llama.cpp's 0.035.
LM_HEAD_Q4_MAX_ROWS = 1

# The linears that take 8-bit activations with ``w4a8``: the MLP's, 75% of a layer's multiplies.
# With the attention's projections too, the default model's forced steps kept float32's token
# on 96.2% of 686, with a mean log-probability error of 0.039 against llama.cpp's 97.4% and
# 0.035; with the MLP's only, 96.9% and 0.033 (scripts/accuracy.py; 96.2% and 0.031 since
# 26336b6's prefill attention).
W4A8_LINEARS = ("mlp.gate_up_proj", "mlp.down_proj")
_FUSED_PARTS = {  # the linears after ``fuse`` -> the checkpoint's matrices, stacked by rows
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def pack_for_cpu(model: LlamaModel) -> bool:
    """Pre-pack every linear weight of ``model`` for oneDNN where that pays and oneDNN can (CPU,
    float32, or bfloat16 where the CPU has what oneDNN's bfloat16 needs: ``onednn_packs``); the
    others keep ``F.linear``. Returns whether ``model`` takes the CPU's layouts at all (CPU,
    bfloat16 or float32), packed or not. Call after the model reached its device."""
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return False
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
    return True


def attach_q4(
    model: LlamaModel, tensors: dict[str, Q4Tensor], max_tokens: int, w4a8: bool = False
) -> int:
    """Give every fused linear of ``model`` whose parts are all 4-bit in ``tensors`` (Hugging
    Face names) its 4-bit form for steps of at most ``max_tokens`` tokens (and with ``w4a8`` for
    the MLP's bigger ones, see ``Linear.attach_q4``), and the lm head its own for single rows;
    returns how many got one."""
    attached = 0
    dtype = model.model.embed_tokens.weight.dtype
    # A float32 model's linears all take 8-bit activations (``Linear.attach_q4``'s q4a8): with
    # float32 everywhere else, that is llama.cpp's own numerics (docs/performance.md).
    takes_w4a8 = W4A8_LINEARS if dtype == torch.bfloat16 else tuple(_FUSED_PARTS)
    for index, layer in enumerate(model.model.layers):
        for fused, names in _FUSED_PARTS.items():
            linear = layer.get_submodule(fused)
            parts = [tensors.get(f"model.layers.{index}.{name}.weight") for name in names]
            # 4-bit matrices only: an 8-bit one (two halves, twice the columns) pays for a
            # single row only, and every step through a layer may have more.
            if None not in parts and all(p.q.shape[1] == linear.in_features for p in parts):
                linear.attach_q4(parts, max_tokens, w4a8 and fused in takes_w4a8)
                attached += 1
    head = tensors.get("lm_head.weight")
    if head is None and model.spec.tie_embeddings:
        head = tensors.get("model.embed_tokens.weight")
    if head is not None:
        model.lm_head.attach_q4([head], min(max_tokens, LM_HEAD_Q4_MAX_ROWS))
        attached += 1
    return attached
