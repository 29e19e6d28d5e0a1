"""A tiny random-initialized Llama, seeded, saved as a Hugging Face directory, for fast tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_llama(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a seeded random Llama (config.json + model.safetensors) into ``directory``.

    ``overrides`` change the config (for example ``attention_bias=True`` for a Qwen2-like model,
    or ``rope_scaling=...``). The same seed and overrides always give the same weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_CONFIG, **overrides})
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).eval()
        # Default init leaves tiny logits; widen them so greedy choices are well separated.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.08 if p.dim() > 1 else 0.02).add_(1.0 if p.dim() == 1 else 0.0)
    finally:
        torch.random.set_rng_state(generator_state)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: TINY_CONFIG's bos and eos


def write_byte_tokenizer(directory: Path) -> Path:
    """Write a byte-level ``tokenizer.json`` for the tiny model into ``directory``: id 0-2 are
    the special tokens, every other id ``t`` is the byte ``t`` (no merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    char = {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}  # GPT-2's
    vocab = {char[b]: b for b in range(len(SPECIAL_TOKENS), 256)}
    vocab.update({name: i for i, name in enumerate(SPECIAL_TOKENS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory
