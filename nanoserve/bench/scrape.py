"""A scrape of a server's /metrics for ``nanoserve bench serve``, across all its frontends.

With ``--api-servers N`` a /metrics answer comes from the one frontend its connection reached;
``nanoserve:frontend_info{index, count, pid}`` names it. A scrape opens fresh connections until
every frontend has answered (bounded: the kernel picks the frontend per connection), then sums
the series each frontend keeps for itself (its CPU, its tokens) over all of them, and takes the
scheduler's series, the same in every answer, from any one. A server without that metric (one
frontend, or not nanoserve) is read from its one answer.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import aiohttp

from nanoserve.bench.metrics import SCRAPED, scrape_counter

# The series each frontend process counts for itself: summed over the frontends.
PER_FRONTEND = ("frontend_cpu", "generation_tokens")
_INFO = re.compile(r"^nanoserve:frontend_info\{([^}]*)\}", re.MULTILINE)


@dataclass(frozen=True)
class Scrape:
    """What one scrape found: ``values`` by SCRAPED fragment, as ``scrape_counter`` returns
    them; ``frontends`` each frontend's own values by index (its pid among them)."""

    values: dict[str, tuple[str, float]] = field(default_factory=dict)
    frontends: dict[str, dict[str, float]] = field(default_factory=dict)
    count: int = 1  # frontends the server says it has

    def get(self, fragment: str) -> tuple[str, float] | None:
        """One fragment's (name, value), as a plain dict's ``get``."""
        return self.values.get(fragment)


def frontend_labels(text: str) -> dict[str, str] | None:
    """The labels of ``nanoserve:frontend_info`` in a /metrics text, or None without it."""
    found = _INFO.search(text)
    if found is None:
        return None
    return dict(re.findall(r'(\w+)="([^"]*)"', found.group(1)))


async def scrape_frontends(
    session: aiohttp.ClientSession, url: str, tries_per_frontend: int = 24
) -> Scrape:
    """Scrape ``url`` (a /metrics URL) until every frontend has answered; an empty Scrape when
    the server has no /metrics. ``session`` must open a connection per request."""
    texts: dict[str, str] = {}
    count, tries = 1, 0
    while tries < tries_per_frontend * count:
        tries += 1
        text = await _get(session, url)
        if text is None:
            return Scrape()
        labels = frontend_labels(text)
        if labels is None:
            texts = {"0": text}
            break
        count = int(labels.get("count", "1"))
        texts[labels.get("index", "0")] = text
        if len(texts) >= count:
            break
    return _combine(texts, count)


def _combine(texts: dict[str, str], count: int) -> Scrape:
    """Each frontend's own series summed (only when every frontend answered), the rest from
    any answer."""
    any_text = next(iter(texts.values()))
    values: dict[str, tuple[str, float]] = {}
    for fragment in SCRAPED:
        found = _counter(any_text, fragment)
        if found is not None and fragment not in PER_FRONTEND:
            values[fragment] = found
    frontends: dict[str, dict[str, float]] = {}
    for index, text in texts.items():
        own = {fragment: _counter(text, fragment) for fragment in PER_FRONTEND}
        frontends[index] = {f: v[1] for f, v in own.items() if v is not None}
        frontends[index]["pid"] = float((frontend_labels(text) or {}).get("pid", 0))
    if len(texts) == count:
        for fragment in PER_FRONTEND:
            found = [_counter(text, fragment) for text in texts.values()]
            if all(f is not None for f in found):
                values[fragment] = (found[0][0], sum(f[1] for f in found))
    return Scrape(values=values, frontends=frontends, count=count)


def per_frontend(before: Scrape, after: Scrape) -> list[dict[str, float]]:
    """What each frontend that answered both scrapes did in between: its pid, the tokens it
    streamed and its CPU seconds, by index."""
    rows = []
    for index, own in sorted(after.frontends.items()):
        was = before.frontends.get(index)
        if was is None or was.get("pid") != own.get("pid"):
            continue  # not seen before, or restarted since
        row: dict[str, float] = {"index": int(index), "pid": int(own["pid"])}
        for fragment, name in (("generation_tokens", "tokens"), ("frontend_cpu", "cpu_s")):
            if fragment in own and fragment in was:
                row[name] = own[fragment] - was[fragment]
        rows.append(row)
    return rows


def _counter(text: str, fragment: str) -> tuple[str, float] | None:
    try:
        return scrape_counter(text, fragment)
    except (ValueError, IndexError):
        return None


async def _get(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
