"""The model's tokenizer: a ``tokenizers.Tokenizer`` plus the model's chat template.

The frontend tokenizes and renders chat templates with it; the worker's grammar matchers read
its vocabulary. It is loaded without transformers, because importing transformers imports torch
and the API process must stay torch-free. A GGUF file is read with the ``gguf`` package and
rebuilt as a byte-level BPE tokenizer, the way transformers' GGUF converter does; a Hugging Face
directory gives ``tokenizer.json`` and ``tokenizer_config.json``. The chat template is rendered
with a sandboxed jinja2 environment configured like transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from models.files import ModelFiles

# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*): control and user-defined tokens are added
# (special) tokens that BPE must never split.
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


@dataclass(frozen=True)
class ChatTokenizer:
    """Encode prompts (plain or through the chat template) and name tokens for logprobs."""

    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    bos_token: str = ""
    eos_token: str = ""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation, ending with the assistant's generation prompt."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        text = _compiled_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        return self.encode(text)

    def renders_tools(self) -> bool:
        """Whether the chat template shows the model a request's ``tools`` at all."""
        if self.chat_template is None:
            return False
        return _renders_tools(self.chat_template, self.bos_token, self.eos_token)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs); partial UTF-8 shows as U+FFFD."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The UTF-8 bytes one token stands for (byte-level BPE tokens map 1:1 to bytes)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return []
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self.token_text(token_id).encode("utf-8"))


def load_tokenizer(files: ModelFiles) -> ChatTokenizer:
    """Load the tokenizer of a GGUF file or a Hugging Face directory, without torch."""
    if files.gguf_file is not None:
        return _load_gguf(files.source)
    return _load_hf_dir(files.directory)


def _load_gguf(path: Path) -> ChatTokenizer:
    import gguf  # numpy only; imported here to keep module import fast

    reader = gguf.GGUFReader(path)

    def field(name: str, default: Any = None) -> Any:
        value = reader.fields.get(name)
        return default if value is None else value.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path.name}: unsupported GGUF tokenizer model {kind!r} (need gpt2 BPE)")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type", [])
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tokens[i], normalized=False, special=True)
        for i, kind_id in enumerate(types)
        if kind_id in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
    ]
    tokenizer.add_special_tokens(special)
    eos = field("tokenizer.ggml.eos_token_id")
    bos = field("tokenizer.ggml.bos_token_id")
    return ChatTokenizer(
        tokenizer=tokenizer,
        chat_template=field("tokenizer.chat_template"),
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token="" if bos is None else tokens[int(bos)],
        eos_token="" if eos is None else tokens[int(eos)],
    )


def _load_hf_dir(directory: Path) -> ChatTokenizer:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"no tokenizer.json in {directory} (pass --tokenizer)")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    config = _read_json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    bos, eos = _token_str(config.get("bos_token")), _token_str(config.get("eos_token"))
    eos_ids = _read_json(directory / "generation_config.json").get("eos_token_id")
    if eos_ids is None:
        eos_ids = _read_json(directory / "config.json").get("eos_token_id")
    if eos_ids is None and eos:
        eos_ids = tokenizer.token_to_id(eos)
    ids = eos_ids if isinstance(eos_ids, list) else [] if eos_ids is None else [eos_ids]
    return ChatTokenizer(tokenizer, template, tuple(int(i) for i in ids), bos, eos)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_str(value: Any) -> str:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """Compile once per template, in a sandbox (templates come with model files)."""
    if source not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


_RENDERS_TOOLS: dict[str, bool] = {}
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "nanoserve_probe", "description": "probe", "parameters": {}},
}


def _renders_tools(source: str, bos: str, eos: str) -> bool:
    """Render a one-message conversation with a probe tool: does its name show? (Once per
    template.)"""
    if source not in _RENDERS_TOOLS:
        messages = [{"role": "user", "content": "hi"}]
        try:
            text = _compiled_template(source).render(
                messages=messages,
                tools=[_PROBE_TOOL],
                add_generation_prompt=True,
                bos_token=bos,
                eos_token=eos,
            )
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            text = ""
        _RENDERS_TOOLS[source] = "nanoserve_probe" in text
    return _RENDERS_TOOLS[source]


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character-to-byte table, inverted (built once)."""
    if not _BYTE_DECODER:
        printable = (
            list(range(ord("!"), ord("~") + 1))
            + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1))
        )
        extra = 0
        for byte in range(256):
            if byte in printable:
                _BYTE_DECODER[chr(byte)] = byte
            else:
                _BYTE_DECODER[chr(256 + extra)] = byte
                extra += 1
    return _BYTE_DECODER
