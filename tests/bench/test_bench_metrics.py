"""Pure parts of ``nanoserve bench serve``: stream timing on a fake clock, the metric
arithmetic, goodput, /metrics parsing, seeded workloads and arrivals, config validation."""

from __future__ import annotations

import json
import statistics

import pytest

from nanoserve.bench.data import (
    FIRST_PLAIN_TOKEN,
    arrival_offsets,
    build_workload,
    load_shipped_prompts,
)
from nanoserve.bench.metrics import (
    RequestResult,
    acceptance,
    busy_ratio,
    meets_slos,
    percentile,
    scheduler_ms_per_step,
    summarize,
    worker_busy_seconds,
)
from nanoserve.bench.serve import BenchServeConfig, StreamError, read_stream, request_payload
from nanoserve.commands.bench_serve import parse_slos


async def _lines(events: list[bytes]):
    for event in events:
        yield event


def _data(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n"


def _fake_clock(times: list[float]):
    it = iter(times)
    return lambda: next(it)


async def test_stream_timing_on_fake_clock_uses_usage_for_tokens():
    events = [b": keep-alive\n", b"\n"]
    events += [_data({"choices": [{"text": f"t{i}"}]}) for i in range(4)]
    events += [_data({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}})]
    events += [b"data: [DONE]\n", _data({"choices": [{"text": "after done"}]})]
    result = RequestResult(prompt_len=3)
    clock = _fake_clock([10.10, 10.15, 10.22, 10.30, 10.31])  # 4 chunks, then the end
    await read_stream(_lines(events), result, 10.0, clock, chat=False)
    assert result.ttft == pytest.approx(0.10)
    assert result.itl == pytest.approx([0.05, 0.07, 0.08])
    assert result.latency == pytest.approx(0.31)
    assert (result.output_len, result.prompt_len) == (5, 7)  # usage wins over chunk count
    assert result.tpot == pytest.approx((0.31 - 0.10) / 4)


async def test_chat_stream_without_usage_counts_text_chunks_only():
    events = [_data({"choices": [{"delta": {"role": "assistant"}}]})]  # no text: not a token
    events += [_data({"choices": [{"delta": {"content": c}}]}) for c in ("a", "", "b", "c")]
    events += [b"data: [DONE]\n"]
    result = RequestResult(prompt_len=3)
    await read_stream(_lines(events), result, 0.0, _fake_clock([1.0, 1.5, 2.5, 3.0]), chat=True)
    assert (result.ttft, result.itl, result.latency) == (1.0, [0.5, 1.0], 3.0)
    assert (result.output_len, result.prompt_len) == (3, 3)


@pytest.mark.parametrize(
    "bad, message", [(_data({"error": {"message": "boom"}}), "boom"), (b"data: [1]\n", "object")]
)
async def test_error_or_odd_event_in_stream_raises(bad, message):
    events = [_data({"choices": [{"text": "a"}]}), bad]
    with pytest.raises(StreamError, match=message):
        await read_stream(_lines(events), RequestResult(1), 0.0, _fake_clock([1.0]), False)


def test_percentile_interpolates_like_numpy():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def _ok(ttft: float, itl: list[float], out: int, prompt: int = 10) -> RequestResult:
    return RequestResult(prompt, out, ttft, itl, ttft + sum(itl))


def test_summarize_arithmetic_and_failures():
    results = [
        _ok(0.1, [0.02, 0.02, 0.02], 4),
        _ok(0.3, [0.04], 2),
        RequestResult(10, error="HTTP 500: x"),
        RequestResult(10, error="HTTP 500: x"),
    ]
    s = summarize(results, duration=2.0, slos={})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 2, {"HTTP 500: x": 2})
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (20, 6)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0
    assert s["total_token_throughput"] == 13.0 and s["request_goodput"] is None
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["itl_ms"]["median"] == pytest.approx(20.0)
    assert s["itl_ms"]["mean"] == pytest.approx(25.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(30.0)  # (20 + 40) / 2
    assert s["e2el_ms"]["p99"] == pytest.approx(340 - 0.01 * 180)


def test_summarize_with_nothing_completed_reports_none():
    s = summarize([RequestResult(5, error="x")], duration=1.0, slos={"ttft": 1.0})
    assert s["ttft_ms"] == {"mean": None, "median": None, "p99": None}
    assert (s["completed"], s["request_goodput"]) == (0, 0.0)


def test_goodput_counts_requests_within_every_slo():
    fast, slow_tpot = _ok(0.1, [0.01, 0.01], 3), _ok(0.1, [0.09, 0.09], 3)
    assert meets_slos(fast, {"ttft": 100.0, "tpot": 50.0})  # limits are inclusive
    assert not meets_slos(slow_tpot, {"ttft": 100.0, "tpot": 50.0})
    assert not meets_slos(fast, {"e2el": 119.0})
    assert not meets_slos(RequestResult(1, error="x"), {})
    s = summarize([fast, slow_tpot, fast], duration=0.5, slos={"tpot": 50.0})
    assert s["request_goodput"] == 4.0  # 2 good requests / 0.5 s


def test_worker_busy_counter_parsed_from_prometheus_text():
    text = (
        "# TYPE nanoserve:worker_busy_seconds_total counter\n"
        'nanoserve:worker_busy_seconds_total{worker="0"} 1.5\n'
        'nanoserve:worker_busy_seconds_total{worker="1",x="a b"} 2.5\n'
        'nanoserve:worker_busy_seconds_created{worker="0"} 1.7e9\n'
        "other_total 9\n"
    )
    assert worker_busy_seconds(text) == ("nanoserve:worker_busy_seconds_total", 4.0)
    assert worker_busy_seconds("worker_busy 3\n") == ("worker_busy", 3.0)
    assert worker_busy_seconds("other_total 9\n") is None


def test_scheduler_ms_per_step_needs_both_metrics() -> None:
    before = {"scheduler_busy": ("s_total", 1.0), "num_steps": ("n", 100.0)}
    after = {"scheduler_busy": ("s_total", 1.5), "num_steps": ("n", 600.0)}
    assert scheduler_ms_per_step(before, after) == pytest.approx(1.0)
    assert scheduler_ms_per_step(before, {"num_steps": ("n", 600.0)}) is None
    assert scheduler_ms_per_step(before, {**after, "num_steps": ("n", 100.0)}) is None
    before, after = ("m", 1.0), ("m", 5.0)
    assert busy_ratio(before, after, wall=8.0) == 0.5
    assert busy_ratio(None, after, wall=8.0) is None
    assert busy_ratio(("other", 1.0), after, wall=8.0) is None


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    first = arrival_offsets(2000, rate=20.0, seed=3)
    assert first == arrival_offsets(2000, rate=20.0, seed=3)
    assert first != arrival_offsets(2000, rate=20.0, seed=4)
    gaps = [b - a for a, b in zip(first, first[1:], strict=False)]
    assert first[0] == 0.0 and min(gaps) > 0
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20.0, rel=0.15)  # exponential: sd = mean
    assert arrival_offsets(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]


def _workload(**overrides):
    args = dict(dataset="random", prompt_format="ids", num_prompts=40, input_len=50)
    args |= dict(output_len=20, range_ratio=0.0, vocab_size=1000, seed=0) | overrides
    return build_workload(**args)


def test_random_token_workload_is_seeded_with_exact_lengths():
    reqs = _workload()
    assert reqs == _workload() and reqs != _workload(seed=1)
    assert all(len(r.prompt) == r.prompt_len == 50 and r.output_len == 20 for r in reqs)
    assert all(FIRST_PLAIN_TOKEN <= t < 1000 for r in reqs for t in r.prompt)
    varied = _workload(range_ratio=0.5)
    assert {len(r.prompt) for r in varied} <= set(range(25, 76))
    assert len({r.output_len for r in varied}) > 5
    assert all(10 <= r.output_len <= 30 for r in varied)


def test_text_and_shipped_workloads():
    text = _workload(prompt_format="text")
    assert all(len(r.prompt.split()) == r.prompt_len == 50 for r in text)
    shipped = _workload(dataset="shipped", num_prompts=60)
    prompts = load_shipped_prompts()
    assert len(set(prompts)) >= 50
    assert {r.prompt for r in shipped} == set(prompts)  # 60 picks cycle through all 52
    assert all(r.output_len == 20 for r in shipped)


def test_repetitive_workload_asks_for_its_own_text_back():
    reqs = _workload(dataset="repetitive", prompt_format="text", num_prompts=40, input_len=60)
    assert reqs == _workload(
        dataset="repetitive", prompt_format="text", num_prompts=40, input_len=60
    )
    kinds = {r.prompt.split(",")[0].split(" this ")[0] for r in reqs}
    assert kinds == {"Rewrite", "Return"}  # paragraphs to rewrite and JSON to return
    shipped = load_shipped_prompts()
    for r in reqs:
        body = r.prompt.split("\n\n", 1)[1]
        assert r.prompt_len >= 60 and r.output_len == 20
        if r.prompt.startswith("Return"):
            assert set(json.loads(body).values()) <= set(shipped)
        else:
            assert any(text in body for text in shipped)


def test_acceptance_from_two_scrapes():
    before = {
        "spec_decode_num_drafts": ("d_total", 10.0),
        "spec_decode_num_draft_tokens": ("t_total", 40.0),
        "spec_decode_num_accepted_tokens": ("a_total", 20.0),
    }
    after = {key: (name, value * 3) for key, (name, value) in before.items()}
    # 20 verifications of 80 drafts that accepted 40: 60 tokens, 3 a verification.
    assert acceptance(before, after) == {
        "spec_drafts": 20.0,
        "spec_draft_tokens": 80.0,
        "spec_accepted_tokens": 40.0,
        "spec_acceptance_length": 3.0,
    }
    assert acceptance({}, {})["spec_acceptance_length"] is None  # a server without them


def test_payload_forces_length_and_greedy():
    config = BenchServeConfig()
    req = _workload(num_prompts=1)[0]
    body = request_payload(config, "m", req)
    assert body["prompt"] == req.prompt and body["max_tokens"] == 20
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"]
    assert body["stream_options"] == {"include_usage": True}
    chat = request_payload(
        BenchServeConfig(endpoint_type="chat", prompt_format="text", stream_usage=False), "m", req
    )
    assert chat["messages"][0]["role"] == "user" and "stream_options" not in chat
    assert chat["max_completion_tokens"] == 20 and "prompt" not in chat
    extra = BenchServeConfig(temperature=0.7, extra_body={"cache_prompt": False, "top_k": 1})
    body = request_payload(extra, "m", req)
    assert (body["temperature"], body["cache_prompt"], body["top_k"]) == (0.7, False, 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"endpoint_type": "chat"}, "prompt-format text"),
        ({"range_ratio": 1.0}, "range-ratio"),
        ({"goodput": {"itl": 5.0}}, "goodput SLO itl"),
        ({"max_concurrency": 0}, "max-concurrency"),
        ({"request_rate": 0.0}, "request-rate"),
        ({"dataset": "sharegpt"}, "dataset"),
    ],
)
def test_config_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        BenchServeConfig(**overrides)


def test_goodput_flag_parsing():
    assert parse_slos(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in ("ttft", "ttft:fast"):
        with pytest.raises(ValueError, match="KEY:MILLISECONDS"):
            parse_slos([bad])
    assert BenchServeConfig(base_url="http://h:1/v1/").endpoint_url == "http://h:1/v1/completions"
