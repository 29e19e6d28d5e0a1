"""How much of a workload's output drafts from the context could ever cover: the bound on
speculative decoding's median ITL that no verification speed lifts.

    python scripts/spec_coverage.py [--num-prompts 32] [--input-len 120] [--output-len 128]

It generates the greedy replies to ``bench serve --dataset repetitive``'s prompts with the
default model in-process (as ``compare.py --workload repetitive`` sends them: chat, 128 tokens
forced), then replays drafters over each reply as if every verification were free: at each
step the drafter proposes up to k tokens from the request's known tokens, the longest prefix
that the reply continues with is accepted, and the step yields it plus one token. A stream
shows a verification's tokens as chunks microseconds apart, so the share of tokens that were
accepted drafts is the share of inter-token gaps near zero: while it stays under a half, the
median gap is a whole step, with drafts or without (docs/speculative.md).

Drafters: ``ngram`` is the server's (``scheduler.drafter.NgramIndex``: the longest suffix of
``MIN_N`` to ``MAX_N`` tokens, its latest earlier occurrence); the variants change the n-gram
sizes and k, and "+ earlier replies" also looks the suffix up in the earlier requests' prompts
and replies (a global history, as suffix decoding keeps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanoserve.bench.data import build_workload  # noqa: E402
from scheduler.drafter import MAX_N, MIN_N, NgramIndex  # noqa: E402

DRAFTERS = (  # (name, smallest n, largest n, k, earlier replies too)
    ("ngram (the server's)", MIN_N, MAX_N, 4, False),
    ("ngram, k 8", MIN_N, MAX_N, 8, False),
    ("ngram, 1-grams too", 1, MAX_N, 4, False),
    ("ngram, 1-grams too, k 8", 1, MAX_N, 8, False),
    ("ngram, k 8, + earlier replies", MIN_N, MAX_N, 8, True),
    ("ngram, 1-grams too, k 16, + earlier replies", 1, 8, 16, True),
)


def replies(args) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy reply ids) of the repetitive workload, from the default model."""
    from models.files import resolve_model
    from models.tokenizer import load_tokenizer
    from protocol.messages import SamplingParams
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine
    from worker.config import WorkerConfig
    from worker.worker import Worker

    requests = build_workload(
        dataset="repetitive",
        prompt_format="text",
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=0.0,
        vocab_size=49152,
        seed=0,
    )
    tokenizer = load_tokenizer(resolve_model(None))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}]) for r in requests
    ]
    worker = Worker(WorkerConfig(compile=False, num_blocks=2048), progress=False)
    try:
        engine = Engine.for_worker(worker, SchedulerConfig())
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        outs = engine.generate(prompts, params)
    finally:
        worker.close()
    return [(p, list(o.new_token_ids)) for p, o in zip(prompts, outs, strict=True)]


def lookup(known: list[int], smallest: int, largest: int, k: int, history: list[list[int]]):
    """At most k tokens after the latest earlier occurrence of the longest suffix of ``known``
    (``largest`` down to ``smallest`` tokens), in ``known`` itself, then in ``history``."""
    for n in range(largest, smallest - 1, -1):
        if len(known) <= n:
            continue
        suffix = known[-n:]
        for source, end in [(known, len(known) - 1), *((h, len(h)) for h in history)]:
            for at in range(end - n, -1, -1):
                if source[at : at + n] == suffix and at + n < len(source):
                    return source[at + n : at + n + k]
    return []


def replay(pairs, smallest: int, largest: int, k: int, earlier: bool) -> dict:
    """Steps, verifications and the share of tokens that were accepted drafts, every
    verification free."""
    steps = verifications = accepted = drafted = total = 0
    history: list[list[int]] = []
    for prompt, reply in pairs:
        index, done = NgramIndex(), 0
        while done < len(reply):
            known = prompt + reply[:done]
            if (smallest, largest, earlier) == (MIN_N, MAX_N, False):  # the server's own
                draft = index.propose(lambda a, b, t=known: t[a:b], len(known), k)
            else:
                draft = lookup(known, smallest, largest, k, history if earlier else [])
            hit = 0
            while hit < len(draft) and done + hit < len(reply) and draft[hit] == reply[done + hit]:
                hit += 1
            got = min(hit + 1, len(reply) - done)
            steps, verifications = steps + 1, verifications + bool(draft)
            accepted, drafted = accepted + got - 1, drafted + len(draft)
            total, done = total + got, done + got
        history.append(prompt + reply)
    return {
        "steps": steps,
        "verifications": verifications,
        "accepted share of tokens": accepted / total,
        "acceptance length": (accepted + verifications) / max(verifications, 1),
        "drafts accepted": accepted / max(drafted, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=120)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    pairs = replies(args)
    print(f"{len(pairs)} replies, {sum(len(r) for _, r in pairs)} tokens")
    print("| drafter | steps | verifications | accepted share of tokens | acceptance length |")
    print("|---|---:|---:|---:|---:|")
    for name, *drafter in DRAFTERS:
        found = replay(pairs, *drafter)
        print(
            f"| {name} | {found['steps']} | {found['verifications']} | "
            f"{found['accepted share of tokens']:.1%} | {found['acceptance length']:.2f} |"
        )
    # One reply's share ranges widely (a reply that copies its prompt, one that paraphrases
    # it): a handful of prompts says little about the workload.
    shares = sorted(replay([pair], *DRAFTERS[0][1:])["accepted share of tokens"] for pair in pairs)
    print(
        f"{DRAFTERS[0][0]}, one reply at a time: accepted share from {shares[0]:.0%} to "
        f"{shares[-1]:.0%}, median {statistics.median(shares):.0%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
