"""Tool calls: ``tool_choice`` ``"required"`` or a named function makes the reply a call.

The reply is constrained to JSON text: for a named function, its arguments object; for
``"required"``, an array of one or more calls (exactly one when ``parallel_tool_calls`` is
false), each ``{"name":"<function>","arguments":{...}}`` with that function's arguments. Every
function's ``parameters`` schema compiles under the request's ``JsonOptions`` (closed objects
unless the options say otherwise; always closed for a ``strict`` function), on its own (``%json``
in a Lark grammar), so its ``$ref``s resolve as they do in the schema alone. ``ToolCallParser``
turns the text, as it streams, into OpenAI's tool-call deltas (whitespace between its tokens
included).

``"none"`` ignores the tools. ``"auto"``, OpenAI's default when ``tools`` come without
``tool_choice``, lets the model choose between text and a call: that needs a chat template that
shows the model its tools and a parser for the model's own call syntax, so it is refused (400).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import llguidance

from frontend.errors import ApiError
from frontend.json_schema import JsonOptions
from frontend.schemas import ChatCompletionRequest, NamedToolChoice

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY = {"type": "object", "properties": {}}
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_PARAM = "tool_choice"


@dataclass(frozen=True)
class ToolChoice:
    """The grammar of a tool-call reply, and ``named``: the one function every reply calls
    (its text is the arguments), or None for ``"required"`` (an array of calls)."""

    grammar: str
    named: str | None


def tool_choice(
    request: ChatCompletionRequest, renders_tools: bool, options: JsonOptions
) -> ToolChoice | None:
    """The request's tool-call constraint, None when it has none; ApiError 400 when its tools
    or tool_choice are malformed, or ask for "auto". ``options``: how parameters compile."""
    choice, tools = request.tool_choice, request.tools or []
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param=_PARAM)
        return None
    functions = _functions(tools)
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        raise ApiError(400, _auto_refused(choice is None, renders_tools), param=_PARAM)
    if choice == "required":
        grammar = _calls_grammar(functions, request.parallel_tool_calls, options)
        return ToolChoice(grammar, None)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if choice.type != "function" or name not in functions:
            raise ApiError(400, f"tool_choice names no function of tools: {name!r}", param=_PARAM)
        return ToolChoice(_arguments_grammar(functions[name], options), name)
    message = f'tool_choice must be "none", "required", "auto" or a function, got {choice!r}'
    raise ApiError(400, message, param=_PARAM)


@dataclass(frozen=True)
class _Function:
    parameters: dict[str, Any]
    strict: bool


def _functions(tools: list[Any]) -> dict[str, _Function]:
    """Each function's name -> its parameters; ApiError 400 for a malformed tool."""
    functions: dict[str, _Function] = {}
    for tool in tools:
        name = tool.function.name
        if tool.type != "function":
            raise ApiError(400, f"unsupported tool type {tool.type!r}", param="tools")
        if not _NAME.fullmatch(name) or name in functions:
            message = f"tool names must be unique, 1-64 of a-z, A-Z, 0-9, _ and -: {name!r}"
            raise ApiError(400, message, param="tools")
        functions[name] = _Function(tool.function.parameters or _EMPTY, bool(tool.function.strict))
    return functions


def _auto_refused(by_default: bool, renders_tools: bool) -> str:
    said = 'tools without tool_choice mean "auto"' if by_default else 'tool_choice "auto"'
    if renders_tools:
        why = "nanoserve does not parse this model's own tool-call format"
    else:
        why = "this model's chat template does not show the model its tools"
    return f'{said}, which is not supported: {why}; use "required", a named function or "none"'


def _prepared(function: _Function, options: JsonOptions) -> dict[str, Any]:
    """The parameters schema as it compiles, with the options' whitespace whatever its own
    ``x-guidance`` says (the call's framing around it is fixed text)."""
    return {**options.prepare(function.parameters, function.strict), "x-guidance": options.guidance}


def _arguments_grammar(function: _Function, options: JsonOptions) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(_prepared(function, options))
    except ValueError as exc:
        raise ApiError(400, f"invalid parameters schema: {exc}", param="tools") from None


def _calls_grammar(functions: dict[str, _Function], parallel: bool, options: JsonOptions) -> str:
    """Lark: an array of calls, each the literal head of one function then its arguments."""
    lines = ['start: "[" call ("," call)* "]"' if parallel else 'start: "[" call "]"']
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, (name, function) in enumerate(functions.items()):
        head = json.dumps('{"name":' + json.dumps(name) + ',"arguments":')
        lines.append(f'call_{i}: {head} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(_prepared(function, options))}")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


def finish_reason(reason: str | None, parser: ToolCallParser) -> str | None:
    """A tool-call reply that ended whole says "tool_calls"; a cut one keeps its reason."""
    return "tool_calls" if reason == "stop" and parser.complete else reason


@dataclass
class _Call:
    name: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    arguments: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    """What one call gained: its first delta has ``id`` and ``name``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def body(self) -> dict[str, Any]:
        """OpenAI's ``delta.tool_calls[]`` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


# After a punctuation mark of the "required" array: (state, mark) -> the next state.
_MARKS = {
    ("open", "["): "head",
    ("end_call", "}"): "between",
    ("between", ","): "head",
    ("between", "]"): "done",
}


class ToolCallParser:
    """One choice's reply text, fed as it streams, as tool calls. ``named``: the function of a
    named tool_choice (the text is its arguments); None: the array of ``"required"``.

    States: open ``[``, head ``{"name":"f","arguments":``, arguments (a JSON value, scanned for
    its end), end_call ``}``, between ``,`` or ``]``, then done; "broken" when the text stops
    following that form (a stop string cut it).
    """

    def __init__(self, named: str | None) -> None:
        self._named = named is not None
        self._calls: list[_Call] = [] if named is None else [_Call(named)]
        self._state = "arguments" if self._named else "open"
        self._pending = ""  # text not parsed yet (an unfinished call head)
        self._depth = 0  # JSON nesting inside the current call's arguments
        self._in_string = self._escaped = False
        self._announced = 0  # calls whose first delta went out

    @property
    def complete(self) -> bool:
        """Whether the text so far is whole: every call's arguments closed (and the array)."""
        return self._state == "done"

    def calls(self) -> list[dict[str, Any]]:
        """OpenAI's ``message.tool_calls`` for the text so far."""
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self._calls
        ]

    def feed(self, text: str) -> list[ToolCallDelta]:
        """Parse more text; the deltas of the calls it extends, in order."""
        grown: dict[int, str] = {}
        self._pending += text
        while self._pending and self._state not in ("done", "broken") and self._step(grown):
            pass
        deltas = []
        for index, piece in grown.items():
            call = self._calls[index]
            if index < self._announced:
                deltas.append(ToolCallDelta(index, piece))
            else:
                deltas.append(ToolCallDelta(index, piece, call.id, call.name))
                self._announced = index + 1
        return deltas

    def _step(self, grown: dict[int, str]) -> bool:
        """One move through the pending text; False when it must wait for more."""
        if self._state == "arguments":
            used = self._scan_arguments(self._pending)
            index = len(self._calls) - 1
            piece, self._pending = self._pending[:used], self._pending[used:]
            self._calls[index].arguments += piece
            grown[index] = grown.get(index, "") + piece
            return True
        if self._state == "head":
            found = _HEADER.match(self._pending)
            if found is None:
                return False
            self._calls.append(_Call(json.loads(f'"{found.group(1)}"')))
            grown.setdefault(len(self._calls) - 1, "")
            self._pending = self._pending[found.end() :]
            self._state = "arguments"
            return True
        text = self._pending.lstrip()
        if not text:
            self._pending = ""
            return False
        self._state = _MARKS.get((self._state, text[0]), "broken")
        self._pending = text[1:]
        return True

    def _scan_arguments(self, text: str) -> int:
        """How much of ``text`` belongs to the current arguments; past their end the state
        moves on (to "done" for a named call, else to the call object's end)."""
        for position, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "done" if self._named else "end_call"
                    return position + 1
        return len(text)
