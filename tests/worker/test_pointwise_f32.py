"""``torch.ops.nanoserve.rms_norm_f32`` and ``silu_mul_f32``
(``worker/cpu/csrc/pointwise_f32.cpp``):
the eager float32 norms and SwiGLU activation of ``auto``'s float32, in AVX2.

Each equals its float64 formula to float32's rounding, over row counts that split across
threads or not, widths with and without a tail past the 8-float vectors, strided rows, and the
values where the vector path hands over to the scalar one; each refuses what it cannot compute.
A worker whose ``auto`` resolved to float32 runs its eager steps through them; an explicit
float32, the exact path, never does."""

from __future__ import annotations

import pytest
import torch

from tests.worker.conftest import make_worker
from tests.worker.kernel_checks import require_kernels
from worker import plan


@pytest.fixture(autouse=True)
def built(private_cache):
    """Build (or load) the kernels in the tests' private cache, or skip where they cannot be."""
    require_kernels("avx2")


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-6) -> bool:
    return bool(((got.double() - want).abs() <= want.abs() * rel + 1e-7).all())


@pytest.mark.parametrize("rows, width", [(1, 576), (7, 64), (130, 576), (3, 100), (200, 1536)])
def test_rms_norm_equals_its_formula_to_float32_rounding(rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    got = torch.ops.nanoserve.rms_norm_f32(x, weight, 1e-5)
    x64 = x.double()
    want = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight.double()
    assert got.shape == x.shape and got.dtype == torch.float32
    assert _close(got, want), (got.double() - want).abs().max().item()
    # torch's own float32 norm, which the exact path keeps, is as close.
    assert torch.allclose(got, torch.nn.functional.rms_norm(x, (width,), weight, 1e-5), 1e-5, 1e-6)


def test_rms_norm_takes_strided_rows_and_zero_rows():
    x = torch.randn(5, 2 * 576, generator=torch.Generator().manual_seed(1))[:, :576]
    assert not x.is_contiguous()
    x[2] = 0  # the sum of squares is 0: the row stays 0, eps keeps it finite
    weight = torch.rand(576, generator=torch.Generator().manual_seed(2))
    got = torch.ops.nanoserve.rms_norm_f32(x, weight, 1e-6)
    assert torch.equal(got[2], torch.zeros(576))
    assert torch.equal(got, torch.ops.nanoserve.rms_norm_f32(x.contiguous(), weight, 1e-6))


def _silu_mul64(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("rows, width", [(1, 1536), (128, 1536), (3, 20), (40, 4864)])
def test_silu_mul_equals_its_formula_to_float32_rounding(rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 6
    got = torch.ops.nanoserve.silu_mul_f32(gate_up)
    assert got.shape == (rows, width) and got.dtype == torch.float32
    assert _close(got, _silu_mul64(gate_up), rel=1e-6)


def test_silu_mul_at_the_edges_of_the_vector_path():
    """Below -87 the polynomial exp clamps, so those vectors go the scalar way; large positive
    gates give the gate itself; a NaN stays NaN where it is, and only there."""
    gate = torch.tensor([-200.0, -88.0, -87.5, -30.0, 0.0, 30.0, 90.0, 1e30] * 2)
    gate[12] = float("nan")
    up = torch.linspace(-2, 2, 16)
    got = torch.ops.nanoserve.silu_mul_f32(torch.cat((gate, up))[None])[0]
    want = _silu_mul64(torch.cat((gate, up))[None])[0]
    assert got[12].isnan() and (got.isnan().sum() == 1)
    keep = torch.arange(16) != 12
    assert _close(got[keep], want[keep], rel=1e-6)
    strided = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))[:, :40]
    assert torch.equal(
        torch.ops.nanoserve.silu_mul_f32(strided),
        torch.ops.nanoserve.silu_mul_f32(strided.contiguous()),
    )


def test_they_refuse_what_they_cannot_compute():
    x, weight = torch.randn(2, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.nanoserve.rms_norm_f32(x.bfloat16(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.nanoserve.rms_norm_f32(x, weight[:32], 1e-5)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.nanoserve.rms_norm_f32(x.t(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        torch.ops.nanoserve.silu_mul_f32(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="gate_up must be"):
        torch.ops.nanoserve.silu_mul_f32(torch.randn(2, 8, dtype=torch.float64))


def _counting(monkeypatch, name: str) -> list:
    calls = []
    real = getattr(torch.ops.nanoserve, name)

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(torch.ops.nanoserve, name, counting)
    return calls


def _prefill(worker) -> None:
    from tests.worker.driver import Driver, Request

    Driver(worker, eos=[]).run([Request("a", list(range(3, 30)), 3)])


def test_autos_float32_steps_take_them_and_an_explicit_float32_does_not(tiny_dir, monkeypatch):
    norms = _counting(monkeypatch, "rms_norm_f32")
    activations = _counting(monkeypatch, "silu_mul_f32")
    exact = make_worker(tiny_dir, dtype="float32")
    assert (exact.plan.norm, exact.plan.activation) == ("torch", "torch")
    _prefill(exact)
    assert not norms and not activations
    # The float32 that ``auto`` picks on a CPU without native bfloat16 (simulated).
    monkeypatch.setattr(plan, "BF16_CPU_FLAGS", ("no-such-flag",))
    auto = make_worker(tiny_dir, dtype="auto")
    assert auto.plan.dtype == "float32"
    assert (auto.plan.norm, auto.plan.activation) == ("kernel-f32", "kernel-f32")
    layers = auto.spec.num_layers
    _prefill(auto)
    # Every eager step: two norms a layer and the final one, one activation a layer.
    assert len(norms) % (2 * layers + 1) == 0 and len(norms) >= 3 * (2 * layers + 1)
    assert len(activations) * (2 * layers + 1) == len(norms) * layers
