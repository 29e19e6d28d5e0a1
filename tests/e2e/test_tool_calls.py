"""Tool calls and constrained sampling end to end, through the official openai client against
the real default model and processes: tool_choice "required" and named give tool_calls whose
arguments validate against the function's schema, whole and streamed; constraints compose with
every sampling option; a reply cut by max_tokens says "length"."""

from __future__ import annotations

import asyncio
import json
import math

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 40},
                "filters": {
                    "type": "object",
                    "properties": {
                        "site": {"type": "string", "maxLength": 20},
                        "recent": {"type": "boolean"},
                    },
                    "required": ["recent"],
                },
            },
            "required": ["query", "filters"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
PROMPTS = [
    "What's the weather in Paris this weekend?",
    "Find me recent news about electric cars.",
    "Will it rain in Tokyo tomorrow?",
    "Search for the best pizza recipe.",
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# (tool_choice, parallel_tool_calls, temperature). Parallel calls only greedy: at temperature 1
# a model that never saw the tools may chain calls past any max_tokens.
MODES = [("required", False, 1.0), ("required", True, 0.0), (NAMED, True, 1.0), (NAMED, True, 0.0)]


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def _call(client: openai.AsyncOpenAI, stream: bool, **args) -> tuple[str, list, str | None]:
    """(finish_reason, [(id, name, arguments)], content) of one choice, whole or streamed
    (the deltas put together by index, as a client does)."""
    args = {"model": MODEL, "tools": TOOLS, "max_tokens": 192, **args}
    if not stream:
        choice = (await client.chat.completions.create(**args)).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        return choice.finish_reason, calls, choice.message.content
    parts: dict[int, list] = {}
    finish, content = None, ""
    async for chunk in await client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                parts[call.index] = [call.id, call.function.name, ""]
            parts[call.index][2] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return finish, [tuple(parts[i]) for i in sorted(parts)], content or None


async def test_required_and_named_calls_validate_whole_and_streamed(server):
    """4 prompts x 4 modes x whole/streamed, all at once: every reply is tool_calls, with no
    content, ids, the right names, and arguments valid under the function's schema."""
    async with _client(server) as client:
        calls = [
            _call(
                client,
                stream,
                messages=[{"role": "user", "content": prompt}],
                tool_choice=choice,
                parallel_tool_calls=parallel,
                temperature=temperature,
                seed=seed,
            )
            for seed, prompt in enumerate(PROMPTS)
            for choice, parallel, temperature in MODES
            for stream in (False, True)
        ]
        replies = await asyncio.wait_for(asyncio.gather(*calls), timeout=240)
    modes = [(c, p) for _prompt in PROMPTS for c, p, _t in MODES for _stream in (False, True)]
    for (choice, parallel), (finish, tool_calls, content) in zip(modes, replies, strict=True):
        assert finish == "tool_calls" and not content, (finish, tool_calls, content)
        assert len(tool_calls) == 1 or (choice == "required" and parallel and tool_calls)
        for call_id, name, arguments in tool_calls:
            assert call_id.startswith("call_")
            assert name == "get_weather" if choice == NAMED else name in SCHEMAS
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: str = Field(pattern=r"^(cat|dog|fish)$")
    age: int = Field(ge=0, le=30)


async def test_constraints_compose_with_every_sampling_option(server):
    """n=3 with temperature, top-p, top-k, three penalties, a huge bias towards a token the
    schema forbids, and logprobs: every choice parses; each has its own logprobs. A stop
    string cuts the reply ("stop"); max_tokens cuts it too, and then says "length"."""
    newline = 198  # "\n" in SmolLM2's vocabulary: never allowed by compact JSON
    messages = [{"role": "user", "content": "Describe a pet."}]
    options = dict(
        model=MODEL,
        messages=messages,
        response_format=Pet,
        n=3,
        temperature=0.9,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={str(newline): 100},
        logprobs=True,
        top_logprobs=2,
        seed=7,
        max_tokens=96,
        extra_body={"top_k": 40, "repetition_penalty": 1.1},
    )
    async with _client(server) as client:
        whole = await client.chat.completions.parse(**options)
        cut = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, response_format={"type": "json_object"}
        )
        stopped = await client.chat.completions.create(
            **{**options, "response_format": {"type": "json_object"}, "n": 1, "stop": [","]}
        )
        with pytest.raises(openai.LengthFinishReasonError):
            await client.chat.completions.parse(**{**options, "max_tokens": 3})
    assert len(whole.choices) == 3
    for choice in whole.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)
        assert "\n" not in choice.message.content
        assert choice.logprobs.content
        assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in choice.logprobs.content)
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert len({c.message.content for c in whole.choices}) > 1, "choices should differ"
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4
    text = stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop" and text.startswith("{") and "," not in text


async def test_a_call_cut_by_max_tokens_says_length(server):
    async with _client(server) as client:
        for stream in (False, True):
            messages = [{"role": "user", "content": PROMPTS[0]}]
            finish, _, _ = await _call(
                client, stream, messages=messages, tool_choice="required", max_tokens=6
            )
            assert finish == "length"
    server.check_alive()
