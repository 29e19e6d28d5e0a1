"""What ``nanoserve bench serve`` sends: the shipped prompt set (``prompts.jsonl``), seeded
synthetic prompts (random token ids or random words) and seeded Poisson arrival times.

Everything here is a pure function of its arguments and seed, so two runs with the same flags
send the same prompts at the same offsets to every server compared.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

SHIPPED_PROMPTS = Path(__file__).parent / "prompts.jsonl"
# Random token ids skip the low ids, where most vocabularies keep their special tokens.
FIRST_PLAIN_TOKEN = 100


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send. ``prompt_len`` is exact for token ids and a word count for text."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def build_workload(
    *,
    dataset: str,
    prompt_format: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    random_prefix_len: int = 0,
) -> list[BenchRequest]:
    """``num_prompts`` seeded requests. ``dataset`` is "random" (token ids, or random words
    when ``prompt_format`` is "text") or "shipped" (the prompt set, shuffled and cycled).
    ``random_prefix_len`` puts one seeded prefix of that length before every random prompt:
    many requests with one long common prefix (an agent's system prompt and tools).
    "repetitive" asks for the prompt's own text back with one change (``repetitive_prompt``),
    the traffic speculative decoding from the context is for."""
    rng = random.Random(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    if dataset == "repetitive":
        texts = load_shipped_prompts()
        prompts = [repetitive_prompt(texts, rng, n) for n in in_lens]
        return [BenchRequest(t, len(t.split()), n) for t, n in zip(prompts, out_lens, strict=True)]
    if dataset == "shipped":
        texts = load_shipped_prompts()
        rng.shuffle(texts)
        picks = [texts[i % len(texts)] for i in range(num_prompts)]
        return [BenchRequest(t, len(t.split()), n) for t, n in zip(picks, out_lens, strict=True)]
    shared = random.Random(f"prefix-{seed}")  # its own stream: lengths stay as without it
    if prompt_format == "text":
        words = shipped_words()
        prefix = " ".join(shared.choices(words, k=random_prefix_len))
        return [
            BenchRequest(
                f"{prefix} {' '.join(rng.choices(words, k=n))}".lstrip(), n + random_prefix_len, m
            )
            for n, m in zip(in_lens, out_lens, strict=True)
        ]
    ids = range(FIRST_PLAIN_TOKEN, vocab_size)
    head = shared.choices(ids, k=random_prefix_len)
    return [
        BenchRequest(head + rng.choices(ids, k=n), n + random_prefix_len, m)
        for n, m in zip(in_lens, out_lens, strict=True)
    ]


def repetitive_prompt(texts: list[str], rng: random.Random, words: int) -> str:
    """A request to return a text with one change: a paragraph of shipped prompts (about
    ``words`` words) with one word replaced, or a JSON object of them with one field changed.
    Most of the answer is the prompt's own text again."""
    picks = rng.sample(texts, len(texts))
    if rng.random() < 0.5:
        paragraph, used = [], 0
        for text in picks:
            if used >= words:
                break
            paragraph.append(text)
            used += len(text.split())
        body = " ".join(paragraph)
        old = rng.choice([w for w in body.split() if w.isalpha() and len(w) > 3] or ["the"])
        new = rng.choice(shipped_words())
        return (
            f"Rewrite this paragraph, changing only the word '{old}' to '{new}'. Keep every "
            f"other word exactly as it is.\n\n{body}"
        )
    fields, used = {}, 0
    for index, text in enumerate(picks):
        if used >= words:
            break
        fields[f"field_{index}"] = text
        used += len(text.split())
    name = rng.choice(list(fields))
    return (
        f'Return this JSON with only the field "{name}" changed to "{rng.choice(shipped_words())}"'
        f". Return nothing else.\n\n{json.dumps(fields, indent=1)}"
    )


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    # vLLM's random dataset: uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1.
    low, high = max(1, math.floor(mean * (1 - ratio))), math.ceil(mean * (1 + ratio))
    return [rng.randint(low, high) for _ in range(count)]


def load_shipped_prompts(path: Path = SHIPPED_PROMPTS) -> list[str]:
    """The prompts of the shipped JSONL set, one ``{"prompt": ...}`` object per line."""
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def shipped_words() -> list[str]:
    """The sorted distinct lowercase words of the shipped prompts: the random-text vocabulary."""
    words = {w.strip(".,?!:;'\"()").lower() for t in load_shipped_prompts() for w in t.split()}
    return sorted(w for w in words if w.isalpha())


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals at ``rate``
    per second (exponential gaps), or all at zero when the rate is infinite."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals-{seed}")  # its own stream: lengths do not shift arrivals
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets
