"""The grammar engine's own costs on the default model's vocabulary (49,152 tokens), without a
server: how long a schema takes to compile, and how long one token's mask takes to fill (one
sequence, and each of 32 sequences filled together, as a step of 32 constrained rows does),
plus applying 32 masks to the logits as the sampler does.

Each sequence walks its grammar with seeded random allowed tokens, so every mask is a real
one. Prints one line per figure:

    python scripts/bench_grammar.py [--tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages

import numpy as np  # noqa: E402
import torch  # noqa: E402

from frontend.json_schema import JsonOptions  # noqa: E402
from models.files import resolve_model  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402
from nanoserve.bench.structured import SCHEMA  # noqa: E402
from worker.grammar.llguidance_backend import LLGuidanceBackend  # noqa: E402
from worker.grammar.masks import PendingMasks  # noqa: E402


def allowed_tokens(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def walk(backend: LLGuidanceBackend, grammar: str, rows: int, tokens: int, seed: int) -> list:
    """Fill ``rows`` matchers' masks ``tokens`` times, each taking a random allowed token;
    returns the seconds of every fill."""
    rng = random.Random(seed)
    words = (backend.vocab_size + 31) // 32
    matchers = [backend.matcher(grammar) for _ in range(rows)]
    bitmask = np.zeros((rows, words), dtype=np.int32)
    times = []
    for _ in range(tokens):
        began = time.perf_counter()
        backend.fill([(m, k) for k, m in enumerate(matchers)], bitmask)
        times.append(time.perf_counter() - began)
        for k, matcher in enumerate(matchers):
            matcher.consume([int(rng.choice(allowed_tokens(bitmask[k], backend.vocab_size)))])
    return times


def apply_seconds(bitmask: np.ndarray, vocab: int, repeats: int = 50) -> float:
    """The sampler's part: 32 filled masks applied to float32 logits (median seconds)."""
    logits = torch.randn(bitmask.shape[0], vocab)
    row = SimpleNamespace(history=[], prompt_len=0, params=SimpleNamespace(min_tokens=0))
    times = []
    for _ in range(repeats):
        pending = PendingMasks(list(range(bitmask.shape[0])), bitmask, _Done(), vocab)
        scores = logits.clone()
        began = time.perf_counter()
        pending.apply(scores, logits, [row] * bitmask.shape[0])
        times.append(time.perf_counter() - began)
    return statistics.median(times)


class _Done:
    """A future already resolved (PendingMasks waits on one)."""

    def result(self) -> float:
        return 0.0

    def done(self) -> bool:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens each sequence walks")
    parser.add_argument("--repeats", type=int, default=5, help="compiles timed (median)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(None))
    eos = list(tokenizer.eos_token_ids)
    began = time.perf_counter()
    backend = LLGuidanceBackend(tokenizer.tokenizer.to_str(), tokenizer.vocab_size, eos)
    loaded = time.perf_counter() - began
    print(f"vocabulary: {tokenizer.vocab_size} tokens, loaded in {loaded:.2f} s")
    compiles = []
    for i in range(args.repeats):
        schema = {**SCHEMA, "description": f"run {i}"}  # a new grammar each time: no cache
        began = time.perf_counter()
        backend.matcher(JsonOptions().grammar(schema))
        compiles.append(time.perf_counter() - began)
    print(f"compile of bench_structured.SCHEMA: {statistics.median(compiles) * 1e3:.2f} ms median")
    grammar = JsonOptions().grammar(SCHEMA)
    for rows in (1, 32):
        times = walk(backend, grammar, rows, args.tokens, seed=rows)
        per_token = [t / rows * 1e6 for t in times]
        print(
            f"mask fill, {rows} sequence(s) at once: {statistics.median(per_token):.1f} us per "
            f"token median, {statistics.mean(per_token):.1f} mean, {max(per_token):.0f} max"
        )
    bitmask = np.full((32, (tokenizer.vocab_size + 31) // 32), -1, dtype=np.int32)
    applied = apply_seconds(bitmask, tokenizer.vocab_size)
    print(f"mask apply, 32 rows of float32 logits: {applied * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
