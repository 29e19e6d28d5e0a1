"""Fixtures for worker tests: a private cache dir, the tiny model, HF references, and the
``kernels(kind)`` mark (``tests.worker.kernel_checks``)."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kernels(kind): needs nanoserve's CPU kernels of that kind (kernel_checks)"
    )


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Keep GGUF conversions and compiled graphs of tests out of the user's cache, unless one is
    set already. The CPU kernels are shared with it: they are keyed by their sources and flags
    and built under a lock, and building them again costs half a minute on two cores."""
    import os

    from models.files import cache_root

    if "NANOSERVE_CACHE_DIR" not in os.environ:
        shared = cache_root() / "kernels"
        shared.mkdir(parents=True, exist_ok=True)
        private = tmp_path_factory.mktemp("nanoserve-cache")
        (private / "kernels").symlink_to(shared, target_is_directory=True)
        os.environ["NANOSERVE_CACHE_DIR"] = str(private)
    yield


@pytest.fixture(autouse=True)
def marked_kernels(request: pytest.FixtureRequest, private_cache) -> None:
    """A test marked ``kernels(kind)`` runs where those kernels do: it skips elsewhere, or fails
    under NANOSERVE_REQUIRE_KERNELS=1 (``require_kernels``). After ``private_cache``: the first
    look builds the kernels, and builds them there."""
    from tests.worker.kernel_checks import require_kernels

    for mark in request.node.iter_markers("kernels"):
        require_kernels(*mark.args)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One torch thread: on a shared CI box, OpenMP threads spinning against other jobs made
    these tests six times slower. Numerics do not depend on it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """make(name, **overrides) -> directory of a seeded tiny Llama (cached per name)."""
    from tests.tiny_model import make_tiny_llama

    made: dict[str, Path] = {}

    def make(name: str = "base", **overrides) -> Path:
        if name not in made:
            made[name] = make_tiny_llama(tmp_path_factory.mktemp(f"tiny-{name}"), **overrides)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_dir(tiny_factory) -> Path:
    return tiny_factory()


def make_worker(model: Path | str | None, plan=None, **overrides):
    """A worker with a small cache (block_size 4, so requests span several blocks); ``plan``
    overrides the one resolved for this machine (``worker.plan``)."""
    from worker.config import WorkerConfig
    from worker.worker import Worker

    settings = dict(
        block_size=4, num_blocks=256, num_slots=8, num_threads=None, dtype="float32", compile=False
    )
    settings.update(overrides)
    config = WorkerConfig(model=None if model is None else str(model), **settings)
    worker = Worker(config, progress=False, plan=plan)
    # Poison the pool: a read of a position that was never written turns the logits into NaN.
    worker.cache.pool.fill_(float("nan"))
    return worker


def hf_model(directory: Path, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    """transformers' own greedy generate, new tokens only."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model, tokens: list[int]):
    """(len(tokens), vocab) float32 logits of a full-sequence forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()
