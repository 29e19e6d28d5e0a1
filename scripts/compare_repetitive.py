"""``compare.py --workload repetitive``: speculative decoding from the context, at concurrency 1.

Each of ``--runs`` starts benches, one server at a time, the same ``bench serve --dataset
repetitive`` load (a paragraph or a JSON object to return with one change, chat, greedy,
streaming): nanoserve at its default dtype without speculation and with ``--speculative
ngram``, then with ``--with-llamacpp`` llama-server without drafts and with each n-gram
``--spec-type`` of ``--llama-spec-types``. The verdicts are issue 47's bars, start by start:
nanoserve's median ITL with speculation at most 0.6x its own without, and at most the best of
llama-server's n-gram kinds; the acceptance length is nanoserve's (from its /metrics).
"""

from __future__ import annotations

from pathlib import Path

from compare_servers import bench_serve, markdown_row, markdown_table, start_nanoserve

LLAMA_SPEC_TYPES = "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache"

COLUMNS = (
    ("start", "run", "{}"),
    ("server", "server", "{}"),
    ("speculative", "speculative", "{}"),
    ("median ITL ms", "itl_median", "{:.1f}"),
    ("median TPOT ms", "tpot_median", "{:.1f}"),
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("acceptance length", "spec_acceptance_length", "{:.2f}"),
    ("drafts accepted", "accepted_share", "{:.0%}"),
    ("failed", "failed", "{}"),
)


def bench_repetitive(url: str, args, out: Path) -> dict:
    """One ``bench serve --dataset repetitive`` run at concurrency 1; its report, flattened."""
    flags = ["--endpoint-type", "chat", "--dataset", "repetitive", "--max-concurrency", "1"]
    flags += ["--num-prompts", str(args.min_prompts), "--num-warmups", "1"]
    flags += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    report = bench_serve(url, flags, out, args.timeout)
    if report is None:
        return {"failed": f"not done in {args.timeout:.0f} s"}
    for key in ("itl", "tpot"):
        report[f"{key}_median"] = report[f"{key}_ms"]["median"]
    drafted, accepted = report.get("spec_draft_tokens"), report.get("spec_accepted_tokens")
    report["accepted_share"] = accepted / drafted if drafted and accepted is not None else None
    return report


def repetitive_rows(args, work: Path, logs: Path, llama_server, settle=None) -> list[dict]:
    """Every start's rows; ``llama_server(args, logs, extra)`` starts llama-server with the
    extra flags, and ``settle(server)`` runs on each nanoserve before it is benched
    (compare.py awaits its compiled decode steps)."""
    rows = []
    for run in range(1, args.runs + 1):
        if not args.skip_nanoserve:
            for spec in ("off", "ngram"):
                env = {"NANOSERVE_SPECULATIVE": spec}
                log_dir = logs / f"nanoserve-{spec}-run{run}"
                server = start_nanoserve("auto", log_dir, args.threads, False, env)
                if settle is not None:
                    try:
                        settle(server)
                    except BaseException:
                        server.stop()
                        raise
                rows.append(_bench(server, args, work, run, "nanoserve", spec))
        if args.with_llamacpp:
            for spec in ("off", *args.llama_spec_types):
                extra = [] if spec == "off" else ["--spec-type", spec]
                server = llama_server(args, logs / f"llama-{spec}-run{run}", extra)
                rows.append(_bench(server, args, work, run, "llama.cpp", spec))
    return rows


def _bench(server, args, work: Path, run: int, name: str, spec: str) -> dict:
    out = work / f"repetitive-{name}-{spec}-run{run}.json".replace(".cpp", "cpp")
    try:
        report = bench_repetitive(server.url, args, out)
    finally:
        server.stop()
    row = {**report, "server": name, "speculative": spec, "run": run}
    print(markdown_row(row, COLUMNS), flush=True)
    return row


def verdicts(rows: list[dict]) -> list[str]:
    """Issue 47's bars for each start: speculation at most 0.6x nanoserve's own ITL without it,
    and at most the best llama-server n-gram kind's; with the acceptance length."""
    lines = []
    for run in sorted({row["run"] for row in rows}):
        mine = {r["speculative"]: r for r in rows if r["run"] == run and r["server"] == "nanoserve"}
        theirs = [
            r
            for r in rows
            if r["run"] == run and r["server"] == "llama.cpp" and r["speculative"] != "off"
        ]
        on, off = mine.get("ngram", {}), mine.get("off", {})
        if on.get("itl_median") is None or off.get("itl_median") is None:
            lines.append(f"start {run}: nanoserve did not run both ways")
            continue
        ratio = on["itl_median"] / off["itl_median"]
        parts = [
            f"start {run}: ITL {on['itl_median']:.1f} ms with speculation, {ratio:.2f}x without "
            f"({'met' if ratio <= 0.6 else 'missed'}: bar 0.6x)",
            f"acceptance length {on.get('spec_acceptance_length') or 0:.2f}",
        ]
        timed = [r for r in theirs if r.get("itl_median") is not None]
        if timed:
            best = min(timed, key=lambda r: r["itl_median"])
            met = "met" if on["itl_median"] <= best["itl_median"] else "missed"
            parts.append(
                f"llama.cpp's best {best['speculative']} {best['itl_median']:.1f} ms ({met})"
            )
        lines.append("; ".join(parts))
    return lines


def table(rows: list[dict]) -> str:
    """The rows as one Markdown table."""
    return markdown_table(rows, COLUMNS)
