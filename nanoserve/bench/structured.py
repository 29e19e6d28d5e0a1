"""``nanoserve bench serve --structured json-schema``: what structured outputs cost a server.

The same load runs twice in one invocation: unconstrained, then with every request under one
JSON schema (OpenAI's ``response_format``). The schema asks for more items than any reply
reaches, so the grammar constrains every token of every reply (no request finishes early and
no step runs without masks), and both runs generate the same number of tokens
(``ignore_eos``). Each run has its own ``cache_salt``: the second never finds the first's
prompts in the prefix cache. The report puts the two output throughputs side by side, with the
worker's mask time per constrained token read from nanoserve's /metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nanoserve.bench.serve import BenchServe, BenchServeConfig

# An inventory of at least 64 records: a nested object, a bounded string, an integer range, an
# enum array. llguidance compiles it in about a millisecond.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "store": {"type": "string", "maxLength": 32},
        "items": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "quantity": {"type": "integer", "minimum": 0, "maximum": 999},
                    "tags": {
                        "type": "array",
                        "items": {"enum": ["new", "used", "sale", "rare"]},
                        "maxItems": 3,
                    },
                },
                "required": ["name", "quantity", "tags"],
            },
        },
    },
    "required": ["store", "items"],
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "inventory", "schema": SCHEMA, "strict": True},
}


def _with(config: BenchServeConfig, salt: str, **extra: Any) -> BenchServeConfig:
    body = {**config.extra_body, "cache_salt": salt, **extra}
    return dataclasses.replace(config, extra_body=body)


async def compare(config: BenchServeConfig) -> dict[str, Any]:
    """Run the load unconstrained, then under ``SCHEMA``; both reports and their ratio."""
    free = await BenchServe(_with(config, "bench-unconstrained")).run()
    bound = await BenchServe(_with(config, "bench-json", response_format=RESPONSE_FORMAT)).run()
    ratio = None
    if free["output_throughput"]:
        ratio = bound["output_throughput"] / free["output_throughput"]
    return {"unconstrained": free, "json_schema": bound, "throughput_ratio": ratio}


def format_comparison(result: dict[str, Any]) -> str:
    """The side-by-side lines printed after both runs' tables."""
    free, bound = result["unconstrained"], result["json_schema"]
    ratio = result["throughput_ratio"]

    def number(value: float | None, unit: str = "") -> str:
        return "n/a" if value is None else f"{value:.1f}{unit}"

    lines = [
        " Structured outputs: the same load twice ".center(50, "="),
        f"{'Output tok/s, unconstrained:':<40} {number(free['output_throughput'])}",
        f"{'Output tok/s, every request json-schema:':<40} {number(bound['output_throughput'])}",
        f"{'json-schema / unconstrained:':<40} {'n/a' if ratio is None else f'{ratio:.1%}'}",
        f"{'Mask fill, us per token (beside fwd):':<40} "
        + number(bound.get("grammar_fill_us_per_token")),
        f"{'Mask wait+apply, us per token:':<40} "
        + number(bound.get("grammar_apply_us_per_token")),
        f"{'Failed requests (unconstrained, json):':<40} {free['failed']}, {bound['failed']}",
        "=" * 50,
    ]
    return "\n".join(lines)
