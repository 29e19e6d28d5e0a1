"""The decode step's memory floor, printed beside ``nanoserve bench forward --profile``'s
breakdown.

A small decode step does little but stream bytes: every weight it multiplies by, in the form it
uses at that batch size (the GGUF's 4-bit integers with their scales at most
``--q4-max-tokens`` rows; above that the same integers a byte each with ``--w4a8``, else
oneDNN's bfloat16 matrices; the lm head's 8-bit halves for one row), and every cached K/V it
attends over. No step can take less than those bytes over the device's memory bandwidth,
measured on the worker's plan's device (``BANDWIDTH``): on a CPU by summing a 512 MiB tensor on
torch's threads, on CUDA by a 1 GiB device-to-device copy, whose bytes read and written are the
memory's traffic (best of 5 each). The bytes are counted from the loaded model itself, so a
layout change shows up here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from worker.linear.base import Linear

READ_BYTES = 512 << 20
COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class Floor:
    """Bytes one decode step streams, and the time they take at ``bandwidth``."""

    linears: int  # the layers' linears and the embedding rows, as this batch size uses them
    head: int  # the lm head
    kv: int  # the cached K/V attended over
    bandwidth: float  # bytes per second the device's memory moves (``read_bandwidth``)
    measured: str = "a 512 MiB read"  # how ``bandwidth`` was measured

    @property
    def seconds(self) -> float:
        """The step's floor: every byte read once, at the measured bandwidth."""
        return (self.linears + self.head + self.kv) / self.bandwidth


def linear_bytes(linear: Linear, rows: int) -> int:
    """Bytes of the weight form ``linear`` multiplies ``rows`` rows by (its method's)."""
    return linear.method.streamed(linear, rows)


def step_floor(model, batch: int, context: int, kv_dtype: torch.dtype, bandwidth: float) -> Floor:
    """The floor of a decode step of ``batch`` rows with ``context`` cached positions each."""
    head = model.lm_head
    layers = sum(linear_bytes(m, batch) for m in model.modules() if isinstance(m, Linear))
    layers -= linear_bytes(head, batch)
    embed = model.model.embed_tokens.weight
    layers += batch * embed.shape[1] * embed.element_size()
    spec = model.spec
    per_position = spec.num_layers * 2 * spec.n_kv_heads * spec.head_dim
    kv = batch * context * per_position * torch.tensor([], dtype=kv_dtype).element_size()
    return Floor(layers, linear_bytes(head, batch), kv, bandwidth)


def cpu_read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second summing a 512 MiB float32 tensor (best of ``repeats``), on torch's
    threads: the rate a step's weights can stream at."""
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    data.sum()  # first touch
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    return READ_BYTES / best


def cuda_copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second a 1 GiB device-to-device copy moves, read and written counted (best of
    ``repeats``, timed by CUDA events). Unverified by the project's CI, which has no GPU: the
    GPU check (scripts/gpu_check.sh) reports it."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)  # first touch
    best = float("inf")
    for _ in range(repeats):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        target.copy_(source)
        ended.record()
        ended.synchronize()
        best = min(best, began.elapsed_time(ended) / 1000)
    return 2 * COPY_BYTES / best


# How each device's memory bandwidth is measured, by the plan's device (``Plan.device``).
BANDWIDTH = {
    "cpu": (cpu_read_bandwidth, "a 512 MiB read"),
    "cuda": (cuda_copy_bandwidth, "a 1 GiB device copy"),
}


def read_bandwidth(device: str = "cpu", repeats: int = 5) -> float:
    """Bytes per second of ``device``'s memory (a plan's device: "cpu" or "cuda"), measured as
    ``BANDWIDTH`` says; ValueError for another device."""
    if device not in BANDWIDTH:
        raise ValueError(f"no bandwidth measure for device {device!r} ({', '.join(BANDWIDTH)})")
    return BANDWIDTH[device][0](repeats)
