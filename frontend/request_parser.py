"""RequestParser: an OpenAI request body -> prompt token ids + SamplingParams, or ApiError."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from frontend.config import FrontendConfig
from frontend.errors import ApiError
from frontend.geometry import Geometry
from frontend.grammar_check import GrammarChecker
from frontend.json_schema import JsonOptions
from frontend.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from frontend.structured import Constraint, constraint_for
from frontend.tool_calls import ToolChoice
from models.tokenizer import ChatTokenizer
from protocol.messages import SamplingParams
from protocol.params import ParamError, RequestLimits, check_params

_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
_SEED_LIMIT = 1 << 63
_LOGPROBS = {False: "logprobs", True: "top_logprobs"}  # the body's name for SamplingParams'


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: what to send to the scheduler and how to answer."""

    chat: bool
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    logprobs: int | None
    cache_salt: str | None = None  # the prefix cache is shared only between equal salts
    constraint: Constraint | None = None  # the grammar of a structured reply (params.grammar)

    @property
    def tools(self) -> ToolChoice | None:
        """The tool call its reply must be (tool_choice "required" or named), or None."""
        return self.constraint.tools if self.constraint is not None else None

    def params_for(self, index: int) -> SamplingParams:
        """The params of choice ``index``: seeded requests get seed + index, so choices differ."""
        if self.params.seed is None or index == 0:
            return self.params
        return msgspec.structs.replace(self.params, seed=self.params.seed + index)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _given(value: float | None, default: float) -> float:
    """A float field of the body, or its default when left out (or null)."""
    return default if value is None else float(value)


class RequestParser:
    """Validates bodies against the config, the tokenizer's vocab and the scheduler geometry."""

    def __init__(self, config: FrontendConfig, tokenizer: ChatTokenizer, model_name: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = RequestLimits(
            vocab_size=tokenizer.vocab_size, max_logprobs=config.max_logprobs
        )
        self._completion = msgspec.json.Decoder(CompletionRequest)
        self._chat = msgspec.json.Decoder(ChatCompletionRequest)
        self.json_options = JsonOptions(
            disable_any_whitespace=config.disable_any_whitespace,
            disable_additional_properties=config.disable_additional_properties,
        )
        self.grammars = GrammarChecker(tokenizer, timeout=config.grammar_compile_timeout)

    def parse(self, body: bytes, *, chat: bool, geometry: Geometry) -> GenerationRequest:
        """Decode and validate one body; raise ApiError (400 or 404) on anything wrong."""
        request = self._decode(body, chat)
        if request.model is not None and request.model != self.model_name:
            raise ApiError(404, f"model {request.model!r} does not exist", param="model")
        if chat:
            prompt_ids = self._chat_prompt(request)
            logprobs = self._chat_logprobs(request)
            max_tokens = request.max_completion_tokens or request.max_tokens
        else:
            prompt_ids = self._completion_prompt(request)
            logprobs = request.logprobs
            max_tokens = request.max_tokens
        self._check_prompt(prompt_ids, geometry)
        max_tokens = self._max_tokens(max_tokens, len(prompt_ids), geometry)
        params = self._sampling_params(request, max_tokens, logprobs)
        constraint = constraint_for(request, self.tokenizer.renders_tools(), self.json_options)
        if constraint is not None:
            params = msgspec.structs.replace(params, grammar=constraint.grammar)
        self._check(params, prompt_ids, chat, constraint)
        stop = self._stop_strings(request.stop)
        options = request.stream_options
        return GenerationRequest(
            chat=chat,
            model=self.model_name,
            prompt_ids=prompt_ids,
            params=params,
            n=request.n,
            stream=request.stream,
            include_usage=bool(request.stream and options and options.include_usage),
            stop=stop,
            logprobs=logprobs,
            cache_salt=request.cache_salt,
            constraint=constraint,
        )

    async def check_grammar(self, request: GenerationRequest) -> None:
        """ApiError 400 unless the request's grammar compiles within the time limit (off the
        event loop, once per grammar)."""
        if request.constraint is None:
            return
        param = request.constraint.param
        error = await self.grammars.error(request.constraint.grammar)
        if error:
            raise _bad(f"invalid {param}: {error}", param)

    def _decode(self, body: bytes, chat: bool) -> Any:
        try:
            return (self._chat if chat else self._completion).decode(body)
        except msgspec.ValidationError as exc:
            text = str(exc)
            param = text.rsplit("`$.", 1)[1].rstrip("`") if "`$." in text else None
            raise _bad(f"invalid request: {text}", param) from None
        except msgspec.DecodeError as exc:
            raise _bad(f"invalid JSON body: {exc}") from None

    def _completion_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if request.echo:
            raise _bad("echo is not supported", "echo")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one: one text or one list of ids
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(token, int) for token in prompt):
            raise _bad("prompt must be a string, a list of one string, or token ids", "prompt")
        return list(prompt)

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if not request.messages:
            raise _bad("messages must not be empty", "messages")
        messages = []
        for message in request.messages:
            if message.role not in _ROLES:
                raise _bad(f"unknown message role {message.role!r}", "messages")
            messages.append({"role": message.role, "content": self._content(message.content)})
        try:
            return self.tokenizer.apply_chat_template(messages)
        except Exception as exc:  # a template error is the request's fault (e.g. bad roles)
            raise _bad(f"chat template failed: {exc}", "messages") from None

    @staticmethod
    def _content(content: Any) -> str:
        if content is None or isinstance(content, str):
            return content or ""
        parts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise _bad(f"unsupported content part type {part.type!r}", "messages")
            parts.append(part.text)
        return "".join(parts)

    def _chat_logprobs(self, request: ChatCompletionRequest) -> int | None:
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise _bad("top_logprobs needs logprobs to be true", "top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None

    def _check_prompt(self, prompt_ids: list[int], geometry: Geometry) -> None:
        length = len(prompt_ids)
        if length == 0:
            raise _bad("prompt must not be empty", "prompt")
        if length >= geometry.max_model_len:
            raise _bad(
                f"prompt has {length} tokens; the maximum context length is "
                f"{geometry.max_model_len}, which leaves no room to generate",
                "prompt",
            )
        if length >= geometry.pool_tokens:
            raise _bad(
                f"prompt has {length} tokens; the whole KV cache holds {geometry.pool_tokens}",
                "prompt",
            )

    def _max_tokens(self, requested: int | None, prompt_len: int, geometry: Geometry) -> int:
        # Like vLLM, a missing max_tokens fills the context (bounded here by the KV pool too,
        # because a request that outgrows the pool could never finish).
        room = min(geometry.max_model_len, geometry.pool_tokens) - prompt_len
        if requested is None:
            cap = self.config.default_max_tokens
            return room if cap is None else min(room, cap)
        if requested < 1:
            raise _bad(f"max_tokens must be at least 1, got {requested}", "max_tokens")
        if requested > room:
            raise _bad(
                f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds the limit "
                f"of {prompt_len + room} tokens (context length and KV cache)",
                "max_tokens",
            )
        return requested

    def _sampling_params(
        self, request: SamplingFields, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        """The request's SamplingParams, with OpenAI's defaults; not checked yet."""
        if not 1 <= request.n <= self.config.max_n:
            raise _bad(f"n must be in [1, {self.config.max_n}]", "n")
        seed = request.seed
        if seed is not None and not -_SEED_LIMIT <= seed < _SEED_LIMIT - request.n:
            raise _bad("seed must fit in a signed 64-bit integer", "seed")  # as seed + n - 1
        bias = request.logit_bias
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_given(request.temperature, 1.0),
            top_p=_given(request.top_p, 1.0),
            top_k=request.top_k if request.top_k not in (None, 0, -1) else None,
            min_p=_given(request.min_p, 0.0),
            repetition_penalty=_given(request.repetition_penalty, 1.0),
            presence_penalty=_given(request.presence_penalty, 0.0),
            frequency_penalty=_given(request.frequency_penalty, 0.0),
            logit_bias={int(k): float(v) for k, v in bias.items()} if bias else None,
            seed=seed,
            logprobs=logprobs,
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            num_speculative_tokens=request.speculative and request.speculative.num_tokens,
        )

    def _check(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        chat: bool,
        constraint: Constraint | None,
    ) -> None:
        """The protocol's own check, the scheduler's too; its errors name the body's field."""
        try:
            check_params(params, prompt_ids, self.limits)
        except ParamError as exc:
            names = {
                "prompt_token_ids": "prompt",
                "logprobs": _LOGPROBS[chat],
                "num_speculative_tokens": "speculative",
            }
            if constraint is not None:
                names["grammar"] = constraint.param
            raise _bad(str(exc), names.get(exc.param, exc.param)) from None

    def _stop_strings(self, stop: str | list[str] | None) -> tuple[str, ...]:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > self.config.max_stop_strings:
            limit = self.config.max_stop_strings
            raise _bad(f"at most {limit} stop strings, got {len(strings)}", "stop")
        for text in strings:
            if not 0 < len(text) <= self.config.max_stop_string_chars:
                limit = self.config.max_stop_string_chars
                raise _bad(f"each stop string must have 1 to {limit} characters", "stop")
        return tuple(strings)
