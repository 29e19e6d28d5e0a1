"""``nanoserve bench serve --structured json-schema`` against the scripted stub: the same load
runs twice, the second with every request under the JSON schema, each with its own cache salt;
the comparison and the mask time per token (from /metrics) are printed and written as JSON."""

from __future__ import annotations

import asyncio
import json

import pytest

from nanoserve.bench.structured import RESPONSE_FORMAT
from tests.bench.cli import bench_serve
from tests.bench.stub_openai_server import StubOpenAIServer, StubScript

pytestmark = pytest.mark.timeout(20)


async def test_structured_runs_the_load_twice_and_compares(tmp_path, capsys):
    path = tmp_path / "out.json"
    async with StubOpenAIServer(StubScript(first_delay=0.0, token_delay=0.001)) as stub:
        argv = ["--base-url", stub.base_url, "--num-prompts", "6", "--output-len", "4"]
        argv += ["--max-concurrency", "3", "--structured", "json-schema", "--json", str(path)]
        assert await asyncio.to_thread(bench_serve, argv) == 0
    out = capsys.readouterr().out
    free, bound = stub.bodies[:7], stub.bodies[7:]  # each run: 1 warmup + 6 timed
    assert len(bound) == 7 and not any("response_format" in b for b in free)
    assert all(b["response_format"] == RESPONSE_FORMAT for b in bound)
    assert {b["cache_salt"] for b in free}.isdisjoint({b["cache_salt"] for b in bound})
    report = json.loads(path.read_text())
    free_tps, bound_tps = (report[k]["output_throughput"] for k in ("unconstrained", "json_schema"))
    assert report["throughput_ratio"] == pytest.approx(bound_tps / free_tps)
    assert report["json_schema"]["grammar_fill_us_per_token"] == pytest.approx(8.0)
    assert report["json_schema"]["grammar_apply_us_per_token"] == pytest.approx(2.0)
    assert report["unconstrained"]["grammar_fill_us_per_token"] is None  # no masked tokens
    assert "json-schema / unconstrained:" in out and "Mask fill, us per token" in out
    fill_rows = [line for line in out.splitlines() if line.startswith("Grammar mask fill")]
    assert [row.split()[-1] for row in fill_rows] == ["8.00"]
