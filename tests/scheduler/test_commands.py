"""The console commands: sweep-watermark and bench scheduler (no model), soak and generate on
a seeded tiny model through the real worker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nanoserve.cli import main
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0))


def test_sweep_watermark_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep-watermark", "--reserves", "0,3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("reserve\tevictions")
    assert lines[2].split("\t")[0] == "0 blocks" and lines[3].split("\t")[:2] == ["3 blocks", "0"]


def test_sweep_watermark_bad_reserves_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep-watermark", "--reserves", "x"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_bench_scheduler_prints_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "scheduler", "--running", "32", "--repeats", "3", "--steps", "20"]
    assert main([*args, "--audit-blocks", "4096"]) == 0
    out = capsys.readouterr().out
    assert "schedule() with 32 running requests:" in out
    assert "plan a step (Engine.plan) with 32 running:" in out
    loop = re.search(r"CPU per output token with 32 running: ([0-9.]+) us .* over (\d+) steps", out)
    assert loop is not None and float(loop.group(1)) > 0 and int(loop.group(2)) >= 20
    assert "full audit of a 4096-block pool" in out
    assert main([*args, "--audit-blocks", "0"]) == 0
    assert "full audit" not in capsys.readouterr().out


def test_soak_with_a_leak_exits_non_zero_naming_the_block(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["soak", "--model", tiny, "--inject-leak", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    # torch < 2.8 (CUDA builds, no GPU, nvcc on PATH) prints this on importing cpp_extension.
    err = [line for line in err if not line.startswith("No CUDA runtime is found")]
    assert len(err) == 1
    assert err[0].startswith("InvariantViolation at iteration ")
    assert "is allocated but no request holds it" in err[0]


def test_soak_without_a_leak_reports(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["soak", "--model", tiny, "--num-blocks", "5", "--requests", "6"]) == 0
    out = capsys.readouterr().out
    assert "every block back" in out and "evictions" in out


def test_generate_prints_one_line_per_prompt_in_order(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": [3 + i, 4, 5]}) for i in range(3)))
    assert (
        main(
            [
                "generate",
                "--model",
                tiny,
                "--prompts-file",
                str(prompts),
                "--max-tokens",
                "4",
                "--num-blocks",
                "6",
                "--block-size",
                "4",
                "--num-slots",
                "2",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and all(len(x["token_ids"]) <= 4 and "text" in x for x in lines)
    assert (
        main(["generate", "--model", tiny, "--prompts-file", str(prompts), "--max-tokens", "4"])
        == 0
    )
    roomy = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["token_ids"] for x in roomy] == [x["token_ids"] for x in lines]


def test_a_line_s_own_max_tokens_overrides_the_flag(
    tiny: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt_token_ids": [3, 4, 5], "max_tokens": 2}, {"prompt_token_ids": [3, 4, 5]}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = ["generate", "--model", tiny, "--prompts-file", str(prompts), "--max-tokens", "6"]
    assert main(command) == 0
    short, long = (json.loads(x)["token_ids"] for x in capsys.readouterr().out.splitlines())
    assert len(long) > 2, "the tiny model stopped too soon to tell the limits apart"
    assert short == long[:2]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1, got 2.5"),
        ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
        ({"temperature": "hot"}, "temperature must be a finite number >= 0, got 'hot'"),
    ],
)
def test_generate_rejects_a_bad_override(
    override: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "bad.jsonl"
    lines = [{"prompt": "hi"}, {"prompt": "x", **override}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["generate", "--prompts-file", str(prompts)]) == 2
    assert f"bad.jsonl:2: {message}" in capsys.readouterr().err


def test_generate_rejects_a_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"nothing": 1}\n')
    assert main(["generate", "--prompts-file", str(prompts)]) == 2
    assert "need one of prompt, messages, prompt_token_ids" in capsys.readouterr().err


def test_soak_with_shared_prefixes_hits_keeps_the_text_and_catches_a_leak(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = ["soak", "--model", tiny, "--requests", "12", "--shared-prefix-blocks", "2"]
    reports = {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        assert main([*shared, flag]) == 0
        reports[flag] = capsys.readouterr().out
    hits = re.search(r"prefix cache hits\s+(\d+) of (\d+)", reports["--enable-prefix-caching"])
    assert hits and int(hits[1]) > 0
    assert "prefix cache hits   0 of" in reports["--no-enable-prefix-caching"]
    digests = {re.search(r"text digest\s+(\w+)", out)[1] for out in reports.values()}
    assert len(digests) == 1  # the same tokens with and without the cache
    assert main([*shared, "--inject-leak", "3"]) == 1
    err = capsys.readouterr().err
    assert "is allocated but no request holds it" in err


def test_soak_with_speculation_passes_its_audit_with_the_same_text(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny model through a pool that preempts, drafts verified every step they can be,
    audited every iteration: the same tokens as without them, with drafts accepted."""
    base = ["soak", "--model", tiny, "--requests", "8", "--max-tokens", "24"]
    base += ["--num-blocks", "12", "--prompt-len", "8"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--num-speculative-tokens", "4"]) == 0
    speculated = capsys.readouterr().out
    drafts = re.search(r"draft tokens\s+(\d+) of (\d+) accepted in (\d+)", speculated)
    assert drafts and int(drafts[1]) > 0 and int(drafts[3]) > 0
    evictions = re.search(r"evictions\s+(\d+)", speculated)
    assert evictions and int(evictions[1]) > 0
    digest = re.compile(r"text digest\s+(\w+)")
    assert digest.search(plain)[1] == digest.search(speculated)[1]
