"""The project's GPU check in one call: ``scripts/gpu_check.sh`` installs the carried wheels
and runs this. It needs no network and no weights: the checkpoints are made here.

1. the machine: torch, the GPU, its copy bandwidth (``bench forward --profile``'s floor);
2. random-weight checkpoints (``gpu_checkpoints.py``): SmolLM2-135M's shape in float32 for
   exactness, Llama-3.2-1B's in bfloat16 for speed, both with SmolLM2's tokenizer;
3. the CUDA tests: ``pytest -m gpu`` over the test files that carry the mark;
4. transformers (``gpu_reference.py``): greedy ids on the float32 checkpoint, and static-cache
   steps at batch 1 and 64 on the speed one;
5. nanoserve on the float32 checkpoint over HTTP: greedy tokens of 8 chat prompts, together
   and one by one, against transformers'; then a worker SIGKILLed mid-stream, every stream
   held against the undisturbed text; then the same with ``--shared-kv-pool`` (the pool
   holder's device memory, through a CUDA IPC handle): the restarted worker re-attaches to it,
   and only the tokens of the steps in flight are computed again;
6. nanoserve on the speed checkpoint: ``bench serve`` at concurrency 1, 32 and 256 (64-token
   prompts, 128 output tokens, ignore_eos) with the GPU's utilization; the 8 prompts' tokens
   with CUDA graphs, then with ``--enforce-eager`` where the worker has that option.

It writes ``gpu_check.json``, ``gpu_check.md`` (the table it prints) and ``logs.tar.gz`` into
``--out``, and exits 1 when a correctness check fails; the speed bars are reported, not
enforced. ``--cpu-smoke`` runs every step on this CPU with tiny shapes (CI tests the plumbing
that way); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))

import gpu_probes  # noqa: E402 - after the path setup above
from compare_servers import Server, free_port  # noqa: E402
from gpu_report import evaluate, failed_checks, format_report  # noqa: E402

PYTHON = sys.executable
NAME = "check"  # the served model name
EAGER = "graphs vs eager tokens"
SHARED = "worker SIGKILL on the shared pool"


@dataclass(frozen=True)
class Sizes:
    """What one mode runs: shapes, dtypes, lengths, loads."""

    device: str
    exact_shape: str
    speed_shape: str
    speed_dtype: str
    exact_tokens: int  # greedy tokens held against transformers'
    kill_tokens: int  # tokens of each stream the worker is killed under
    graph_tokens: int  # tokens of each prompt held between graphs and eager
    input_len: int
    output_len: int
    levels: tuple[tuple[int, int], ...]  # (concurrency, requests)
    static_batches: tuple[int, ...]
    kv_memory: str
    start_timeout: float
    api_servers: int = 2  # frontends of the speed server (the levels' CPU per token sums them)


GPU = Sizes(
    device="cuda",
    exact_shape="smollm2-135m",
    speed_shape="llama-3.2-1b",
    speed_dtype="bfloat16",
    exact_tokens=48,
    kill_tokens=256,
    graph_tokens=32,
    input_len=64,
    output_len=128,
    levels=((1, 8), (32, 64), (256, 512)),
    static_batches=(1, 64),
    kv_memory="8GiB",
    start_timeout=300.0,
)
SMOKE = Sizes(
    device="cpu",
    exact_shape="tiny",
    speed_shape="tiny",
    # float32: a random tiny model's logits are near ties, and in bfloat16 two servers that
    # batch the same prompts into different steps (their arrival differs) can flip one
    speed_dtype="float32",
    exact_tokens=6,
    kill_tokens=96,
    graph_tokens=8,
    input_len=16,
    output_len=4,
    levels=((1, 2), (32, 32), (256, 256)),
    static_batches=(1, 2),
    kv_memory="256MiB",
    start_timeout=120.0,
)


def run_json(command: list[str], log: Path, timeout: float) -> dict:
    """Run a helper that prints one JSON line; its stderr goes to ``log``."""
    with open(log, "ab") as err:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[1]).name} exited {done.returncode}: see {log.name}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


class Check:
    """One run of the check: its steps, in order, each recorded as it ends."""

    def __init__(self, sizes: Sizes, out: Path, work: Path, tokenizer: Path | None) -> None:
        self.sizes, self.out, self.work = sizes, out, work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.tokenizer_dir = tokenizer
        self.result: dict = {"mode": "gpu" if sizes.device == "cuda" else "cpu-smoke"}
        self.result["sizes"] = asdict(sizes)
        self.steps: dict[str, dict] = {}
        self.result["steps"] = self.steps

    def step(self, name: str, action) -> dict | None:
        """Run one step; record what it returned, or why it failed, and how long it took."""
        began = time.monotonic()
        print(f"gpu check: {name} ...", file=sys.stderr, flush=True)
        try:
            found = action() or {}
            record = {"ok": found.pop("ok", True), **found}
        except Exception as exc:  # noqa: BLE001 - one failed step is reported, not fatal
            record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        record["seconds"] = round(time.monotonic() - began, 1)
        self.steps[name] = record
        print(f"gpu check: {name}: {'ok' if record['ok'] else record}", file=sys.stderr)
        return record if record["ok"] is not False else None

    # -- the steps -------------------------------------------------------------------------

    def checkpoints(self) -> dict:
        if self.tokenizer_dir is None:  # exported from the default model by ``make``
            self.tokenizer_dir = self.work / "tokenizer"
        s = self.sizes
        command = [PYTHON, str(HERE / "gpu_checkpoints.py"), "make", str(self.work / "models")]
        command += ["--tokenizer-dir", str(self.tokenizer_dir), "--device", s.device]
        command += ["--exact", s.exact_shape, "--speed", s.speed_shape]
        command += ["--speed-dtype", s.speed_dtype]
        return run_json(command, self.logs / "checkpoints.log", 600)

    def cuda_tests(self) -> dict:
        files = sorted(
            str(path.relative_to(REPO))
            for path in (REPO / "tests").rglob("test_*.py")
            if "mark.gpu" in path.read_text()
        )
        report = self.work / "pytest.xml"
        command = [PYTHON, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
        command += [f"--junitxml={report}", *files]
        with open(self.logs / "pytest.log", "wb") as log:
            done = subprocess.run(
                command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=600
            )
        counts = _junit_counts(report)
        ok = done.returncode == 0 and counts.get("failures", 0) == 0
        return {"ok": ok, "files": files, "exit": done.returncode, **counts}

    def reference(self) -> dict:
        from models.files import resolve_model
        from models.tokenizer import load_tokenizer

        exact = self.work / "models" / "exact"
        tokenizer = load_tokenizer(resolve_model(str(exact)))
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}])
            for p in gpu_probes.PROMPTS
        ]
        (self.work / "prompts.json").write_text(json.dumps(prompts))
        s = self.sizes
        command = [PYTHON, str(HERE / "gpu_reference.py"), "--device", s.device]
        command += ["--exact", str(exact), "--prompts", str(self.work / "prompts.json")]
        command += [
            "--max-new",
            str(s.exact_tokens),
            "--speed",
            str(self.work / "models" / "speed"),
        ]
        command += ["--speed-dtype", s.speed_dtype, "--input-len", str(s.input_len)]
        command += ["--output-len", str(s.output_len), "--batches", *map(str, s.static_batches)]
        found = run_json(command, self.logs / "reference.log", 900)
        self.result["machine"] = found.pop("machine")
        ids = found["greedy"]["outputs"]
        found["greedy"]["tokens"] = [[tokenizer.token_bytes(t) for t in row] for row in ids]
        # A model that repeats one token would make the exactness check pass on nothing.
        found["greedy"]["distinct_tokens"] = len({t for row in ids for t in row})
        found["ok"] = found["greedy"]["distinct_tokens"] > len(ids)
        return found

    def serve(self, name: str, model: Path, dtype: str, **extra: str) -> Server:
        """Scheduler, worker (supervised, its pid in a file) and frontend on a free port."""
        s = self.sizes
        server = Server(name, free_port(), self.logs / name)
        env = dict(os.environ, PYTHONUNBUFFERED="1", NANOSERVE_RUN_ID=f"gpu{uuid.uuid4().hex[:8]}")
        env |= {"NANOSERVE_PORT": str(server.port), "NANOSERVE_MODEL": str(model)}
        env |= {"NANOSERVE_DTYPE": dtype, "NANOSERVE_DEVICE": s.device}
        env |= {"NANOSERVE_SERVED_MODEL_NAME": NAME, "NANOSERVE_NUM_SLOTS": "256"}
        env |= {"NANOSERVE_KV_CACHE_MEMORY": s.kv_memory, "NANOSERVE_MAX_MODEL_LEN": "1024"}
        env["NANOSERVE_WORKER_TIMEOUT"] = "600"  # a killed worker restarts, graphs and all
        if s.device == "cpu":
            env["NANOSERVE_COMPILE"] = "0"  # minutes of compiling on CPU for nothing here
        env |= {f"NANOSERVE_{key.upper()}": value for key, value in extra.items()}
        cli = [PYTHON, "-m", "nanoserve.cli"]
        pid_file = self.logs / name / "worker.pid"
        supervise = ["supervise", "--initial-backoff", "0.2", "--pid-file", str(pid_file), "--"]
        if extra.get("shared_kv_pool"):  # the pool holder first: the worker asks it for the pool
            server.spawn("kv-holder", [*cli, "kv-holder"], env)
        server.spawn("scheduler", [*cli, "scheduler"], env)
        server.spawn("worker", [*cli, *supervise, *cli, "worker"], env)
        server.spawn("frontend", [*cli, "frontend"], env)
        server.pid_file = pid_file  # type: ignore[attr-defined]
        began = time.monotonic()
        try:
            server.wait_ready("/health", s.start_timeout)
        except BaseException:
            server.stop()
            raise
        server.start_seconds = round(time.monotonic() - began, 1)  # type: ignore[attr-defined]
        return server

    def exactness(self, server: Server) -> dict:
        reference = self.steps["transformers"]["greedy"]["tokens"]
        found: dict = {"start_seconds": server.start_seconds}  # type: ignore[attr-defined]
        for how, together in (("together", True), ("one_by_one", False)):
            replies = asyncio.run(
                gpu_probes.chat_tokens(server.url, NAME, self.sizes.exact_tokens, together)
            )
            found[how] = gpu_probes.same_tokens([r["tokens"] for r in replies], reference)
        found["ok"] = all(found[h]["matched"] == found[h]["of"] for h in ("together", "one_by_one"))
        return found

    def worker_kill(self, server: Server) -> dict:
        tokens = self.sizes.kill_tokens
        calm = asyncio.run(gpu_probes.chat_tokens(server.url, NAME, tokens, together=True))
        pid_file = server.pid_file  # type: ignore[attr-defined]
        killed = asyncio.run(
            gpu_probes.kill_mid_stream(server.url, NAME, tokens, lambda: int(pid_file.read_text()))
        )
        streams = killed.pop("streams")
        whole = [s.get("done") and not s.get("errors") for s in streams]
        same = [s.get("text") == c["text"] for s, c in zip(streams, calm, strict=True)]
        return {
            "ok": all(whole) and all(same) and killed["in_flight_at_kill"] > 0,
            "streams_whole": sum(whole),
            "streams_undisturbed": sum(same),
            "of": len(streams),
            **killed,
        }

    def shared_kill(self, server: Server) -> dict:
        """``worker_kill`` on the holder's pool: every stream undisturbed, the restarted worker
        re-attached (no fallback), and at most the two steps in flight computed again (one
        token a stream each, once every stream decodes)."""
        found = self.worker_kill(server)
        metrics = gpu_probes.scrape(server.url)
        found["reattaches"] = metrics.get("nanoserve:kv_pool_reattaches_total", 0)
        found["fallbacks"] = {
            name: value for name, value in metrics.items() if "kv_pool_fallbacks_total" in name
        }
        found["recomputed"] = metrics.get("nanoserve:worker_restart_tokens_recomputed_last")
        bound = 2 * found["in_flight_at_kill"]
        recomputed = found["recomputed"]
        found["ok"] = (
            found["ok"]
            and found["reattaches"] >= 1
            and recomputed is not None
            and recomputed <= bound
        )
        found["recompute_bound"] = bound
        return found

    def speed(self, server: Server) -> dict:
        from nanoserve.bench.serve import BenchServe, BenchServeConfig

        s = self.sizes
        found: dict = {"start_seconds": server.start_seconds, "levels": []}  # type: ignore[attr-defined]
        found["capture_log"] = _capture_lines(self.logs / server.name / "worker.log")
        for concurrency, requests in s.levels:
            config = BenchServeConfig(
                base_url=server.url,
                model=NAME,
                num_prompts=requests,
                input_len=s.input_len,
                output_len=s.output_len,
                vocab_size=49152,
                max_concurrency=concurrency,
                num_warmups=min(concurrency, 8),
                seed=concurrency,
            )
            gpu = gpu_probes.GpuUtilization()  # sampled through the timed load only
            report = asyncio.run(BenchServe(config, watch=gpu).run())
            found["levels"].append(_level(concurrency, report, gpu.result))
        found["ok"] = all(level["failed"] == 0 for level in found["levels"])
        return found

    def graph_tokens(self, server: Server) -> dict:
        replies = asyncio.run(
            gpu_probes.chat_tokens(server.url, NAME, self.sizes.graph_tokens, together=True)
        )
        return {"tokens": [r["tokens"] for r in replies]}

    def eager_tokens(self, server: Server) -> dict:
        found = self.graph_tokens(server)
        graphs = self.steps.get("graphs tokens", {}).get("tokens")  # the speed server's
        if graphs is None:
            return {"ok": False, "error": "no tokens from the server with graphs"}
        found["same"] = gpu_probes.same_tokens(graphs, found.pop("tokens"))
        found["ok"] = found["same"]["matched"] == found["same"]["of"]
        return found

    # -- the run ---------------------------------------------------------------------------

    def run(self, skip_tests: bool) -> int:
        if self.step("checkpoints", self.checkpoints) is None:
            return self.finish()
        if not skip_tests:
            self.step("cuda tests", self.cuda_tests)
        self.step("transformers", self.reference)
        exact, speed = self.work / "models" / "exact", self.work / "models" / "speed"
        dtype, frontends = self.sizes.speed_dtype, {"api_servers": str(self.sizes.api_servers)}
        exact_probes = [
            ("float32 greedy vs transformers", self.exactness),
            ("worker SIGKILL mid-stream", self.worker_kill),
        ]
        self.with_server("exact", exact, "float32", {}, exact_probes)
        shared = [(SHARED, self.shared_kill)]
        self.with_server("shared", exact, "float32", {"shared_kv_pool": "1"}, shared)
        speed_probes = [("speed levels", self.speed), ("graphs tokens", self.graph_tokens)]
        self.with_server("speed", speed, dtype, frontends, speed_probes)
        if not _has_enforce_eager():
            note = "skipped: the worker has no --enforce-eager option yet"
            self.steps[EAGER] = {"ok": None, "note": note}
            return self.finish()
        self.with_server(
            "eager", speed, dtype, {"enforce_eager": "1"}, [(EAGER, self.eager_tokens)]
        )
        return self.finish()

    def with_server(self, name: str, model: Path, dtype: str, extra: dict, probes: list) -> None:
        """Start a server, run ``probes`` against it (each a step), stop it."""
        holder: dict = {}

        def start() -> dict:
            holder["server"] = self.serve(name, model, dtype, **extra)
            return {"start_seconds": holder["server"].start_seconds}

        if self.step(f"start {name} server", start) is None:
            return
        server = holder["server"]
        try:
            for step_name, probe in probes:
                self.step(step_name, lambda probe=probe: probe(server))
        finally:
            server.stop(timeout=30)

    def finish(self) -> int:
        self.result["bars"] = evaluate(self.result)
        self.result["failed"] = failed_checks(self.result)
        text = format_report(self.result)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=1))
        (self.out / "gpu_check.md").write_text(text + "\n")
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as archive:
            archive.add(self.logs, arcname="logs")
        print(text)
        return 1 if self.result["failed"] else 0


def _level(concurrency: int, report: dict, utilization: dict) -> dict:
    """One speed level's line: the bench's figures that the table shows."""
    keys = ("completed", "failed", "output_throughput", "worker_busy_ratio")
    keys += ("scheduler_ms_per_step", "frontend_cpu_us_per_token", "scheduler_cpu_us_per_token")
    level = {"concurrency": concurrency, **{k: report.get(k) for k in keys}}
    level["median_itl_ms"] = report["itl_ms"]["median"]
    level["median_ttft_ms"] = report["ttft_ms"]["median"]
    level["frontends"] = report.get("per_frontend")
    level["gpu_utilization_pct"] = utilization["mean_pct"]
    level["gpu_samples"] = utilization["samples"]
    return level


def _capture_lines(log: Path) -> list[str]:
    """The worker's log lines about capturing CUDA graphs (what it says, as it says it)."""
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return [line for line in lines if "captur" in line.lower()][:8]


def _junit_counts(report: Path) -> dict:
    """tests, failures, errors and skipped from pytest's JUnit XML."""
    if not report.exists():
        return {}
    import xml.etree.ElementTree as ElementTree

    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    names = ("tests", "failures", "errors", "skipped")
    return {n: int(suite.get(n, 0)) for n in names} if suite is not None else {}


def _has_enforce_eager() -> bool:
    from nanoserve.options import all_options

    return any(o.dest == "enforce_eager" for o in all_options())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="results folder")
    parser.add_argument("--work", type=Path, help="checkpoints and logs (default: a temp dir)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on this CPU")
    parser.add_argument("--skip-tests", action="store_true", help="no pytest -m gpu")
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=REPO / ".gpu-wheels" / "smollm2-tokenizer",
        help="SmolLM2's tokenizer files (scripts/gpu_wheels.sh); exported from the default "
        "model when missing",
    )
    args = parser.parse_args()
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-check-{uuid.uuid4().hex[:8]}"
    tokenizer = args.tokenizer_dir if (args.tokenizer_dir / "tokenizer.json").exists() else None
    check = Check(SMOKE if args.cpu_smoke else GPU, args.out, work, tokenizer)
    try:
        return check.run(args.skip_tests)
    finally:
        if args.work is None:  # gigabytes of checkpoints: a --work folder keeps them
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
