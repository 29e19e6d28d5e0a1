"""``nanoserve generate``: offline batch generation on the in-process Engine.

Reads JSONL (one of "prompt", "messages" or "prompt_token_ids" per line) and prints one JSON
line per prompt, in input order, with "token_ids" and "text". A line may carry its own
"max_tokens" and "temperature", which override the flags for that prompt (as vLLM's offline
``generate`` takes one SamplingParams per prompt).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nanoserve.options import add_options, option


def add_worker_flags(
    p: argparse.ArgumentParser,
    *,
    num_blocks: int | None,
    block_size: int,
    num_slots: int,
    token_budget: int,
) -> None:
    """The model and pool-shape flags shared by generate and soak."""
    p.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M)")
    add_options(p, [option("dtype")])
    p.add_argument("--num-blocks", type=int, default=num_blocks)
    p.add_argument("--block-size", type=int, default=block_size)
    p.add_argument("--num-slots", type=int, default=num_slots)
    p.add_argument("--token-budget", type=int, default=token_budget)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--disable-overlap", action="store_true", help="apply each step before planning the next"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the command."""
    p = subparsers.add_parser("generate", help="offline batch generation from a JSONL file")
    p.add_argument("--prompts-file", required=True, type=Path)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    add_worker_flags(p, num_blocks=None, block_size=16, num_slots=16, token_budget=512)
    p.set_defaults(func=run)


def read_prompts(path: Path) -> list[dict]:
    """The JSONL lines, each checked to hold exactly one known prompt field and, if any, a
    valid max_tokens and temperature of its own."""
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        keys = {"prompt", "messages", "prompt_token_ids"} & set(
            line if isinstance(line, dict) else ()
        )
        if len(keys) != 1:
            raise ValueError(f"{path}:{number}: need one of prompt, messages, prompt_token_ids")
        _check_overrides(line, f"{path}:{number}")
        lines.append(line)
    if not lines:
        raise ValueError(f"{path}: no prompts")
    return lines


def _check_overrides(line: dict, where: str) -> None:
    """A line's own max_tokens must be an integer >= 1, its temperature a finite number >= 0."""
    if "max_tokens" in line:
        value = line["max_tokens"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {value!r}")
    if "temperature" in line:
        value = line["temperature"]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not 0 <= value < float("inf"):
            raise ValueError(f"{where}: temperature must be a finite number >= 0, got {value!r}")


def tokenize(line: dict, tokenizer) -> list[int]:
    """A line's prompt as token ids: text as a completions API would, chat via the template."""
    if "prompt_token_ids" in line:
        ids = line["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return ids
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: give prompt_token_ids")
    if "prompt" in line:
        return tokenizer.encode(line["prompt"])
    return tokenizer.apply_chat_template(line["messages"])


def load_tokenizer(model: str | None):
    """The frontend's tokenizer for the model (what the server would use), or None for a
    checkpoint that has none."""
    from models.files import resolve_model
    from models.tokenizer import load_tokenizer as load

    try:
        return load(resolve_model(model))
    except (OSError, ValueError):
        return None


def make_worker(args: argparse.Namespace):
    """The real worker with the pool shape from the flags."""
    from worker.config import WorkerConfig
    from worker.worker import Worker

    config = WorkerConfig(
        model=args.model,
        dtype=args.dtype,
        compile=False,  # minutes of compiling would outweigh a batch run's gain
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        num_slots=args.num_slots,
        seed=args.seed,
    )
    return Worker(config, progress=False)


def run(args: argparse.Namespace) -> int:
    """Generate for every line and print the results as JSON lines."""
    from protocol.messages import SamplingParams
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine

    lines = read_prompts(args.prompts_file)
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenize(line, tokenizer) for line in lines]
    params = [
        SamplingParams(
            max_tokens=int(line.get("max_tokens", args.max_tokens)),
            temperature=float(line.get("temperature", args.temperature)),
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        for line in lines
    ]
    config = SchedulerConfig(token_budget=args.token_budget, overlap=not args.disable_overlap)
    worker = make_worker(args)
    try:
        for out in Engine.for_worker(worker, config).generate(prompts, params):
            ids = out.new_token_ids
            text = tokenizer.tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else None
            print(
                json.dumps({"token_ids": ids, "text": text, "finish_reason": out.finish_reason}),
                flush=True,
            )
    finally:
        worker.close()
    return 0
