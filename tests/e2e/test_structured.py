"""Structured outputs end to end: the real default model behind the three real processes, asked
through the official openai client. Pydantic models parse on every prompt at temperature 0 and
1; regex, choice, Lark and EBNF replies match at temperature 1; the reported extraction gets
exactly its model's properties, unless the schema or the request opens its objects; bad specs
get 400s and leave the server healthy. (Tool calls and the sampling options:
test_tool_calls.py; the clients people use: test_structured_clients.py.)"""

from __future__ import annotations

import asyncio
import json
import re
from enum import Enum
from typing import Annotated

import aiohttp
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SUBJECTS = [
    "a retired sailor from Lisbon",
    "a young chess champion",
    "a baker who loves jazz",
    "an astronaut training for Mars",
    "a librarian in a small town",
    "a marathon runner from Kenya",
    "a painter who lives by the sea",
    "a robot that works in a hospital",
    "a teenage inventor",
    "a grandmother who keeps bees",
    "a fisherman in Norway",
    "a violin teacher in Vienna",
    "a firefighter in Chicago",
    "a botanist studying cacti",
    "a pilot who flies small planes",
    "a chef at a noodle shop",
    "a dog trainer",
    "a detective in an old novel",
    "a farmer who grows rice",
    "a student learning Japanese",
]
# Every string and array is bounded, so a complete reply always fits in MAX_TOKENS, even one
# whose strings are all characters of several tokens each (typical replies take 50-100).
MAX_TOKENS = 320
Word = Annotated[str, Field(max_length=16)]


class Mood(str, Enum):
    happy = "happy"
    calm = "calm"
    tired = "tired"


class Place(BaseModel):
    city: Word
    country: Word


class Profile(BaseModel):
    name: Word
    age: int = Field(ge=0, le=120)
    mood: Mood
    home: Place
    hobbies: list[Word] = Field(max_length=3)
    nickname: str | None = Field(default=None, max_length=12)


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ask(subject: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {subject} as a profile."}]


async def test_pydantic_models_parse_at_temperature_0_and_1(server):
    """``client.chat.completions.parse`` (openai's strict JSON schema of the model: nested
    objects, an enum, an array, an optional field) parses on all 20 prompts, at both
    temperatures, all 40 requests at once."""

    async def parse(client: openai.AsyncOpenAI, subject: str, temperature: float, seed: int):
        completion = await client.chat.completions.parse(
            model=MODEL,
            messages=_ask(subject),
            response_format=Profile,
            temperature=temperature,
            seed=seed,
            max_tokens=MAX_TOKENS,
        )
        return completion.choices[0]

    async with _client(server) as client:
        calls = [
            parse(client, subject, temperature, seed)
            for temperature in (0.0, 1.0)
            for seed, subject in enumerate(SUBJECTS)
        ]
        choices = await asyncio.wait_for(asyncio.gather(*calls), timeout=240)
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Profile), choice.message.content
    hot = [c.message.parsed for c in choices[len(SUBJECTS) :]]
    assert len({p.name for p in hot}) > 10, "temperature 1 should vary the replies"


DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
MOODS = ["positive", "negative", "neutral"]
# Sums of one to three numbers below 1000, as Lark and as EBNF (GBNF).
LARK = 'start: NUMBER (OP NUMBER)? (OP NUMBER)?\nOP: " + " | " - "\nNUMBER: /[1-9][0-9]{0,2}/\n'
GBNF = 'root ::= num (op num)? (op num)?\nop ::= " + " | " - "\nnum ::= [1-9] [0-9]? [0-9]?\n'
SUM = re.compile(r"[1-9][0-9]{0,2}( [+-] [1-9][0-9]{0,2}){0,2}")
SPECS = [
    ({"regex": DATE}, "When was {} born? Give the date.", re.compile(DATE)),
    ({"choice": MOODS}, "Is {} a happy story?", re.compile("|".join(MOODS))),
    ({"grammar": LARK}, "Write a small sum about {}.", SUM),
    ({"grammar": GBNF}, "Write a small sum about {}.", SUM),
]


async def test_regex_choice_and_grammars_match_at_temperature_1(server):
    """Each of regex, choice, a Lark grammar and an EBNF grammar, on 20 prompts at temperature
    1 (seeded), all 80 at once: every reply matches in full and ends by itself."""

    async def one(client: openai.AsyncOpenAI, spec: dict, prompt: str, seed: int):
        completion = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=1.0,
            seed=seed,
            max_tokens=32,
            extra_body={"structured_outputs": spec},
        )
        return completion.choices[0]

    async with _client(server) as client:
        calls = [
            one(client, spec, prompt.format(subject), seed)
            for spec, prompt, _ in SPECS
            for seed, subject in enumerate(SUBJECTS)
        ]
        choices = await asyncio.wait_for(asyncio.gather(*calls), timeout=240)
    for k, (_, _, pattern) in enumerate(SPECS):
        replies = choices[k * len(SUBJECTS) : (k + 1) * len(SUBJECTS)]
        for choice in replies:
            assert choice.finish_reason == "stop"
            assert pattern.fullmatch(choice.message.content), (pattern, choice.message.content)
        if pattern.pattern != "|".join(MOODS):
            assert len({c.message.content for c in replies}) > 5, "temperature 1 should vary"


# The extraction a client reported: with open objects, the model added a "description" it
# never ended, until max_tokens.
TICKET_PROMPT = "Make a ticket: typo in the footer copyright year, fix whenever."


async def test_the_reported_ticket_gets_exactly_its_fields_unless_objects_are_open(server):
    """instructor's JSON_SCHEMA request (a json_schema, not strict), greedy, max_tokens 200:
    exactly the model's three properties, whole. The schema's own additionalProperties: true,
    or the request's disable_additional_properties: false (the permissive behaviour), let the
    model add a property the model never named, as it did before objects were closed."""
    from nanoserve.bench.structured_cases import Ticket

    schema = Ticket.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "Ticket", "schema": schema}}
    opened = {
        **fmt,
        "json_schema": {"name": "Ticket", "schema": {**schema, "additionalProperties": True}},
    }
    permissive = {"structured_outputs": {"disable_additional_properties": False}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": TICKET_PROMPT}],
        "temperature": 0,
        "max_tokens": 200,
    }
    bodies = [
        {**body, "response_format": fmt},
        {**body, "response_format": opened},
        {**body, "response_format": fmt, **permissive},
    ]
    async with aiohttp.ClientSession() as session:

        async def post(payload: dict) -> dict:
            async with session.post(server.url + "/v1/chat/completions", json=payload) as response:
                assert response.status == 200
                return (await response.json())["choices"][0]

        closed, *open_replies = await asyncio.gather(*(post(b) for b in bodies))
    assert closed["finish_reason"] == "stop"
    assert set(json.loads(closed["message"]["content"])) == {"title", "priority", "tags"}
    for choice in open_replies:
        keys = set(re.findall(r'"([A-Za-z_]+)":', choice["message"]["content"]))
        assert keys - {"title", "priority", "tags"}, choice["message"]["content"]


TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}
BAD_SPECS = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "obj"}}}},
        "response_format",
    ),
    ({"structured_outputs": {"regex": "([a-z]+"}}, "structured_outputs"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_SPECS)
async def test_bad_specs_get_a_400_and_the_server_stays_healthy(server, extra, param):
    """A malformed schema, an invalid regex and the unsupported "auto": OpenAI's error body,
    /health stays 200 and the next request is served."""
    body = {"model": MODEL, "messages": _ask("a cat"), "max_tokens": 4, **extra}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert error["message"]
        async with session.get(server.url + "/health") as health:
            assert health.status == 200
    simple = {"model": MODEL, "messages": _ask("a cat"), "max_tokens": 4}
    async with _client(server) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(**simple, extra_body=extra)
        fine = await client.chat.completions.create(**simple)
    assert raised.value.status_code == 400
    assert fine.choices[0].message.content
    server.check_alive()
