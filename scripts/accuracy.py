"""How far each way of running the default model's GGUF moves from float32, side by side with
llama.cpp's server on the same file.

The reference is transformers' float32 forward on the GGUF's dequantized weights (the tests'
correctness reference). Each prompt's greedy continuation under it gives forced steps: step i
asks for one token after the prompt and the reference's first i tokens. Every way of running
answers every forced step, and the table gives, over all of them:

- the share of steps whose argmax is the reference's token (forced-step agreement);
- the largest and the mean |log-probability difference| of the reference's token (a logit
  error with the softmax's free shift taken out; llama-server returns log-probabilities, not
  logits).

nanoserve runs in this process on the worker and the real scheduler (``Engine``), every forced
step submitted at once, so steps hold many rows: in bfloat16 with the GGUF's 4-bit matrices
those are the 4-bit x 8-bit steps (``--w4a8``, the default), else (``--q4-max-tokens 0``)
bfloat16 matrices, as ``--no-w4a8`` also gives big steps. On a CPU without native bfloat16,
where ``auto`` picks float32 on the 4-bit weights times 8-bit activations, that is a row too.
The single-row steps' figures (4-bit weights x bfloat16 activations) come from
``tests/worker/test_real_model.py``. llama-server answers over HTTP, one step at a time, with
``cache_prompt`` (each step computes its one new token).

    python scripts/accuracy.py --llama-server ~/.cache/nanoserve/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402 - after the path setup above

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Write a haiku about the sea.",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a small village by the mountains,",
    "The three laws of thermodynamics are",
    "Translate to French: I would like a cup of coffee.",
    "import numpy as np\nx = np.linspace(0, 1, 5)\nprint(",
    "List three uses of a paperclip:\n1.",
    "Photosynthesis is the process by which",
    "SELECT name, age FROM users WHERE",
    "My favourite book is",
    "How do I make a good cup of tea?",
    "The mitochondria is",
    "Explain recursion to a five-year-old.",
    "class Stack:\n    def __init__(self):\n        ",
    "The best way to learn a new language is",
    "Water boils at",
    "Write a short email asking for a day off.",
    "for i in range(10):\n    if i % 2 == 0:\n        ",
    "The difference between weather and climate is",
    "Three tips for better sleep:",
    "In 1969, Neil Armstrong",
    "A good name for a black cat is",
]
TOP = 20  # alternatives asked for: the reference's token is found among them or counted missing


@dataclass
class Step:
    """One forced step: the ids to continue, and the reference's answer there."""

    ids: list[int]
    token: int  # the reference's argmax
    logprobs: torch.Tensor  # (vocab,) float32 log-softmax of the reference's logits


def reference_steps(files, steps: int) -> list[Step]:
    """Every prompt's greedy continuation under transformers in float32, as forced steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(files.directory, gguf_file=files.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        files.directory, gguf_file=files.gguf_file, dtype=torch.float32
    ).eval()
    forced = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        tokens = out.sequences[0, len(ids) :].tolist()
        for i, (token, logits) in enumerate(zip(tokens, out.logits, strict=True)):
            logits = logits[0].float()
            forced.append(Step(ids + tokens[:i], token, logits.log_softmax(-1)))
    return forced


def score(steps: list[Step], answers: list[tuple[int, dict[int, float]]]) -> dict:
    """Agreement and log-probability error of ``answers`` ((argmax, {token: logprob}) per step)
    against the reference."""
    agree, errors, missing = 0, [], 0
    for step, (argmax, top) in zip(steps, answers, strict=True):
        agree += int(argmax == step.token)
        if step.token in top:
            errors.append(abs(top[step.token] - step.logprobs[step.token].item()))
        else:
            missing += 1
    row = {
        "steps": len(steps),
        "agreement": agree / len(steps),
        "max_logprob_error": max(errors),
        "mean_logprob_error": sum(errors) / len(errors),
        "reference_token_not_in_top": missing,
    }
    return row


def nanoserve_answers(steps: list[Step], **config) -> list:
    """Every step at once through the worker and the real scheduler, in this process."""
    from protocol.params import SamplingParams
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine
    from worker.config import WorkerConfig
    from worker.worker import Worker

    worker = Worker(
        WorkerConfig(num_blocks=4096, num_slots=64, compile=False, **config), progress=False
    )
    engine = Engine.for_worker(worker, SchedulerConfig(token_budget=512))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP)
    outputs = engine.generate([step.ids for step in steps], params)
    return [(o.new_token_ids[0], dict(o.top_logprobs[0])) for o in outputs]


def llama_answers(url: str, steps: list[Step]) -> list:
    """One step at a time through llama-server's /completion (greedy, the top log-probs)."""
    answers = []
    for step in steps:
        body = {
            "prompt": step.ids,
            "n_predict": 1,
            "temperature": 0.0,
            "n_probs": TOP,
            "cache_prompt": True,
            "post_sampling_probs": False,
        }
        request = urllib.request.Request(
            url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.load(response)
        probs = reply["completion_probabilities"][0]
        top = {entry["id"]: entry["logprob"] for entry in probs["top_logprobs"]}
        answers.append((probs["id"], top))
    return answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="forced steps per prompt")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server binary")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    from models.files import resolve_model

    files = resolve_model(None)
    steps = reference_steps(files, args.steps)
    rows = []
    runs = [
        ("nanoserve float32", dict(dtype="float32")),
        ("nanoserve bfloat16, bfloat16 matrices", dict(dtype="bfloat16", q4_max_tokens=0)),
        ("nanoserve bfloat16, 4-bit x 8-bit (default)", dict(dtype="bfloat16")),
    ]
    from worker.config import WorkerConfig
    from worker.plan import resolve_dtype

    if resolve_dtype(WorkerConfig(model=None), "cpu") == "float32":
        # A CPU without native bfloat16: the default is float32 on the 4-bit weights times
        # 8-bit activations (csrc/q4a8_linear_f32.cpp), and the bfloat16 rows are not it.
        runs.append(("nanoserve auto: float32, 4-bit x 8-bit (default here)", dict(dtype="auto")))
    for name, config in runs:
        rows.append({"run": name, **score(steps, nanoserve_answers(steps, **config))})
        print(json.dumps(rows[-1]), flush=True)
    if args.llama_server:
        from compare_servers import start_llama_server

        with tempfile.TemporaryDirectory() as logs:
            server = start_llama_server(
                args.llama_server, files.source, Path(logs), slots=1, threads=2, slot_context=1024
            )
            try:
                answers = llama_answers(server.url, steps)
            finally:
                server.stop()
        rows.append({"run": "llama.cpp server (Q4_1 x Q8_1)", **score(steps, answers)})
        print(json.dumps(rows[-1]), flush=True)
    print()
    print("| run | steps | argmax agrees | max / mean abs logprob error | not in top |")
    print("| --- | ---: | ---: | --- | ---: |")
    for row in rows:
        print(
            f"| {row['run']} | {row['steps']} | {row['agreement']:.1%} | "
            f"{row['max_logprob_error']:.3f} / {row['mean_logprob_error']:.4f} | "
            f"{row['reference_token_not_in_top']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
