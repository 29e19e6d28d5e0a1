"""transformers on a checkpoint, for the GPU check to hold nanoserve against. Each run is a
process of its own (the GPU memory goes back when it ends) and prints one JSON line.

    python scripts/gpu_reference.py --device cuda --exact DIR --prompts FILE --max-new 48 \\
        --speed DIR --speed-dtype bfloat16 --batches 1 64

In one process, one after the other: the machine (torch, the device, its memory bandwidth as
``bench forward --profile`` measures it); ``greedy``: ``generate`` (greedy) on the float32
``--exact`` checkpoint for each prompt of FILE (a JSON list of token-id lists) alone, with no
end-of-sequence token, as nanoserve's ``ignore_eos`` runs; ``static``: ``generate`` on the
``--speed`` checkpoint with a static KV cache (``cache_implementation="static"``), eager, no
compile, on seeded random prompts at each batch size: milliseconds a decode step, and output
tokens a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _load(directory: Path, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def _synchronize(device: str) -> None:
    """Wait for the device's queued work, so that a timer stops when it is done."""
    import torch

    {"cuda": torch.cuda.synchronize}.get(device, lambda: None)()


def greedy(directory: Path, prompts: list[list[int]], max_new: int, dtype: str, device: str):
    """Each prompt's greedy continuation, alone: ``max_new`` ids, or fewer where generate
    stopped at an end-of-sequence token (the caller compares that prefix)."""
    import torch
    from transformers import GenerationConfig

    model = _load(directory, dtype, device)
    config = GenerationConfig(
        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    outputs = []
    began = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outputs.append(out[0, len(prompt) :].tolist())
    return {"outputs": outputs, "seconds": round(time.perf_counter() - began, 3)}


def static(
    directory: Path,
    batches: list[int],
    input_len: int,
    output_len: int,
    dtype: str,
    device: str,
    seed: int = 0,
) -> dict:
    """At each batch size: a decode step's milliseconds (``output_len`` tokens less one, over
    the time past a one-token generate) and output tokens a second end to end."""
    import torch

    model = _load(directory, dtype, device)
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    rows = []
    for batch in batches:
        ids = torch.randint(1000, vocab, (batch, input_len), generator=generator).to(device)

        _timed(model, ids, 4, device)  # warm-up
        first = _timed(model, ids, 1, device)
        whole = _timed(model, ids, output_len, device)
        rows.append(
            {
                "batch": batch,
                "ms_per_step": round((whole - first) / (output_len - 1) * 1000, 3),
                "output_tok_s": round(batch * output_len / whole, 1),
                "seconds": round(whole, 3),
            }
        )
    return {"static": rows, "input_len": input_len, "output_len": output_len}


def machine(device: str) -> dict:
    """torch's version, the device's name and its memory bandwidth (``nanoserve.bench.floor``,
    chosen by the device's name as a worker's plan names it)."""
    import platform

    import torch

    from nanoserve.bench.floor import BANDWIDTH, read_bandwidth

    names = {"cuda": lambda: torch.cuda.get_device_name(0), "cpu": platform.machine}
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "device_name": names.get(device, lambda: device)(),
        "bandwidth_gb_s": round(read_bandwidth(device) / 1e9, 1),
        "bandwidth_measured": BANDWIDTH[device][1],
    }


def _timed(model, ids, new_tokens: int, device: str) -> float:
    """Seconds of one static-cache ``generate`` of exactly ``new_tokens`` for every row."""
    import torch

    began = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # every row makes exactly this many
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
            disable_compile=True,
        )
    _synchronize(device)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens")
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--exact", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--speed", type=Path, required=True)
    parser.add_argument("--speed-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    result = {"machine": machine(args.device)}
    prompts = json.loads(args.prompts.read_text())
    result["greedy"] = greedy(args.exact, prompts, args.max_new, "float32", args.device)
    _release(args.device)
    result |= static(
        args.speed, args.batches, args.input_len, args.output_len, args.speed_dtype, args.device
    )
    print(json.dumps(result))
    return 0


def _release(device: str) -> None:
    """Give the device's cached memory back between the two models."""
    import gc

    import torch

    gc.collect()
    {"cuda": torch.cuda.empty_cache}.get(device, lambda: None)()


if __name__ == "__main__":
    sys.exit(main())
