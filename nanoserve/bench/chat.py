"""The multi-turn chat workload of ``nanoserve bench serve --dataset multi-turn``.

What a chat client does: many conversations at once, each opening with the same long system
prompt, each turn a new user message appended to the whole history, and the server's own reply
fed back as the assistant message before the next turn. Every turn resends everything, so a
server that recomputes each history pays for it again at every turn, and one that reuses its
cache (prefix caching, llama.cpp's ``cache_prompt``) pays only for what is new. TTFT is reported
per turn, since that is what grows with the history.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp

from nanoserve.bench.data import shipped_words
from nanoserve.bench.metrics import RequestResult, latency_stats, summarize


@dataclass(frozen=True)
class Conversation:
    """One scripted conversation: the shared system prompt and its user messages."""

    system: str
    user_turns: tuple[str, ...]


def build_conversations(
    num_conversations: int, turns: int, system_len: int, turn_len: int, seed: int
) -> list[Conversation]:
    """Seeded conversations of random words: one system prompt shared by all, ``turns`` user
    messages of ``turn_len`` words each."""
    rng = random.Random(f"multi-turn-{seed}")
    words = shipped_words()
    system = "You are a helpful assistant. " + " ".join(rng.choices(words, k=system_len))
    return [
        Conversation(system, tuple(" ".join(rng.choices(words, k=turn_len)) for _ in range(turns)))
        for _ in range(num_conversations)
    ]


async def run_conversation(
    session: aiohttp.ClientSession,
    conversation: Conversation,
    send,  # async (messages) -> RequestResult, see MultiTurn.run
) -> list[RequestResult]:
    """Play one conversation turn by turn; a failed turn ends it (its history is broken)."""
    messages = [{"role": "system", "content": conversation.system}]
    results = []
    for user in conversation.user_turns:
        messages.append({"role": "user", "content": user})
        result = await send(list(messages))
        results.append(result)
        if not result.success:
            break
        messages.append({"role": "assistant", "content": result.text})
    return results


class MultiTurn:
    """Runs ``Conversation``s at once against one server and reports TTFT per turn."""

    def __init__(self, config, conversations: list[Conversation]) -> None:
        self.config = config
        self.conversations = conversations

    async def run(self, session: aiohttp.ClientSession, model: str) -> dict[str, object]:
        """Every conversation concurrently; the summary over all turns plus ``per_turn``."""
        from nanoserve.bench.serve import read_stream

        cfg = self.config

        async def send(messages: list[dict[str, str]]) -> RequestResult:
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": cfg.output_len,
                "max_completion_tokens": cfg.output_len,
                "ignore_eos": True,
                "temperature": cfg.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            } | cfg.extra_body
            result = RequestResult(prompt_len=0)
            start = time.perf_counter()
            try:
                async with session.post(cfg.endpoint_url, json=body) as resp:
                    if resp.status != 200:
                        result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        return result
                    await read_stream(resp.content, result, start, time.perf_counter, True)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                result.error = f"{type(exc).__name__}: {exc}"[:240]
            return result

        start = time.perf_counter()
        runs = await asyncio.gather(
            *(run_conversation(session, c, send) for c in self.conversations)
        )
        duration = time.perf_counter() - start
        flat = [result for run in runs for result in run]
        return {
            **summarize(flat, duration, {}),
            "conversations": len(self.conversations),
            "turns": len(self.conversations[0].user_turns) if self.conversations else 0,
            "per_turn": per_turn(runs),
            "ttft_later_turns_ms": latency_stats(
                [r.ttft for run in runs for r in run[1:] if r.success and r.ttft is not None]
            ),
        }


def per_turn(runs: list[list[RequestResult]]) -> list[dict[str, object]]:
    """For each turn index: how many succeeded, the TTFT statistics, the mean prompt length and
    the share of prompt tokens the server reported as cached (None if it reports none)."""
    table = []
    for turn in range(max((len(run) for run in runs), default=0)):
        done = [run[turn] for run in runs if len(run) > turn and run[turn].success]
        prompt = sum(r.prompt_len for r in done)
        cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
        table.append(
            {
                "turn": turn + 1,
                "completed": len(done),
                "ttft_ms": latency_stats([r.ttft for r in done if r.ttft is not None]),
                "mean_prompt_tokens": prompt / len(done) if done else None,
                "cached_share": sum(cached) / prompt if cached and prompt else None,
            }
        )
    return table
