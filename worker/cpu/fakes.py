"""Fake (meta) implementations of nanoserve's CPU operators: their output shapes, so that
``torch.compile`` can trace graphs that call them (``worker.compiled``)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def register_fakes(avx512: bool, bf16: bool, vnni: bool) -> None:
    """Output shapes for tracing, of the operators built here: the AVX2 ones, and with
    ``avx512`` (``bf16``, ``vnni``) the others (see ``worker.cpu.kernels``)."""

    @torch.library.register_fake("nanoserve::decode_attention_f32")
    def _(q, kv, layer, blocks, cached, block_size, first=None):
        return q.new_empty(q.shape)

    @torch.library.register_fake("nanoserve::rms_norm_f32")
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("nanoserve::silu_mul_f32")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("nanoserve::q4a8_linear_f32")
    def _(x, packed, scale, low):
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    if not avx512:
        return

    @torch.library.register_fake("nanoserve::decode_attention")
    def _(q, kv, layer, blocks, cached, block_size, first=None):
        return q.new_empty(q.shape)

    if bf16:

        @torch.library.register_fake("nanoserve::prefill_attention")
        def _(q, layer, blocks, start, block_size):
            return q.new_empty(q.shape)

        @torch.library.register_fake("nanoserve::q4_linear")
        def _(x, packed, scale, low):
            return x.new_empty(x.shape[0], packed.shape[0] * 16)

        @torch.library.register_fake("nanoserve::gguf_linear")
        def _(x, q4, scale, low, w4a8, onednn, bias, max_rows, out_features):
            return x.new_empty(x.shape[0], out_features)

    if vnni:

        @torch.library.register_fake("nanoserve::w4a8_linear")
        def _(x, packed, scale, low):
            return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("nanoserve::rms_norm")
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("nanoserve::silu_mul")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("nanoserve::argmax")
    def _(x):
        return x.new_empty(x.shape[0], dtype=torch.long)
