"""OpenAI request bodies as typed msgspec structs: decoding checks every field's type.

Unknown fields are ignored (clients send many we do not use). Ranges and cross-field rules are
checked afterwards by ``RequestParser``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# vLLM's cache_salt: requests share cached prompt blocks only with requests of the same salt.
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ask for a final chunk that carries usage."""

    include_usage: bool = False


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


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
