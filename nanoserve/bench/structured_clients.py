"""The structured-outputs client suite: the clients people use, against a server, every reply
checked on its own.

Modes (how a client asks for a Pydantic model):

- ``openai-parse``: the official client's ``chat.completions.parse`` (a strict json_schema);
- ``instructor-json-schema``: instructor's ``JSON_SCHEMA`` (a json_schema, not strict);
- ``instructor-tools``: instructor's ``TOOLS`` (one function, a named ``tool_choice``);
- ``instructor-parallel-tools``: instructor's ``PARALLEL_TOOLS`` (``Iterable[Model]``: tools
  with ``tool_choice`` "auto");
- ``http-structured-outputs``: a plain aiohttp POST with vLLM's ``structured_outputs.json``;
- ``instructor-json``: instructor's ``JSON`` (``json_object``; the schema only in the prompt).
  It depends on the model reading the schema: recorded, never gated (``GATED``).

Every request goes through its own HTTP client, which keeps the server's reply whatever the
client library then makes of it. Each JSON value in a reply (its content, or each tool call's
arguments) is checked against the model's own JSON schema (jsonschema), and for properties the
schema does not name. vLLM's ``disable_any_whitespace`` and ``disable_additional_properties``
are sent with every request, so one server measures each setting. Needs the ``test`` extra
(openai, instructor, jsonschema).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve.bench.structured_check import extra_properties, schema_error

if TYPE_CHECKING:  # pydantic loads with the cases, not with the command line
    from nanoserve.bench.structured_cases import Case

MAX_TOKENS = 200  # what the reported client sent; every bounded case fits in it

MODES = (
    "openai-parse",
    "instructor-json-schema",
    "instructor-tools",
    "instructor-parallel-tools",
    "http-structured-outputs",
    "instructor-json",
)
GATED = MODES[:-1]  # instructor-json is recorded, not held to the suite's promises
_INSTRUCTOR = {
    "instructor-json-schema": "JSON_SCHEMA",
    "instructor-tools": "TOOLS",
    "instructor-parallel-tools": "PARALLEL_TOOLS",
    "instructor-json": "JSON",
}


@dataclass(frozen=True)
class Ask:
    """One request of the suite: a case, through a mode, at a temperature and whitespace."""

    case: Case
    mode: str
    temperature: float
    compact: bool  # disable_any_whitespace
    seed: int = 0
    max_tokens: int = MAX_TOKENS
    closed: bool = True  # disable_additional_properties

    @property
    def switches(self) -> dict[str, bool]:
        """vLLM's two JSON switches, as ``structured_outputs`` sends them."""
        return {
            "disable_any_whitespace": self.compact,
            "disable_additional_properties": self.closed,
        }


@dataclass
class Outcome:
    """What came back for one ``Ask``, and what the checks found."""

    ask: Ask
    status: int | None = None  # the server's HTTP status
    finish_reason: str | None = None
    completion_tokens: int = 0
    values: list[Any] = field(default_factory=list)  # the reply's JSON values
    client_error: str | None = None  # what the client library raised
    schema_error: str | None = None  # the first value that breaks the model's schema
    extra: list[str] = field(default_factory=list)  # properties the schema does not name

    @property
    def cut(self) -> bool:
        """Cut by max_tokens."""
        return self.finish_reason == "length"

    @property
    def valid(self) -> bool:
        """The client took it, it has values, and every one follows the schema."""
        return not (self.client_error or self.schema_error) and bool(self.values)

    def row(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        ask = self.ask
        return {
            "case": ask.case.name,
            "mode": ask.mode,
            "temperature": ask.temperature,
            "compact": ask.compact,
            "closed": ask.closed,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "completion_tokens": self.completion_tokens,
            "valid": self.valid,
            "extra": self.extra,
            "client_error": self.client_error,
            "schema_error": self.schema_error,
            "values": self.values,
        }


async def run_suite(
    base_url: str, asks: Iterable[Ask], concurrency: int = 32, model: str | None = None
) -> list[Outcome]:
    """Send every ask (``concurrency`` at once) and check every reply; in the asks' order."""
    logging.getLogger("instructor").setLevel(logging.CRITICAL)  # its failures are outcomes here
    model = model or await served_model(base_url)
    gate = asyncio.Semaphore(concurrency)

    async def one(ask: Ask) -> Outcome:
        async with gate:
            return await ask_once(base_url, model, ask)

    return list(await asyncio.gather(*(one(ask) for ask in asks)))


async def served_model(base_url: str) -> str:
    """The first model ``/v1/models`` lists."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as response:
            return (await response.json())["data"][0]["id"]


async def ask_once(base_url: str, model: str, ask: Ask) -> Outcome:
    """One request through its mode's client; the server's reply checked."""
    outcome = Outcome(ask)
    bodies: list[tuple[int, Any]] = []
    try:
        if ask.mode == "http-structured-outputs":
            await _http(base_url, model, ask, bodies)
        else:
            await _client(base_url, model, ask, bodies)
    except Exception as exc:  # noqa: BLE001 - what the client raised is the finding
        said = " ".join(str(exc).split())  # one line
        outcome.client_error = f"{type(exc).__name__}: {said[:300]}"
    if bodies:
        outcome.status, body = bodies[-1]
        _read_reply(outcome, body)
    _check(outcome)
    return outcome


def _messages(ask: Ask) -> list[dict[str, str]]:
    return [{"role": "user", "content": ask.case.prompt}]


def _options(ask: Ask) -> dict[str, Any]:
    return {"temperature": ask.temperature, "seed": ask.seed, "max_tokens": ask.max_tokens}


async def _http(base_url: str, model: str, ask: Ask, bodies: list) -> None:
    import aiohttp

    spec = {"json": ask.case.model.model_json_schema(), **ask.switches}
    body = {"model": model, "messages": _messages(ask), "structured_outputs": spec}
    url = base_url.rstrip("/") + "/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={**body, **_options(ask)}) as response:
            bodies.append((response.status, await response.json()))
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")


async def _client(base_url: str, model: str, ask: Ask, bodies: list) -> None:
    """openai's parse or an instructor mode, through an HTTP client that keeps each reply."""
    import openai

    async def keep(response: Any) -> None:  # the HTTP library's response (httpx's API)
        await response.aread()
        bodies.append((response.status_code, response.json()))

    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [keep]}, timeout=600)
    client = openai.AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0, http_client=http
    )
    args = dict(model=model, messages=_messages(ask), **_options(ask))
    args["extra_body"] = {"structured_outputs": ask.switches}
    try:
        if ask.mode == "openai-parse":
            await client.chat.completions.parse(response_format=ask.case.model, **args)
            return
        import instructor

        mode = getattr(instructor.Mode, _INSTRUCTOR[ask.mode])
        patched = instructor.from_openai(client, mode=mode)
        wanted: Any = ask.case.model
        if ask.mode == "instructor-parallel-tools":
            wanted = Iterable[ask.case.model]
        result, _ = await patched.chat.completions.create_with_completion(
            response_model=wanted, max_retries=0, **args
        )
        if ask.mode == "instructor-parallel-tools":
            list(result)  # the calls parse as they are iterated
    finally:
        await client.close()


def _read_reply(outcome: Outcome, body: Any) -> None:
    """The finish reason, token count and JSON values of the server's reply."""
    if outcome.status != 200 or not isinstance(body, dict) or not body.get("choices"):
        return
    choice = body["choices"][0]
    outcome.finish_reason = choice.get("finish_reason")
    outcome.completion_tokens = (body.get("usage") or {}).get("completion_tokens", 0)
    message = choice.get("message") or {}
    texts = [call["function"]["arguments"] for call in message.get("tool_calls") or []]
    if not texts and message.get("content"):
        texts = [message["content"]]
    for text in texts:
        try:
            outcome.values.append(json.loads(text))
        except ValueError:
            outcome.schema_error = outcome.schema_error or f"not JSON: {text[:120]!r}"


def _check(outcome: Outcome) -> None:
    schema = outcome.ask.case.model.model_json_schema()
    for value in outcome.values:
        outcome.schema_error = outcome.schema_error or schema_error(value, schema)
        outcome.extra.extend(extra_properties(value, schema))
