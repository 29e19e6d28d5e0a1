"""Detokenizer with the real default tokenizer: no U+FFFD mid-stream, stop strings never leak."""

from __future__ import annotations

import pytest

from frontend.detokenizer import Detokenizer
from models.tokenizer import ChatTokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 🎉👍🏽👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵.",
    "Mixed: naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어.",
    "Plain ASCII with  double  spaces\nand\ttabs 12345.",
]


def _stream(tokenizer: ChatTokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> list[str]:
    detokenizer = Detokenizer(tokenizer.tokenizer, stop)
    pieces = []
    for token in ids:
        stopped = detokenizer.add(token)
        pieces.append(detokenizer.pop_text())
        if stopped:
            break
    pieces.append(detokenizer.pop_text(final=True))
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_no_replacement_character_mid_stream(tokenizer: ChatTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    # The premise: some single tokens are partial characters on their own.
    if any(ord(ch) > 0x3000 for ch in text):
        assert any("\ufffd" in tokenizer.token_text(t) for t in ids)
    pieces = _stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The answer is 42. Done.", ("answer is",), "The "),
        ("你好，世界！今天天气很好。", ("世界",), "你好，"),
        ("Emoji 🎉👍🏽 end", ("👍",), "Emoji 🎉"),
        ("abcabcabd tail", ("abd",), "abcabc"),
        ("no match here", ("zzz", "here!"), "no match here"),
        ("two stops: B then A", ("A", "B"), "two stops: "),
    ],
)
def test_stop_strings_across_tokens_never_emitted(
    tokenizer: ChatTokenizer, text: str, stop: tuple[str, ...], expected: str
) -> None:
    ids = tokenizer.encode(text)
    pieces = _stream(tokenizer, ids, stop)
    assert "".join(pieces) == expected
    emitted = ""
    for piece in pieces:  # no prefix of the stream ever contains a stop string
        emitted += piece
        assert not any(s in emitted for s in stop)


def test_stop_string_split_over_tokens_is_held_back(tokenizer: ChatTokenizer) -> None:
    text = "Hello world, goodbye"
    ids = tokenizer.encode(text)
    detokenizer = Detokenizer(tokenizer.tokenizer, ("world, good",))
    seen = ""
    for token in ids:
        if detokenizer.add(token):
            break
        seen += detokenizer.pop_text()
        assert "world" not in seen  # the partial match is held back, not emitted
    assert detokenizer.stopped
    assert seen + detokenizer.pop_text(final=True) == "Hello "


def test_special_tokens_are_skipped(tokenizer: ChatTokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert "".join(_stream(tokenizer, ids)) == "assistant\nHi"


def test_add_after_stop_raises(tokenizer: ChatTokenizer) -> None:
    detokenizer = Detokenizer(tokenizer.tokenizer, ("a",))
    assert detokenizer.add(tokenizer.encode("a")[0])
    with pytest.raises(ValueError, match="after a stop string"):
        detokenizer.add(tokenizer.encode("b")[0])
