"""The torch-free tokenizer matches transformers' AutoTokenizer on the default GGUF model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from models.files import resolve_model
from models.tokenizer import ChatTokenizer

TEXTS = [
    "Hello world 123",
    "你好，世界！🎉👍🏽 emoji",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  multiple   spaces\n\n\ttab",
    "def f(x):\n    return x ** 2  # comment",
]


def test_frontend_never_imports_torch() -> None:
    code = "import sys, frontend.app, frontend.process; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_chat_template_renders_generation_prompt(tokenizer: ChatTokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = tokenizer.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_ids == (2,)


@pytest.mark.slow
def test_matches_transformers(tokenizer: ChatTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    files = resolve_model(None)
    reference = transformers.AutoTokenizer.from_pretrained(
        files.directory, gguf_file=files.gguf_file
    )
    for text in TEXTS:
        assert tokenizer.encode(text) == reference(text, add_special_tokens=False)["input_ids"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 你好"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again"},
    ]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert tokenizer.apply_chat_template(messages) == list(expected)
