"""Detokenizer: turn one request's tokens into text as they arrive, and apply stop strings.

Text comes from ``tokenizers.decoders.DecodeStream``, which holds back a token until its bytes
form whole UTF-8 characters, so a character split across tokens never shows up as U+FFFD.
A stop string may also be split across tokens, so the longest tail of the text that could still
grow into a stop string is held back; a matched stop string and everything after it are never
emitted.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class Detokenizer:
    """Incremental text of one sequence. Feed ``add`` tokens, then ``pop_text`` what is safe."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._text = ""
        self._emitted = 0
        self._end: int | None = None  # where a matched stop string starts
        self.stopped = False

    @property
    def text(self) -> str:
        """All the text so far, cut before a matched stop string."""
        return self._text if self._end is None else self._text[: self._end]

    def add(self, token_id: int) -> bool:
        """Decode one more token; True when the text now contains a stop string."""
        if self.stopped:
            raise ValueError("token added after a stop string matched")
        piece = self._stream.step(self._tokenizer, token_id)
        if piece:
            searched_from = max(0, len(self._text) - self._longest_stop + 1)
            self._text += piece
            self._find_stop(searched_from)
        return self.stopped

    def _find_stop(self, start: int) -> None:
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._end = min(hits)
            self.stopped = True

    def pop_text(self, final: bool = False) -> str:
        """Text not yet returned that can no longer turn into a stop string.

        ``final`` means the sequence has ended, so nothing more is held back.
        """
        if self._end is not None:
            end = self._end
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back()
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the unemitted text that begins some stop string."""
        tail = self._text[self._emitted :]
        best = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(tail)), best, -1):
                if tail.endswith(stop[:size]):
                    best = size
                    break
        return best
