"""Structured outputs and tool calls at the frontend, against the scripted fake scheduler: bad
specs get OpenAI-style 400s and never reach the scheduler, good ones travel as one grammar, each
grammar is compiled once, and a reply of tool calls comes back as OpenAI's tool_calls, whole
and streamed (the real model's replies: tests/e2e/test_structured.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from frontend.grammar_check import GrammarChecker
from protocol.params import MAX_GRAMMAR_CHARS
from tests.frontend.conftest import Server

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOLS = {"tools": [WEATHER, {"type": "function", "function": {"name": "get_time"}}]}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def schema_format(schema: Any, strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


def outputs(**spec: Any) -> dict[str, Any]:
    return {"structured_outputs": spec}


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": schema_format({"type": "objekt"})}, "response_format", "objekt"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    (
        {"response_format": schema_format({"type": "array", "uniqueItems": True})},
        "response_format",
        "uniqueItems",
    ),
    (outputs(regex="(abc"), "structured_outputs", "regex"),
    (outputs(grammar="start: foo"), "structured_outputs", "foo"),
    (outputs(grammar="root ::= ( "), "structured_outputs", "grammar"),
    (outputs(choice=[]), "structured_outputs", "choice"),
    (outputs(json="{not json"), "structured_outputs", "not JSON"),
    (outputs(regex="a", choice=["a"]), "structured_outputs", "exactly one"),
    (outputs(), "structured_outputs", "exactly one"),
    (TOOLS, "tool_choice", 'tools without tool_choice mean "auto"'),
    ({**TOOLS, "tool_choice": "auto"}, "tool_choice", "chat template does not show"),
    (
        {**TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({**TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "unique"),
    (
        {**TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tools",
        "both",
    ),
    (
        {"response_format": schema_format({"enum": ["x" * MAX_GRAMMAR_CHARS]})},
        "response_format",
        "characters",
    ),
]


@pytest.mark.parametrize(("extra", "param", "says"), BAD)
async def test_a_bad_spec_is_a_400(server: Server, extra: dict, param: str, says: str) -> None:
    response = await server.post("/v1/chat/completions", {**CHAT, **extra})
    assert response.status == 400
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"]
    assert server.fake.adds == []
    healthy = await server.http.get(server.url + "/health")
    assert healthy.status == 200


async def test_specs_travel_as_one_grammar(server: Server) -> None:
    nested = {"type": "object", "properties": {"who": PERSON}}
    bodies = [
        {**CHAT, "response_format": schema_format(nested)},
        {**CHAT, "response_format": schema_format(nested, strict=False)},
        {**CHAT, "response_format": {"type": "json_object"}},
        {**CHAT, "response_format": {"type": "text"}},
        {**CHAT, **TOOLS, "tool_choice": "none"},
        {"prompt": "Hi", "max_tokens": 8, **outputs(regex="[a-z]+")},
        {"prompt": "Hi", "max_tokens": 8, **outputs(choice=["yes", "no"])},
        {"prompt": "Hi", "max_tokens": 8, **outputs(grammar='root ::= "a" | "b"')},
        {"prompt": "Hi", "max_tokens": 8, **outputs(json=json.dumps(PERSON))},
    ]
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert (await server.post(path, body)).status == 200
    grammars = [add.params.grammar for add in server.fake.adds]
    strict, loose = (json.loads(g)["grammars"][0]["json_schema"] for g in grammars[:2])
    assert strict["additionalProperties"] is False
    assert strict["properties"]["who"]["additionalProperties"] is False
    assert (
        "additionalProperties" not in loose and loose["x-guidance"]["whitespace_flexible"] is False
    )
    assert grammars[2] is not None and grammars[3] is None and grammars[4] is None
    assert all(grammars[5:])


async def test_each_grammar_compiles_once(tokenizer) -> None:
    import llguidance

    checker = GrammarChecker(tokenizer)
    compiled = []
    compile_once = checker._compile
    checker._compile = lambda grammar: compiled.append(grammar) or compile_once(grammar)
    good = llguidance.grammar_from("regex", "[0-9]+")
    bad = llguidance.grammar_from("regex", "(")
    verdicts = await asyncio.gather(*[checker.error(g) for g in [good, bad] * 4])
    assert verdicts[0::2] == [""] * 4 and all(verdicts[1::2])
    assert compiled == [good, bad]


CALL = '[{"name":"get_weather","arguments":{"city":"Paris","days":2}},'
CALL += '{"name":"get_time","arguments":{}}]'


@pytest.mark.parametrize("named", [False, True])
async def test_tool_calls_whole_and_streamed(server: Server, tokenizer, named: bool) -> None:
    """The fake replies with a call's text (as the grammar would make the model write it):
    the openai client sees tool_calls, finish_reason "tool_calls", whole and streamed."""
    reply = '{"city":"Paris","days":2}' if named else CALL
    server.fake.reply = lambda request: tokenizer.encode(reply)
    choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args = dict(messages=CHAT["messages"], tools=TOOLS["tools"], tool_choice=choice)
    try:
        args["model"] = (await client.models.list()).data[0].id
        whole = await client.chat.completions.create(**args, max_tokens=64)
        async with client.chat.completions.stream(**args, max_tokens=64) as stream:
            streamed = await stream.get_final_completion()
        cut = await client.chat.completions.create(**args, max_tokens=5)
    finally:
        await client.close()
    want = [("get_weather", {"city": "Paris", "days": 2})] + ([] if named else [("get_time", {})])
    for completion in (whole, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        calls = choice.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert cut.choices[0].finish_reason == "length"
