"""OpenAI request bodies as typed msgspec structs: decoding checks every field's type.

Unknown fields are ignored (clients send many we do not use). Ranges and cross-field rules are
checked afterwards by ``RequestParser``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# vLLM's cache_salt: requests share cached prompt blocks only with requests of the same salt.
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ask for a final chunk that carries usage."""

    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: the schema a reply must follow. ``strict`` closes every
    object the schema leaves open (``additionalProperties: false``)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema (an object or its text), a
    regular expression, a list of choices, a Lark or EBNF (GBNF) grammar, or any JSON object;
    and vLLM's two JSON switches (None: the server's), which also apply to the schema of
    ``response_format`` or ``tools``."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


class Speculative(msgspec.Struct, kw_only=True):
    """nanoserve's ``speculative``: ``num_tokens`` draft tokens at most per step for this
    request (0: none; None: the server's ``--num-speculative-tokens``)."""

    num_tokens: int | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: CacheSalt | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    speculative: Speculative | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. ``prompt`` is text, one text in a list, or token ids."""

    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only ``{"type": "text"}`` parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message of a conversation."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A tool's function: its name and the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    """One entry of ``tools``; only ``{"type": "function"}`` tools exist."""

    type: str
    function: FunctionDefinition


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming the one function the reply must call."""

    type: str
    function: FunctionName


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
