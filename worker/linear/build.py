"""The plan's linear methods on a loaded model (``apply_plan``), and what the model file offers
them (``q4_facts``): each fused linear's 4-bit matrices, stacked by rows as ``fuse`` stacks the
float weights. The worker calls both once, at start.
"""

from __future__ import annotations

from torch import nn

from worker.linear.base import DENSE, Linear, LinearMethod
from worker.linear.dense import OneDnn
from worker.linear.four_bit import Q4A8, Gguf, Q4Kernel, RowSplit, TorchInt4
from worker.linear.packing import float16_exact
from worker.model.gguf import Q4Tensor
from worker.plan import LinearPlan, Plan, Q4Fact

# The plan's linear kinds -> the checkpoint's matrices they fuse (``worker.model.llama``).
FUSED_PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
_MODULES = {
    "qkv_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "gate_up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
}
_SMALL = {"q4": Q4Kernel, "q4a8": Q4A8, "int4": TorchInt4}


def q4_facts(model: nn.Module, tensors: dict[str, Q4Tensor]) -> dict[str, Q4Fact]:
    """Per linear kind, what ``tensors`` (a GGUF's 4-bit matrices by Hugging Face name) hold:
    a kind appears only where every layer has all of its parts."""
    facts = {}
    for kind in FUSED_PARTS:
        parts = [_parts(tensors, index, kind) for index in range(len(model.model.layers))]
        if parts and all(p is not None for p in parts):
            width = model.model.layers[0].get_submodule(_MODULES[kind]).in_features
            halves = {p[0].q.shape[1] // width for p in parts}
            if len(halves) == 1:
                facts[kind] = Q4Fact(halves.pop(), all(float16_exact(p) for p in parts))
    head = _head(model, tensors)
    if head is not None:
        halves = head.q.shape[1] // model.lm_head.in_features
        facts["lm_head"] = Q4Fact(halves, float16_exact([head]))
    return facts


def apply_plan(model: nn.Module, plan: Plan, tensors: dict[str, Q4Tensor]) -> int:
    """Give every linear of ``model`` the method its kind has in ``plan``; returns how many run
    on the file's 4-bit matrices. ValueError where the plan names 4-bit matrices the file lacks."""
    four_bit = 0
    for index, layer in enumerate(model.model.layers):
        for kind, module in _MODULES.items():
            parts = _parts(tensors, index, kind)
            four_bit += use_plan(layer.get_submodule(module), plan.linears[kind], parts)
    return four_bit + use_plan(model.lm_head, plan.linears["lm_head"], _head_parts(model, tensors))


def use_plan(linear: Linear, choice: LinearPlan, parts: list[Q4Tensor] | None) -> bool:
    """Give ``linear`` the method ``choice`` names (``parts``: its 4-bit matrices, stacked by
    rows, or None); returns whether it runs on them."""
    if choice.small is not None and parts is None:
        raise ValueError(f"{choice} runs on 4-bit matrices the model file does not hold")
    if choice.small is None:
        method = _big(choice.big)
    elif choice.big == choice.small:  # every step: the float weight goes
        method = _SMALL[choice.small]()
    elif choice.small == "q4" and choice.big in ("w4a8", "onednn") and _one_half(linear, parts):
        method = Gguf(choice.max_rows, choice.big)
    else:
        method = RowSplit(_SMALL[choice.small](), _big(choice.big), choice.max_rows)
    linear.use(method, parts)
    if choice.small is not None and choice.big == choice.small:
        linear.weight = None
    return choice.small is not None


def _big(name: str) -> LinearMethod:
    if name == "dense":
        return DENSE
    if name == "onednn":
        return OneDnn()
    raise ValueError(f"no linear method {name!r} for big steps without 4-bit matrices")


def _one_half(linear: Linear, parts: list[Q4Tensor]) -> bool:
    return parts[0].q.shape[1] == linear.in_features


def _parts(tensors: dict[str, Q4Tensor], index: int, kind: str) -> list[Q4Tensor] | None:
    parts = [tensors.get(f"model.layers.{index}.{name}.weight") for name in FUSED_PARTS[kind]]
    return None if None in parts else parts


def _head(model: nn.Module, tensors: dict[str, Q4Tensor]) -> Q4Tensor | None:
    head = tensors.get("lm_head.weight")
    if head is None and model.spec.tie_embeddings:
        head = tensors.get("model.embed_tokens.weight")
    return head


def _head_parts(model: nn.Module, tensors: dict[str, Q4Tensor]) -> list[Q4Tensor] | None:
    head = _head(model, tensors)
    return None if head is None else [head]
