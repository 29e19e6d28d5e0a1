"""The GPU check's verdicts and its table: each of issue 44's bars against what the run
measured, then the speed levels beside transformers' static batches, then every step.

A bar is met (yes), missed (no) or not judged (-: the step did not run, or a CPU smoke run,
whose speed means nothing).
"""

from __future__ import annotations

import re

# (name, bar as text, how to read the measured value, the test)
SPEED_BARS = (
    ("concurrency 1: median ITL", "<= 2 ms (stretch 1)", "c1", "median_itl_ms", lambda v: v <= 2),
    ("concurrency 1: median TTFT", "<= 25 ms", "c1", "median_ttft_ms", lambda v: v <= 25),
    (
        "concurrency 256: output tok/s",
        ">= 40,000 (stretch 60,000)",
        "c256",
        "output_throughput",
        lambda v: v >= 40_000,
    ),
    (
        "concurrency 256: GPU utilization",
        ">= 70%",
        "c256",
        "gpu_utilization_pct",
        lambda v: v >= 70,
    ),
)


def evaluate(result: dict) -> list[dict]:
    """Every bar: what was measured, the bar, and whether it is met (None: not judged)."""
    steps = result.get("steps", {})
    smoke = result.get("mode") != "gpu"
    bars = []

    def add(name: str, measured, bar: str, met, speed: bool = False) -> None:
        bars.append({"check": name, "measured": measured, "bar": bar, "met": met, "speed": speed})

    tests = steps.get("cuda tests")
    if tests is not None:
        passed = tests.get("tests", 0) - tests.get("failures", 0) - tests.get("errors", 0)
        ran = passed - tests.get("skipped", 0)
        ok = tests.get("ok")
        add(
            "CUDA tests (pytest -m gpu)",
            f"{ran} passed, {tests.get('skipped', 0)} skipped",
            "all pass, and on a GPU some run",
            ok if smoke or not ok else ran > 0,
        )
    exact = steps.get("float32 greedy vs transformers", {})
    for how in ("together", "one_by_one"):
        found = exact.get(how)
        text = f"{found['matched']} of {found['of']}" if found else None
        add(
            f"float32 greedy = transformers, {how.replace('_', ' ')}",
            text,
            "8 of 8",
            None if found is None else found["matched"] == found["of"],
        )
    eager = steps.get("graphs vs eager tokens", {})
    same = eager.get("same")
    add(
        "bfloat16 graphs = eager, 8 prompts",
        f"{same['matched']} of {same['of']}" if same else eager.get("note"),
        "8 of 8",
        None if same is None else same["matched"] == same["of"],
    )
    kill = steps.get("worker SIGKILL mid-stream", {})
    add(
        "worker SIGKILL mid-stream: undisturbed streams",
        f"{kill['streams_undisturbed']} of {kill['of']}" if "of" in kill else None,
        "all",
        kill.get("ok") if "of" in kill else None,
    )
    shared = steps.get("worker SIGKILL on the shared pool", {})
    add(
        "shared pool SIGKILL: re-attached, tokens recomputed",
        f"{shared.get('reattaches')} re-attach, {shared.get('recomputed')} tokens"
        if "of" in shared
        else None,
        "1, <= 2 a stream",
        shared.get("ok") if "of" in shared else None,
    )
    levels = {f"c{lv['concurrency']}": lv for lv in steps.get("speed levels", {}).get("levels", [])}
    for name, bar, level, key, test in SPEED_BARS:
        value = levels.get(level, {}).get(key)
        add(name, value, bar, None if smoke or value is None else test(value), speed=True)
    capture = capture_seconds(steps.get("speed levels", {}).get("capture_log", []))
    met = None if smoke or capture is None else capture <= 30
    add("graph capture", capture, "<= 30 s", met, speed=True)
    return bars


def failed_checks(result: dict) -> list[str]:
    """The correctness checks that failed: a step that broke, or a bar other than speed
    missed (the speed bars are reported, not enforced)."""
    broken = [name for name, step in result.get("steps", {}).items() if step.get("ok") is False]
    missed = [b["check"] for b in result.get("bars", []) if b["met"] is False and not b["speed"]]
    return broken + missed


def capture_seconds(lines: list[str]) -> float | None:
    """The seconds a worker's capture log line states ("... in 12.3 s"), if one does."""
    for line in lines:
        found = re.search(r"(\d+(?:\.\d+)?)\s*s\b", line)
        if found:
            return float(found.group(1))
    return None


def format_report(result: dict) -> str:
    """The whole report as Markdown."""
    machine = result.get("machine", {})
    lines = [f"# nanoserve GPU check ({result.get('mode')})", ""]
    if machine:
        lines.append(
            f"{machine.get('device_name') or machine.get('device')}, torch {machine.get('torch')}"
            f", Python {machine.get('python')}; memory bandwidth {machine.get('bandwidth_gb_s')}"
            f" GB/s ({machine.get('bandwidth_measured')})"
        )
        lines.append("")
    lines += ["| check | measured | bar | met |", "| --- | --- | --- | --- |"]
    for bar in result.get("bars", []):
        met = {True: "yes", False: "**no**", None: "-"}[bar["met"]]
        lines.append(f"| {bar['check']} | {_text(bar['measured'])} | {bar['bar']} | {met} |")
    lines += ["", *speed_table(result), "", "| step | ok | seconds | note |"]
    lines.append("| --- | --- | ---: | --- |")
    for name, step in result.get("steps", {}).items():
        ok = {True: "yes", False: "**no**", None: "skipped"}[step.get("ok")]
        note = step.get("error") or step.get("note") or ""
        lines.append(f"| {name} | {ok} | {step.get('seconds', '')} | {note[:160]} |")
    return "\n".join(lines)


def speed_table(result: dict) -> list[str]:
    """nanoserve's levels over HTTP, then transformers' static-cache batches."""
    steps = result.get("steps", {})
    lines = [
        "| served (HTTP, bench serve) | output tok/s | median ITL ms | median TTFT ms "
        "| GPU util % | worker busy | sched. ms/step | frontend CPU us/tok | sched. CPU us/tok |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for level in steps.get("speed levels", {}).get("levels", []):
        keys = ("output_throughput", "median_itl_ms", "median_ttft_ms", "gpu_utilization_pct")
        keys += ("worker_busy_ratio", "scheduler_ms_per_step", "frontend_cpu_us_per_token")
        cells = [level.get(key) for key in (*keys, "scheduler_cpu_us_per_token")]
        row = " | ".join(_text(c) for c in cells)
        lines.append(f"| nanoserve, concurrency {level['concurrency']} | {row} |")
    for row in steps.get("transformers", {}).get("static", []):
        lines.append(
            f"| transformers static cache, batch {row['batch']} | {_text(row['output_tok_s'])} "
            f"| {_text(row['ms_per_step'])} (a step) | | | | | | |"
        )
    return lines


def _text(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
