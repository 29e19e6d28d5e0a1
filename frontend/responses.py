"""ResponseFormatter: OpenAI's JSON shapes for completions and chat, streamed and whole."""

from __future__ import annotations

import time
from typing import Any

from frontend.generation import ChoiceUpdate, TokenLogprob
from frontend.tool_calls import ToolCallParser, finish_reason
from models.tokenizer import ChatTokenizer


class ResponseFormatter:
    """Builds the response objects of one request (``chat`` picks the chat shapes)."""

    def __init__(self, tokenizer: ChatTokenizer, *, chat: bool, request_id: str, model: str):
        self.tokenizer = tokenizer
        self.chat = chat
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self._text_offset: dict[int, int] = {}

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """OpenAI's usage object; ``cached_tokens``: prompt tokens found in the prefix cache."""
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    # -- streaming ---------------------------------------------------------------------------

    def role_chunk(self, index: int, include_usage: bool, text: bool = True) -> dict[str, Any]:
        """Chat's first chunk of a choice: the assistant role, and empty content (null content
        for a reply of tool calls)."""
        return self._chunk(
            {
                "index": index,
                "delta": {"role": "assistant", "content": "" if text else None},
                "logprobs": None,
                "finish_reason": None,
            },
            include_usage,
        )

    def chunk(self, update: ChoiceUpdate, include_usage: bool) -> dict[str, Any]:
        """One streamed chunk carrying one choice's update."""
        logprobs = self.logprobs(update.index, update.logprobs) if update.logprobs else None
        if self.chat:
            delta = {"content": update.text} if update.text or not update.finish_reason else {}
            choice = {"index": update.index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": update.index, "text": update.text, "logprobs": logprobs}
        choice["finish_reason"] = update.finish_reason
        return self._chunk(choice, include_usage)

    def tool_chunk(
        self, update: ChoiceUpdate, parser: ToolCallParser, include_usage: bool
    ) -> dict[str, Any] | None:
        """A chat chunk of tool-call deltas: what ``update``'s text adds to the choice's calls
        (None when it adds nothing and ends nothing)."""
        deltas = parser.feed(update.text)
        finish = finish_reason(update.finish_reason, parser)
        if not deltas and finish is None and not update.logprobs:
            return None
        delta = {"tool_calls": [d.body() for d in deltas]} if deltas else {}
        logprobs = self.logprobs(update.index, update.logprobs) if update.logprobs else None
        choice = {"index": update.index, "delta": delta, "logprobs": logprobs}
        choice["finish_reason"] = finish
        return self._chunk(choice, include_usage)

    def _chunk(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, only usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    # -- whole responses ---------------------------------------------------------------------

    def response(
        self,
        texts: list[str],
        logprobs: list[list[TokenLogprob]] | None,
        finish_reasons: list[str | None],
        usage: dict[str, Any],
        tool_calls: list[list[dict[str, Any]]] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming response with every choice; ``tool_calls``: each chat choice's
        calls, when its text is tool calls (then its content is null)."""
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        choices = []
        for index, text in enumerate(texts):
            lp = self.logprobs(index, logprobs[index]) if logprobs is not None else None
            if self.chat and tool_calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": tool_calls[index]}
                choice = {"index": index, "message": message}
            elif self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": index, "text": text}
            choice.update(logprobs=lp, finish_reason=finish_reasons[index])
            choices.append(choice)
        body["choices"] = choices
        body["usage"] = usage
        return body

    # -- logprobs ----------------------------------------------------------------------------

    def logprobs(self, index: int, entries: list[TokenLogprob]) -> dict[str, Any]:
        """Logprobs of some of choice ``index``'s tokens, in the endpoint's format."""
        if self.chat:
            return {"content": [self._chat_entry(entry) for entry in entries]}
        tokens, offsets = [], []
        offset = self._text_offset.get(index, 0)
        for entry in entries:
            text = self.tokenizer.token_text(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._text_offset[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [
                {self.tokenizer.token_text(t): lp for t, lp in entry.top} for entry in entries
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        return {
            **self._token_info(entry.token_id, entry.logprob),
            "top_logprobs": [self._token_info(t, lp) for t, lp in entry.top],
        }

    def _token_info(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.tokenizer.token_text(token_id),
            "logprob": logprob,
            "bytes": self.tokenizer.token_bytes(token_id),
        }
