"""GrammarGate: a constrained request waits, outside the queues, until the worker has compiled
its grammar (vLLM's ``WAITING_FOR_FSM``).

A grammar is compiled by the worker's grammar engine (llguidance) before a row can sample under
it. Compiled in the step that first samples the row, a grammar of 0.7 s would hold that step,
and every request in it, for 0.7 s. So a request whose grammar the current worker has not
compiled is held here, not queued: the scheduler process sends the worker a ``CompileGrammar``
(``to_ask``), the worker compiles it in a thread of its own and answers ``GrammarCompiled``
(``compiled``), and only then does the request join the waiting queue, as a new arrival (the
queues stay in arrival order, which the auditor checks). Steps run meanwhile for everyone else.

What the gate believes the worker holds (``_known``, an LRU) is smaller than the worker's own
cache of compiled grammars, so a request released for a grammar finds it there; if it does not
(a worker restarted under running requests), the worker compiles it in the step, and the step's
``grammar_compiles`` counts it. A new or lost worker forgets everything: held grammars are asked
again of the next one. An ask left unanswered for ``reask_s`` is sent again (a compile is
idempotent; an answer can be lost with the worker's second socket).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from protocol.messages import AddRequest, CompileGrammar

KNOWN = 64  # grammars the gate takes the worker to hold (the worker keeps 256)


def grammar_key(grammar: str) -> str:
    """A grammar's name on the wire: a digest, so a long grammar crosses once per compile."""
    return hashlib.blake2b(grammar.encode(), digest_size=16).hexdigest()


@dataclass
class _Held:
    """The requests waiting for one grammar, in arrival order, and when it was last asked."""

    grammar: str
    requests: list[AddRequest]
    asked: float | None = None  # time.monotonic() of the last CompileGrammar, None: not yet


class GrammarGate:
    """Holds constrained requests until the worker has compiled their grammar."""

    def __init__(self, known: int = KNOWN, reask_s: float = 5.0) -> None:
        self._known: OrderedDict[str, None] = OrderedDict()  # keys the worker has compiled
        self._capacity = known
        self._reask_s = reask_s
        self._held: dict[str, _Held] = {}  # grammar key -> what waits for it
        self._key_of: dict[str, str] = {}  # held request id -> its grammar's key
        self.holds_total = 0  # requests held (each once)
        self.compile_s_total = 0.0  # the worker's seconds compiling the grammars asked of it

    @property
    def num_held(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._key_of)

    def hold(self, add: AddRequest) -> bool:
        """Hold ``add`` if its grammar is not compiled yet (True), else let it pass (False)."""
        grammar = add.params.grammar
        if grammar is None:
            return False
        key = grammar_key(grammar)
        if key in self._known:
            self._known.move_to_end(key)
            return False
        held = self._held.setdefault(key, _Held(grammar, []))
        held.requests.append(add)
        self._key_of[add.request_id] = key
        self.holds_total += 1
        return True

    def drop(self, request_id: str) -> AddRequest | None:
        """Forget a held request (aborted, or failed with every other); None if not held."""
        key = self._key_of.pop(request_id, None)
        if key is None:
            return None
        held = self._held[key]
        dropped = next(add for add in held.requests if add.request_id == request_id)
        held.requests.remove(dropped)
        if not held.requests:
            del self._held[key]
        return dropped

    def drop_all(self) -> list[str]:
        """Forget every held request (their worker's model went away); their ids."""
        ids = list(self._key_of)
        self._key_of.clear()
        self._held.clear()
        return ids

    def to_ask(self, now: float | None = None) -> list[CompileGrammar]:
        """The compiles to ask of the worker now: each held grammar not yet asked, or asked
        more than ``reask_s`` ago."""
        now = time.monotonic() if now is None else now
        asks = []
        for key, held in self._held.items():
            if held.asked is None or now - held.asked >= self._reask_s:
                held.asked = now
                asks.append(CompileGrammar(key=key, grammar=held.grammar))
        return asks

    def compiled(self, key: str, seconds: float = 0.0) -> list[AddRequest]:
        """The worker compiled ``key``'s grammar: the requests that waited for it, in arrival
        order, to queue now."""
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self._capacity:
            self._known.popitem(last=False)
        held = self._held.pop(key, None)
        if held is None:
            return []  # an answer to an ask sent again, or its requests were aborted
        self.compile_s_total += seconds
        for add in held.requests:
            del self._key_of[add.request_id]
        return held.requests

    def worker_changed(self) -> None:
        """A worker was lost or announced itself: it holds none of what the last one compiled,
        and the grammars held are asked of it afresh."""
        self._known.clear()
        for held in self._held.values():
            held.asked = None
