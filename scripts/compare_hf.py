"""transformers' static batching, the baseline of ``scripts/compare.py``: ``model.generate`` on
equal-length batches (seeded random prompt ids, greedy, exactly ``output_len`` new tokens).

Run alone it prints one JSON line: ``python scripts/compare_hf.py --dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import json
import time


def static_batching(dtype: str, batch: int, input_len: int, output_len: int, seed: int) -> dict:
    """Output tokens/s of one timed ``generate`` over ``batch`` prompts, after a short warm-up."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.files import resolve_model

    files = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(
        files.directory, gguf_file=files.gguf_file, dtype=getattr(torch, dtype)
    ).eval()
    generator = torch.Generator().manual_seed(seed)
    # Ids from 1000 up: plain word pieces, as bench serve's random prompts use.
    ids = torch.randint(1000, 32000, (batch, input_len), generator=generator)
    mask = torch.ones_like(ids)

    def generate(new_tokens: int) -> float:
        began = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # as ignore_eos: every row makes exactly this many
                do_sample=False,
                pad_token_id=0,
            )
        if out.shape[1] != input_len + new_tokens:
            raise RuntimeError(f"generate made {out.shape[1] - input_len} tokens")
        return time.perf_counter() - began

    generate(4)  # warm-up
    seconds = generate(output_len)
    return {
        "server": f"transformers static b{batch}",
        "dtype": dtype,
        "concurrency": batch,
        "output_throughput": batch * output_len / seconds,
        "duration_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = static_batching(args.dtype, args.batch, args.input_len, args.output_len, args.seed)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
