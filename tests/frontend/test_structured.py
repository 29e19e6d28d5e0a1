"""Structured outputs and tool calls at the frontend, against the scripted fake scheduler: bad
specs get OpenAI-style 400s and never reach the scheduler; good ones travel as one grammar, whose
objects are closed unless the schema, the request or the server says otherwise (checked by
running the grammar over replies); each grammar is compiled once, and one that compiles for too
long is a 400 that nobody else waits for; a reply of tool calls comes back as OpenAI's
tool_calls, whole and streamed (the real model's replies: tests/e2e/test_structured.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import openai
import pytest

from frontend.config import FrontendConfig
from frontend.grammar_check import GrammarChecker
from frontend.json_schema import JsonOptions, close_objects
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


# A Lark alternation of 3,000 regex terminals: it compiles, then fails at its first mask.
TERMINALS = "start: " + " | ".join(f"t{i}" for i in range(3000)) + "\n"
TERMINALS += "".join(f"t{i}: /[a-z]{{1,60}}{i}[a-z ]{{0,60}}/\n" for i in range(3000))
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
    (outputs(grammar=TERMINALS), "structured_outputs", "too many expressions"),
    (outputs(grammar="root ::= " + "a" * MAX_GRAMMAR_CHARS), "structured_outputs", "over"),
    (outputs(choice=[]), "structured_outputs", "choice"),
    (outputs(json="{not json"), "structured_outputs", "not JSON"),
    (outputs(regex="a", choice=["a"]), "structured_outputs", "exactly one"),
    (outputs(json_object=True, regex="a"), "structured_outputs", "exactly one"),
    (outputs(), "structured_outputs", "exactly one"),
    (outputs(disable_any_whitespace=True), "structured_outputs", "got none"),
    (outputs(json_object=False), "structured_outputs", "got none"),
    (
        {"response_format": {"type": "json_object"}, **outputs(regex="a")},
        "structured_outputs",
        "both",
    ),
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
    bodies = [
        {**CHAT, "response_format": {"type": "json_object"}},
        {**CHAT, "response_format": {"type": "text"}},
        {**CHAT, **TOOLS, "tool_choice": "none"},
        {"prompt": "Hi", "max_tokens": 8, **outputs(regex="[a-z]+")},
        {"prompt": "Hi", "max_tokens": 8, **outputs(choice=["yes", "no"])},
        {"prompt": "Hi", "max_tokens": 8, **outputs(grammar='root ::= "a" | "b"')},
        {"prompt": "Hi", "max_tokens": 8, **outputs(json=json.dumps(PERSON))},
        {"prompt": "Hi", "max_tokens": 8, **outputs(json_object=True)},
    ]
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert (await server.post(path, body)).status == 200
    grammars = [add.params.grammar for add in server.fake.adds]
    assert grammars[0] is not None and grammars[1] is None and grammars[2] is None
    assert all(grammars[3:])


# A person with a nested address: the replies below are run through each request's grammar.
ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NESTED = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "home": ADDRESS},
    "required": ["name", "home"],
}
EXACT = '{"name":"Ann","home":{"city":"Oslo"}}'
EXTRA_TOP = '{"name":"Ann","home":{"city":"Oslo"},"country":"Norway"}'
EXTRA_NESTED = '{"name":"Ann","home":{"city":"Oslo","zip":"0150"}}'
SPACED = '{"name": "Ann", "home": {"city": "Oslo"}}'
LOOSE = {"disable_additional_properties": False}
FLEXIBLE = {"disable_any_whitespace": False}


@pytest.fixture(scope="module")
def accepts(tokenizer) -> Callable[[str, str], bool]:
    """``accepts(grammar, reply)``: whether the grammar lets the model write exactly ``reply``
    (then stop), over the model's vocabulary (built once: it takes a while)."""
    import llguidance

    vocabulary = llguidance.LLTokenizer(
        tokenizer.tokenizer.to_str(),
        n_vocab=tokenizer.vocab_size,
        eos_token=list(tokenizer.eos_token_ids),
    )

    def check(grammar: str, reply: str) -> bool:
        matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.encode(reply)) and matcher.is_accepting()

    return check


def schema_bodies(schema: dict, **options: Any) -> list[dict[str, Any]]:
    """The same schema through each field that brings one (``options``: structured_outputs')."""
    extra = outputs(**options) if options else {}
    function = {"type": "function", "function": {"name": "save", "parameters": schema}}
    named = {"type": "function", "function": {"name": "save"}}
    return [
        {**CHAT, "response_format": schema_format(schema, strict=False), **extra},
        {**CHAT, **outputs(json=schema, **options)},
        {**CHAT, "tools": [function], "tool_choice": named, **extra},
    ]


async def grammars_of(server: Server, bodies: list[dict[str, Any]]) -> list[str]:
    for body in bodies:
        response = await server.post("/v1/chat/completions", body)
        assert response.status == 200, await response.text()
    return [add.params.grammar for add in server.fake.adds[-len(bodies) :]]


async def test_objects_are_closed_and_compact_by_default(server: Server, accepts) -> None:
    """response_format (not strict), structured_outputs.json and a function's parameters: no
    property the schema does not name, at any depth, and no free whitespace."""
    for grammar in await grammars_of(server, schema_bodies(NESTED)):
        assert accepts(grammar, EXACT)
        assert not accepts(grammar, EXTRA_TOP)
        assert not accepts(grammar, EXTRA_NESTED)
        assert not accepts(grammar, SPACED)


async def test_the_request_may_open_objects_and_free_whitespace(server: Server, accepts) -> None:
    """vLLM's structured_outputs switches, beside each field: objects open, whitespace free."""
    for grammar in await grammars_of(server, schema_bodies(NESTED, **LOOSE, **FLEXIBLE)):
        for reply in (EXACT, EXTRA_TOP, EXTRA_NESTED, SPACED):
            assert accepts(grammar, reply), reply


async def test_what_the_schema_says_is_honoured(server: Server, accepts) -> None:
    """additionalProperties true, or a schema, allows extra properties (of that schema); a
    free-form object ({"type": "object"}) stays free; strict closes even when the request
    opens objects."""
    free_home = {**NESTED, "properties": {**NESTED["properties"], "home": {"type": "object"}}}
    typed = {**NESTED, "additionalProperties": {"type": "integer"}}
    opened = {**NESTED, "additionalProperties": True}
    for grammar in await grammars_of(server, schema_bodies(opened)):
        assert accepts(grammar, EXTRA_TOP)
        assert not accepts(grammar, EXTRA_NESTED)
    for grammar in await grammars_of(server, schema_bodies(typed)):
        assert accepts(grammar, EXACT[:-1] + ',"age":7}')
        assert not accepts(grammar, EXTRA_TOP)
    for grammar in await grammars_of(server, schema_bodies(free_home)):
        assert accepts(grammar, EXTRA_NESTED)
        assert not accepts(grammar, EXTRA_TOP)
    function = {"name": "f", "parameters": NESTED, "strict": True}
    strict = [
        {**CHAT, "response_format": schema_format(NESTED, strict=True), **outputs(**LOOSE)},
        {**CHAT, "tools": [{"type": "function", "function": function}], "tool_choice": "required"},
    ]
    strict[1].update(outputs(**LOOSE))
    as_format, as_call = await grammars_of(server, strict)
    assert accepts(as_format, EXACT) and not accepts(as_format, EXTRA_TOP)
    call = '[{{"name":"f","arguments":{}}}]'
    assert accepts(as_call, call.format(EXACT)) and not accepts(as_call, call.format(EXTRA_TOP))


def test_close_objects_closes_what_names_its_members_and_leaves_the_rest() -> None:
    """Closed: objects naming properties or patternProperties, in $defs, items, anyOf and the
    members of an allOf's parts. Untouched: an explicit additionalProperties, a free-form
    object, an allOf's parts and their holder (closed apart, each would forbid the other's)."""
    part_a = {"properties": {"a": {"type": "object", "properties": {"x": {}}}}}
    part_b = {"properties": {"b": {}}}
    schema = {
        "type": "object",
        "properties": {
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "either": {"anyOf": [{"patternProperties": {"^z": {}}}, {"type": "null"}]},
            "free": {"type": "object"},
            "typed": {"properties": {"t": {}}, "additionalProperties": {"type": "integer"}},
            "both": {"properties": {"c": {}}, "allOf": [part_a, part_b]},
        },
        "$defs": {"Ref": {"properties": {"r": {}}}},
    }
    closed = close_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["Ref"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["typed"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in props["both"]
    part_a_closed, part_b_closed = props["both"]["allOf"]
    assert (
        "additionalProperties" not in part_a_closed and "additionalProperties" not in part_b_closed
    )
    assert part_a_closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy: the request's schema is untouched


async def test_an_allof_composition_keeps_every_part(server: Server, accepts) -> None:
    """Closed by default, an allOf of two parts still takes both parts' properties."""
    schema = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {}}}]}
    (grammar,) = await grammars_of(server, [{**CHAT, **outputs(json=schema)}])
    assert accepts(grammar, '{"a":1,"b":"x"}')


def test_the_command_line_defaults_are_the_configs() -> None:
    """nanoserve frontend's structured-outputs flags default to FrontendConfig's fields."""
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(["frontend"])
    config = FrontendConfig()
    for name in ("disable_any_whitespace", "disable_additional_properties"):
        assert getattr(args, name) is getattr(config, name) is True
    assert args.grammar_compile_timeout == config.grammar_compile_timeout


@pytest.mark.frontend(disable_additional_properties=False, disable_any_whitespace=False)
async def test_the_server_options_restore_open_objects(server: Server, accepts) -> None:
    """--no-disable-additional-properties and --no-disable-any-whitespace: schemas compile as
    JSON Schema reads them (open objects, free whitespace), and a request may still close."""
    for grammar in await grammars_of(server, schema_bodies(NESTED)):
        for reply in (EXACT, EXTRA_TOP, EXTRA_NESTED, SPACED):
            assert accepts(grammar, reply), reply
    closed = {"disable_additional_properties": True, "disable_any_whitespace": True}
    for grammar in await grammars_of(server, schema_bodies(NESTED, **closed)):
        assert accepts(grammar, EXACT)
        assert not accepts(grammar, EXTRA_NESTED)
        assert not accepts(grammar, SPACED)


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


# 3,500 string properties, each with its own pattern: it compiles in about 1.7 s here, far
# past the limit these tests set.
SLOW = {
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,40}}{i}[a-z]*$"} for i in range(3500)
    },
}
LIMIT = 0.3


async def test_a_grammar_past_the_limit_is_refused_while_others_compile(tokenizer) -> None:
    """The slow grammar's verdict comes at the limit, while its compile runs on; a new grammar
    compiles meanwhile; asked again, the slow one is refused at once, compiled only once."""
    import llguidance

    checker = GrammarChecker(tokenizer, timeout=LIMIT)
    slow = JsonOptions().grammar(SLOW)
    compiled, slow_done = [], threading.Event()
    compile_once = checker._compile

    def compile_noted(grammar: str) -> str:
        verdict = compile_once(grammar)
        compiled.append(grammar)
        if grammar == slow:
            slow_done.set()
        return verdict

    checker._compile = compile_noted
    assert await checker.error(llguidance.grammar_from("regex", "[a-z]+")) == ""  # vocabulary
    verdict = await checker.error(slow)
    assert verdict == f"the grammar takes longer than {LIMIT:g} s to compile"
    assert not slow_done.is_set()
    quick = llguidance.grammar_from("regex", "[0-9]{2,4}")
    assert await checker.error(quick) == ""
    assert not slow_done.is_set(), "the new grammar waited for the slow one"
    assert await asyncio.to_thread(slow_done.wait, 60)
    assert await checker.error(slow) == verdict
    assert compiled.count(slow) == 1


@pytest.mark.frontend(grammar_compile_timeout=LIMIT)
async def test_a_slow_grammar_is_a_400_and_the_others_are_served(server: Server) -> None:
    """Sent together: the plain request is answered before the slow grammar's 400, which names
    the field and the limit; the scheduler never sees the slow grammar."""
    slow_body = {**CHAT, "response_format": schema_format(SLOW, strict=False)}
    finished: list[str] = []

    async def post(name: str, body: dict[str, Any]) -> int:
        response = await server.post("/v1/chat/completions", body)
        finished.append(name)
        return response.status

    warm = {**CHAT, **outputs(regex="[a-z]+")}
    assert await post("warm", warm) == 200  # the vocabulary is built
    slow = asyncio.ensure_future(post("slow", slow_body))
    plain = await post("plain", CHAT)
    assert await slow == 400 and plain == 200
    assert finished == ["warm", "plain", "slow"]
    response = await server.post("/v1/chat/completions", slow_body)
    error = (await response.json())["error"]
    assert response.status == 400 and error["param"] == "response_format"
    assert f"takes longer than {LIMIT:g} s" in error["message"]
    assert [add.params.grammar is None for add in server.fake.adds] == [False, True]


CALL = '[{"name":"get_weather","arguments":{"city":"Paris","days":2}},'
CALL += '{"name":"get_time","arguments":{}}]'


@pytest.mark.parametrize("named", [False, True])
async def test_tool_calls_whole_and_streamed(server: Server, tokenizer, named: bool) -> None:
    """The fake replies with a call's text (as the grammar would make the model write it):
    the openai client sees tool_calls, finish_reason "tool_calls", whole and streamed (its
    ``stream`` helper takes strict functions only)."""
    reply = '{"city":"Paris","days":2}' if named else CALL
    server.fake.reply = lambda request: tokenizer.encode(reply)
    choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    tools = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS["tools"]]
    args = dict(messages=CHAT["messages"], tools=tools, tool_choice=choice)
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
