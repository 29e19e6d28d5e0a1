"""The worker against transformers on a seeded tiny Llama: logits and greedy tokens, in every
batching scenario (alone, batched, chunked prefill, recompute after release), on the default
CPU path and on the generic one (the code CUDA runs)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.conftest import hf_greedy, hf_logits, hf_model, make_worker
from tests.worker.driver import Driver, greedy_requests
from worker.attention import TorchBackend
from worker.cpu import kernels
from worker.linear.base import DENSE, Linear

PROMPTS = [
    [1, 17, 42, 99, 3],
    [1, 200, 201, 202, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [1, 55],
    [1] + list(range(30, 70)),
]
MAX_NEW = 20
LOGIT_TOL = 1e-4  # float32, same weights: only summation order differs


def reference(directory, prompts=PROMPTS, eos=(2,)):
    model = hf_model(directory)
    return model, [hf_greedy(model, p, MAX_NEW, list(eos)) for p in prompts]


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    return reference(tiny_dir)


def check(worker, model, expected, scenario, prompts=PROMPTS):
    driver = Driver(worker)
    if scenario == "alone":
        requests = [driver.run(greedy_requests([p], MAX_NEW))[0] for p in prompts]
    else:
        chunk = 3 if scenario == "chunked" else None
        recompute = 4 if scenario == "recompute" else None
        requests = driver.run(greedy_requests(prompts, MAX_NEW), chunk, recompute)
    for req, want in zip(requests, expected, strict=True):
        assert req.output == want, f"{scenario}: {req.request_id}"
        ref = hf_logits(model, req.known[:-1])[len(req.prompt) - 1 :]
        ours = torch.stack(req.logits)
        assert (ours - ref).abs().max().item() < LOGIT_TOL
    assert all(row.request_id is None for row in worker.rows())


@pytest.mark.parametrize("scenario", ["alone", "batched", "chunked", "recompute"])
def test_tiny_matches_transformers(tiny_dir, tiny_reference, scenario):
    model, expected = tiny_reference
    assert any(len(e) == MAX_NEW for e in expected)  # not all stopping at once on EOS
    check(make_worker(tiny_dir), model, expected, scenario)


def _no_kernels() -> bool:
    raise AssertionError("the generic path asked for worker.cpu.kernels")


@pytest.mark.parametrize("scenario", ["alone", "batched", "chunked", "recompute"])
def test_generic_path_matches_transformers(tiny_dir, tiny_reference, scenario, monkeypatch):
    model, expected = tiny_reference
    monkeypatch.setattr(kernels, "available", _no_kernels)
    check(make_worker(tiny_dir, generic_path=True), model, expected, scenario)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generic_path_runs_only_what_cuda_runs(tiny_dir, dtype, monkeypatch):
    """The torch attention backend, plain F.linear weights and torch's argmax; never a kernel."""
    monkeypatch.setattr(kernels, "available", _no_kernels)
    worker = make_worker(tiny_dir, dtype=dtype, generic_path=True)
    assert type(worker.attention) is TorchBackend
    assert worker.sampler.argmax == "torch" and worker.q4_linears == 0
    assert {worker.plan.norm, worker.plan.activation, worker.plan.rotary} == {"torch"}
    linears = [module for module in worker.model.modules() if isinstance(module, Linear)]
    assert linears and all(linear.method is DENSE for linear in linears)
    (request,) = Driver(worker).run(greedy_requests(PROMPTS[:1], 4))
    assert len(request.output) == 4 and torch.stack(request.logits).isfinite().all()


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("bias", dict(attention_bias=True)),
        ("tied", dict(tie_word_embeddings=True)),
        (
            "llama3",
            dict(
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=16,
                )
            ),
        ),
        ("linear", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    ],
)
def test_tiny_variants(tiny_factory, name, overrides):
    directory = tiny_factory(name, **overrides)
    model, expected = reference(directory)
    check(make_worker(directory), model, expected, "batched")
    check(make_worker(directory), model, expected, "chunked")


def test_prefill_and_decode_mix_in_one_step(tiny_dir, tiny_reference):
    """Requests that start at different steps: prefills land beside running decodes."""
    model, expected = tiny_reference
    worker = make_worker(tiny_dir)
    driver = Driver(worker)
    requests = greedy_requests(PROMPTS, MAX_NEW)
    started: list = []
    while not all(r.done for r in requests):
        if len(started) < len(requests):
            started.append(requests[len(started)])
        driver.step([r for r in started if not r.done], 5, None)
    for req, want in zip(requests, expected, strict=True):
        assert req.output == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scenario", ["batched", "chunked", "recompute"])
def test_tiny_on_cuda(tiny_dir, tiny_reference, scenario):
    model, expected = tiny_reference
    check(make_worker(tiny_dir, device="cuda"), model, expected, scenario)
