"""Random-weight checkpoints for the GPU check, made where they run, and SmolLM2's tokenizer
files beside them: no weights travel to the GPU machine.

    python scripts/gpu_checkpoints.py tokenizer DIR    # SmolLM2's, from the default GGUF
    python scripts/gpu_checkpoints.py make DIR --tokenizer-dir TOKENIZER_DIR --device cuda \\
        --exact smollm2-135m --speed llama-3.2-1b --speed-dtype bfloat16

``make`` writes DIR/exact (float32) and DIR/speed, each a Hugging Face directory (config.json,
model.safetensors, the tokenizer files) of one of ``SHAPES``, seeded. Weights at
transformers' default std of 0.02 make a model whose greedy output is one token repeated, which
would make an exactness check pass on nothing; at 1.2/sqrt(hidden) for every matrix, 0.1 for
the embeddings and 1 for the norms, greedy tokens vary (the check counts them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMOLLM2_VOCAB = 49152
COMMON: dict[str, Any] = dict(
    vocab_size=SMOLLM2_VOCAB,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,  # SmolLM2's <|im_start|>
    eos_token_id=2,  # <|im_end|>
    pad_token_id=2,
)
SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M's shape: the float32 exactness check.
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    ),
    # Llama-3.2-1B's shape with SmolLM2's vocabulary: the speed levels, in bfloat16.
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    # The CPU smoke run's stand-in for both: tiny, with the same vocabulary and tokenizer.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export_tokenizer(target: Path) -> Path:
    """Write SmolLM2's tokenizer (read from the default model's GGUF, which carries it) as
    ``tokenizer.json`` and ``tokenizer_config.json`` (chat template, special tokens)."""
    from models.files import resolve_model
    from models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.tokenizer.save(str(target / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.eos_token,
        "model_max_length": 8192,
    }
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return target


def init_std(name: str, hidden: int) -> tuple[float, float]:
    """(mean, std) of one parameter: norms at 1, embeddings at std 0.1, matrices at
    1.2/sqrt(hidden)."""
    if name.endswith("norm.weight"):
        return 1.0, 0.0
    if "embed_tokens" in name:
        return 0.0, 0.1
    return 0.0, 1.2 / math.sqrt(hidden)


def make_checkpoint(
    directory: Path, shape: str, dtype: str, device: str, tokenizer_dir: Path, seed: int = 0
) -> dict:
    """Write a seeded random checkpoint of ``shape`` in ``dtype``, initialized on ``device``;
    returns what was made (parameters, bytes, seconds)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    began = time.perf_counter()
    config = LlamaConfig(**COMMON, **SHAPES[shape])
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    hidden = config.hidden_size
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            mean, std = init_std(name, hidden)
            if std == 0.0:
                parameter.fill_(mean)
            else:
                noise = torch.randn(parameter.shape, generator=generator, device=device)
                parameter.copy_(noise.mul_(std).add_(mean))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        (directory / name).write_bytes((tokenizer_dir / name).read_bytes())
    count = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return {
        "shape": shape,
        "dtype": dtype,
        "device": device,
        "parameters": count,
        "bytes": size,
        "seconds": round(time.perf_counter() - began, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    tokenizer = sub.add_parser("tokenizer", help="export SmolLM2's tokenizer files")
    tokenizer.add_argument("directory", type=Path)
    make = sub.add_parser("make", help="make the exact (float32) and the speed checkpoints")
    make.add_argument("directory", type=Path)
    make.add_argument(
        "--tokenizer-dir", type=Path, required=True, help="exported here first when missing"
    )
    make.add_argument("--device", default="cpu")
    make.add_argument("--exact", choices=sorted(SHAPES), default="smollm2-135m")
    make.add_argument("--speed", choices=sorted(SHAPES), default="llama-3.2-1b")
    make.add_argument("--speed-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    make.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.what == "tokenizer":
        print(json.dumps({"tokenizer": str(export_tokenizer(args.directory))}))
        return 0
    made = {}
    if not (args.tokenizer_dir / "tokenizer.json").exists():
        made["tokenizer"] = str(export_tokenizer(args.tokenizer_dir))
    for name, shape, dtype in (
        ("exact", args.exact, "float32"),
        ("speed", args.speed, args.speed_dtype),
    ):
        target = args.directory / name
        made[name] = make_checkpoint(
            target, shape, dtype, args.device, args.tokenizer_dir, args.seed
        ) | {"directory": str(target)}
    print(json.dumps(made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
