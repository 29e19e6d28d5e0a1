"""``nanoserve bench serve`` end to end against a scripted OpenAI-compatible stub server on a
free loopback port: counts, token totals, latencies against the scripted delays, the
concurrency cap, Poisson pacing, failures, goodput, /metrics busy ratio, CLI table and JSON."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

from nanoserve.bench.data import arrival_offsets
from nanoserve.bench.serve import BenchServe, BenchServeConfig
from nanoserve.cli import UserError
from nanoserve.commands import bench_serve as command
from tests.bench.cli import bench_serve
from tests.bench.stub_openai_server import MODEL, StubOpenAIServer, StubScript

pytestmark = pytest.mark.timeout(20)


async def _bench(stub: StubOpenAIServer, **overrides) -> dict:
    args = dict(base_url=stub.base_url, num_prompts=12, input_len=16, output_len=8)
    args |= dict(num_warmups=0, request_timeout=10.0) | overrides
    return await BenchServe(BenchServeConfig(**args)).run()


async def test_fixed_concurrency_run_measures_the_scripted_stream():
    script = StubScript(first_delay=0.02, token_delay=0.005)
    async with StubOpenAIServer(script) as stub:
        report = await _bench(stub, max_concurrency=4, num_warmups=2)
    assert (report["completed"], report["failed"], report["model"]) == (12, 0, MODEL)
    assert len(stub.bodies) == 14  # 2 warmups + 12 timed
    warm, timed = [b["prompt"] for b in stub.bodies[:2]], [b["prompt"] for b in stub.bodies[2:]]
    assert not any(p in timed for p in warm)  # no timed prompt was warmed into a cache
    assert stub.peak_in_flight == 4  # the cap was reached and held
    assert all(len(b["prompt"]) == 16 and b["max_tokens"] == 8 for b in stub.bodies)
    assert (report["total_input_tokens"], report["total_output_tokens"]) == (192, 96)
    duration = report["duration_s"]
    assert report["output_throughput"] == pytest.approx(96 / duration)
    assert report["total_token_throughput"] == pytest.approx(288 / duration)
    # 3 waves of 4, each at least 20 ms + 7 x 5 ms of scripted delay.
    assert duration >= 3 * 0.055 * 0.95
    assert 19.0 <= report["ttft_ms"]["median"] < 500.0
    assert 3.0 <= report["tpot_ms"]["median"] < 100.0
    assert 0.0 < report["itl_ms"]["median"] < 100.0
    # Same gaps, except TPOT also spans the short tail from the last token to [DONE].
    assert report["itl_ms"]["mean"] == pytest.approx(report["tpot_ms"]["mean"], rel=0.1)
    assert report["e2el_ms"]["median"] >= 54.0
    # /metrics: the stub adds exactly 0.01 busy seconds per request; warmups were before.
    assert report["worker_busy_seconds"] == pytest.approx(0.12)
    assert 0.0 < report["worker_busy_ratio"] <= 0.12 / duration
    # The stub counts a step per busy millisecond and a hundredth of it as scheduler time.
    assert report["scheduler_steps"] == 120
    assert report["scheduler_ms_per_step"] == pytest.approx(0.01)
    # Its resident memory grows a MiB per request body: 2 warmups before, 12 timed ones after.
    assert (report["worker_rss_mib_start"], report["worker_rss_mib_end"]) == (102.0, 114.0)
    # Its CPU seconds grow by 4 ms (frontend) and 2 ms (scheduler) a request: 12 requests of 8
    # tokens.
    assert report["frontend_cpu_us_per_token"] == pytest.approx(12 * 4000 / 96)
    assert report["scheduler_cpu_us_per_token"] == pytest.approx(12 * 2000 / 96)


async def test_failures_are_counted_not_raised():
    async with StubOpenAIServer(StubScript(fail_every=3, first_delay=0.0)) as stub:
        report = await _bench(stub, num_prompts=9, max_concurrency=2)
    assert (report["completed"], report["failed"]) == (6, 3)
    [(error, count)] = report["errors"].items()
    assert error.startswith("HTTP 500: ") and "scripted failure" in error and count == 3
    assert report["total_output_tokens"] == 6 * 8


async def test_poisson_arrivals_follow_the_seeded_schedule():
    rate, seed = 20.0, 7
    offsets = arrival_offsets(8, rate, seed)
    async with StubOpenAIServer(StubScript(first_delay=0.0, token_delay=0.0)) as stub:
        before = time.perf_counter()  # the stub stamps arrivals with this same clock
        report = await _bench(stub, num_prompts=8, request_rate=rate, seed=seed)
    assert report["completed"] == 8 and report["request_rate"] == rate
    assert offsets[-1] > 0.1  # a schedule worth checking: not all at once
    # No request arrives before its offset from the start (1 ms slack for timer granularity).
    for seen, planned in zip(sorted(stub.arrivals), offsets, strict=True):
        assert seen - before >= planned - 0.001
    assert report["duration_s"] >= offsets[-1]


async def test_chat_endpoint_without_usage_counts_chunks():
    async with StubOpenAIServer(StubScript(first_delay=0.0, token_delay=0.0)) as stub:
        report = await _bench(
            stub, endpoint_type="chat", prompt_format="text", stream_usage=False, num_prompts=3
        )
    assert report["completed"] == 3 and report["endpoint"].endswith("/v1/chat/completions")
    assert report["total_output_tokens"] == 24  # counted from chunks; role-only one skipped
    assert report["total_input_tokens"] == 48  # word counts: no usage to correct them
    assert all("stream_options" not in b and "messages" in b for b in stub.bodies)


async def test_goodput_against_slos():
    async with StubOpenAIServer(StubScript(first_delay=0.03, token_delay=0.0)) as stub:
        loose = await _bench(stub, num_prompts=4, goodput={"ttft": 10_000.0, "e2el": 10_000.0})
        strict = await _bench(stub, num_prompts=4, goodput={"ttft": 1.0})
    assert loose["request_goodput"] == pytest.approx(loose["request_throughput"])
    assert strict["request_goodput"] == 0.0 and strict["completed"] == 4


async def test_unreachable_server_is_a_one_line_user_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once closed
    config = BenchServeConfig(base_url=f"http://127.0.0.1:{port}", num_warmups=0)
    with pytest.raises(UserError, match="is the server up"):
        await BenchServe(config).run()


async def test_cli_prints_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    async with StubOpenAIServer(StubScript(metrics=False, first_delay=0.0)) as stub:
        argv = ["--base-url", stub.base_url, "--num-prompts", "5", "--input-len", "4"]
        argv += ["--output-len", "3", "--max-concurrency", "2", "--json", str(path)]
        extra = ["--goodput", "ttft:5000", "--extra-body", '{"cache_prompt": false}']
        assert await asyncio.to_thread(bench_serve, [*argv, *extra]) == 0
        table = capsys.readouterr().out
        assert await asyncio.to_thread(bench_serve, [*argv[:-2], "--json", "-"]) == 0
        streamed = capsys.readouterr()
    for label in ("Successful requests:", "Output token throughput", "P99 ITL (ms):"):
        assert label in table
    assert "Serving Benchmark Result" in table and "Worker busy ratio:" in table
    busy_row = next(line for line in table.splitlines() if line.startswith("Worker busy"))
    assert busy_row.split()[-1] == "n/a"  # this stub has no /metrics
    report = json.loads(path.read_text())
    assert json.loads(streamed.out)["completed"] == 5  # stdout is pure JSON with '-'
    assert "Serving Benchmark Result" in streamed.err
    assert report["goodput_slos_ms"] == {"ttft": 5000.0} and report["completed"] == 5
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(report[key]) == {"mean", "median", "p99"}
    expected = {"duration_s", "request_throughput", "output_throughput", "request_goodput"}
    expected |= {"total_token_throughput", "worker_busy_ratio", "errors", "failed"}
    assert expected <= set(report) and report["worker_busy_ratio"] is None
    assert all(body["cache_prompt"] is False for body in stub.bodies[:6])  # warmup + 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--extra-body", "[1]"], "JSON object"),
        (["--json", "/nonexistent-dir/x.json"], "cannot write --json"),
    ],
)
async def test_cli_flag_errors_are_one_line(argv, message, capsys):
    async with StubOpenAIServer(StubScript(first_delay=0.0, token_delay=0.0)) as stub:
        base = ["--base-url", stub.base_url, "--num-prompts", "1", "--output-len", "1"]
        try:
            await asyncio.to_thread(bench_serve, [*base, *argv])
        except SystemExit:  # argparse: usage line plus one error line
            assert message in capsys.readouterr().err
        except ValueError as exc:  # nanoserve.cli.main prints these as one line
            assert message in str(exc)
        else:
            pytest.fail("bad flag accepted")


def test_registered_under_bench_and_torch_free():
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--num-prompts", "3"])
    assert args.func is command.run and args.num_prompts == 3
    code = (
        "import sys, nanoserve.bench.serve, nanoserve.commands.bench_serve;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=15).returncode == 0


async def test_multi_turn_feeds_each_reply_back_and_reports_ttft_by_turn():
    async with StubOpenAIServer(StubScript(first_delay=0.01, token_delay=0.001)) as stub:
        report = await _bench(
            stub,
            endpoint_type="chat",
            prompt_format="text",
            dataset="multi-turn",
            num_conversations=3,
            turns=4,
            system_len=20,
            input_len=5,
            output_len=3,
            num_warmups=1,
        )
    warm, timed = stub.bodies[:4], stub.bodies[4:]
    assert (report["completed"], report["failed"], len(timed)) == (12, 0, 12)
    systems = {b["messages"][0]["content"] for b in timed}
    assert len(systems) == 1 and warm[0]["messages"][0]["content"] not in systems
    by_length = sorted(timed, key=lambda b: len(b["messages"]))
    assert [len(b["messages"]) for b in by_length] == [2] * 3 + [4] * 3 + [6] * 3 + [8] * 3
    for body in by_length[3:]:  # each reply came back as the assistant message before it
        assert [m["role"] for m in body["messages"][-3:]] == ["user", "assistant", "user"]
        assert body["messages"][-2]["content"] == " t0 t1 t2"
        assert body["max_tokens"] == 3 and body["ignore_eos"] and body["stream"]
    turns = report["per_turn"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4] and all(t["completed"] == 3 for t in turns)
    assert turns[0]["cached_share"] == pytest.approx(25 / 30)  # the 25-word system prompt
    assert turns[0]["mean_prompt_tokens"] < turns[3]["mean_prompt_tokens"]
    assert report["ttft_later_turns_ms"]["mean"] >= 9.0
    assert "Multi-turn: TTFT by turn" in command.format_table(report)


async def test_random_prefix_len_shares_one_prefix():
    async with StubOpenAIServer(StubScript(first_delay=0.0, token_delay=0.0)) as stub:
        report = await _bench(stub, random_prefix_len=40, num_prompts=5, num_warmups=1)
    warm, timed = stub.bodies[0]["prompt"], [b["prompt"] for b in stub.bodies[1:]]
    assert report["total_input_tokens"] == 5 * (40 + 16)
    assert all(p[:40] == timed[0][:40] for p in timed) and len({tuple(p) for p in timed}) == 5
    assert warm[:40] != timed[0][:40]  # the warmup cannot prime the timed prefix


def test_multi_turn_needs_the_chat_endpoint():
    with pytest.raises(ValueError, match="multi-turn dataset needs --endpoint-type chat"):
        BenchServeConfig(dataset="multi-turn", prompt_format="text")


async def test_a_watch_sees_the_timed_load_only():
    seen: list[tuple[str, int]] = []
    async with StubOpenAIServer(StubScript()) as stub:

        class Watch:
            def start(self) -> None:
                seen.append(("start", len(stub.bodies)))

            def stop(self) -> None:
                seen.append(("stop", len(stub.bodies)))

        args = dict(base_url=stub.base_url, num_prompts=5, input_len=4, output_len=2)
        await BenchServe(BenchServeConfig(**args, num_warmups=2), watch=Watch()).run()
    assert seen == [("start", 2), ("stop", 7)]  # after the warm-ups, around the five timed
