"""Structured outputs through the clients people use, against the real default server: the
official openai client's ``parse``, instructor in its JSON_SCHEMA, TOOLS and PARALLEL_TOOLS
modes, and a plain HTTP client with vLLM's ``structured_outputs``. A subset of the suite that
``nanoserve bench structured-clients`` runs in full (its table: docs/structured_outputs.md).

The module's server is fresh when the first test runs: it checks that the first structured
request after a start finds the grammar engine built.
"""

from __future__ import annotations

import asyncio
import itertools
import re

import aiohttp
import pytest

from nanoserve.bench.structured_cases import CASES, case
from nanoserve.bench.structured_clients import Ask, Outcome, run_suite
from nanoserve.commands.bench_structured_clients import format_report

pytestmark = pytest.mark.slow

# Nested models, patterns, enums and literals, optional fields, bounded lists, a union, a model
# that allows extra fields; and the two reported extractions.
SUBSET = ["Ticket", "Person", "Contact", "Meeting", "Weather", "Drawing", "Settings"]
GATED = ["openai-parse", "instructor-json-schema", "instructor-tools", "http-structured-outputs"]
# The first structured request a fresh server saw, which stalled every request beside it.
REGEX = "(a|b|ab)*c{50000}"
PLAIN = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


async def test_the_first_structured_request_finds_the_grammar_engine_built(server):
    """The worker built its grammar engine before it announced itself; the first structured
    request is served, and so is every plain request sent while it runs."""
    built = server.wait_log("worker", r"grammars: llguidance over \d+ tokens, built in")
    ready = server.wait_log("worker", r"model \S+ ready on ")
    assert built < ready
    assert server.metrics()["nanoserve:grammar_masked_tokens_total"] == 0  # nothing yet
    body = {**PLAIN, "max_tokens": 24, "structured_outputs": {"regex": REGEX}}
    url = server.url + "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def post(payload: dict) -> tuple[int, dict]:
            async with session.post(url, json=payload) as response:
                return response.status, await response.json()

        structured = asyncio.ensure_future(post(body))
        plain = []
        while not structured.done() or not plain:
            plain.append(await post(PLAIN))
        status, reply = await structured
    assert status == 200 and all(code == 200 for code, _ in plain)
    text = reply["choices"][0]["message"]["content"]
    assert re.fullmatch(r"[ab]*c*", text), text
    metrics = server.metrics()
    assert metrics["nanoserve:grammar_masked_tokens_total"] >= 24
    # the worker compiled the regex ahead, while the scheduler held the request
    assert metrics["nanoserve:grammar_holds_total"] == 1
    assert metrics["nanoserve:grammar_step_compiles_total"] == 0


async def test_a_slow_grammar_compiles_beside_a_running_stream(server, capsys):
    """A schema of 800 properties, each with its own pattern (tens of milliseconds to compile;
    docs/structured_outputs.md measures one of 2,500). The scheduler holds its request while
    the worker compiles it in a thread of its own: no step compiles a grammar
    (``grammar_step_compiles_total`` stays 0; it is 1 without the hold), a plain stream sent
    before it keeps its tokens coming, and the structured reply follows its schema. The
    stream's largest gap is printed."""
    schema = {
        "type": "object",
        "properties": {f"f{i}": {"type": "string", "pattern": f"^x{i}[a-z]+$"} for i in range(800)},
        "required": ["f0"],
    }
    before = server.metrics()
    url = server.url + "/v1/chat/completions"
    stream = {**PLAIN, "max_tokens": 64, "stream": True, "ignore_eos": True}
    body = {**PLAIN, "max_tokens": 12, "response_format": _schema_format(schema)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(url, json=stream) as streaming:
            lines = streaming.content.__aiter__()
            await anext(lines)  # the stream runs
            structured = asyncio.ensure_future(session.post(url, json=body))
            arrivals = [asyncio.get_running_loop().time()]
            async for line in lines:
                if line.startswith(b"data: {"):
                    arrivals.append(asyncio.get_running_loop().time())
        async with await structured as response:
            status, reply = response.status, await response.json()
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"].startswith('{"f0":"x0')
    after = server.metrics()
    assert after["nanoserve:grammar_holds_total"] == before["nanoserve:grammar_holds_total"] + 1
    assert after["nanoserve:grammar_compile_seconds_total"] > 0
    assert after["nanoserve:grammar_step_compiles_total"] == 0
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    with capsys.disabled():
        print(f"\nstream beside a slow compile: {len(gaps)} gaps, largest {max(gaps):.3f} s")


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}


async def test_the_client_suite_keeps_its_promises(server, capsys):
    """Each case of the subset through each gated mode at temperature 0 and 1: every reply
    validates against its model's schema, has no property the schema does not name (unless the
    schema allows them), and none is cut by max_tokens where the fields are bounded; the two
    reported extractions are whole at temperature 0 in every mode."""
    asks = [
        Ask(case(name), mode, temperature, compact=True, seed=seed)
        for temperature in (0.0, 1.0)
        for mode in GATED
        for seed, name in enumerate(SUBSET)
    ]
    outcomes = await asyncio.wait_for(run_suite(server.url, asks, concurrency=32), 600)
    with capsys.disabled():
        print("\n" + format_report(outcomes))
    for outcome in outcomes:
        where = (outcome.ask.mode, outcome.ask.case.name, outcome.ask.temperature)
        assert outcome.status == 200, (where, outcome.client_error)
        if outcome.ask.case.bounded or outcome.ask.temperature == 0:
            assert not outcome.cut, where
        if not outcome.cut:
            assert outcome.valid, (where, outcome.client_error, outcome.schema_error)
        if not outcome.ask.case.open:
            assert outcome.extra == [], (where, outcome.values)
    reported = [o for o in outcomes if o.ask.case.name in ("Ticket", "Person")]
    assert all(o.valid for o in reported if o.ask.temperature == 0)
    assert _extra_properties_appear(outcomes, "Settings"), "additionalProperties: true"


def _extra_properties_appear(outcomes: list[Outcome], name: str) -> bool:
    """Whether some reply of case ``name`` used the properties its schema allows."""
    named = set(case(name).model.model_json_schema()["properties"])
    return any(set(v) - named for o in outcomes if o.ask.case.name == name for v in o.values)


async def test_parallel_tools_and_json_mode(server):
    """instructor's PARALLEL_TOOLS sends tool_choice "auto": refused with OpenAI's 400 saying
    why (as vLLM refuses it without a tool-call parser). Its JSON mode depends on the model
    reading the schema in the prompt: recorded here, and the server answers it."""
    asks = [Ask(c, "instructor-parallel-tools", 0.0, True) for c in CASES[:2]]
    asks += [Ask(c, "instructor-json", 0.0, True, max_tokens=64) for c in CASES[:2]]
    outcomes = await asyncio.wait_for(run_suite(server.url, asks), 300)
    for outcome in outcomes[:2]:
        assert outcome.status == 400 and 'tool_choice "auto"' in outcome.client_error
    assert all(outcome.status == 200 for outcome in outcomes[2:])
    server.check_alive()
