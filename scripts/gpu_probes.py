"""What the GPU check asks a running server over HTTP, and how busy the GPU is meanwhile.

- ``chat_tokens``: greedy chat replies with each token's bytes (``logprobs``), for 8 prompts
  sent together or one by one; ``same_tokens`` holds them against another run's, or against
  transformers' ids.
- ``kill_mid_stream``: streams the prompts, SIGKILLs the worker once each has tokens, and
  returns every stream's text, for the undisturbed run's to be held against;
- ``scrape``: the server's /metrics, for what a kill cost (re-attaches, tokens recomputed).
- ``GpuUtilization``: samples the GPU's utilization (NVML through pynvml, else ``nvidia-smi``)
  every 100 ms while a load runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import aiohttp

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain how a bicycle stays upright.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "What does a compiler do?",
    "Describe the colour blue to someone who cannot see.",
    "Give me a recipe for a simple tomato soup.",
]
TIMEOUT = aiohttp.ClientTimeout(total=600)


def _body(model: str, prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One reply: its text and each token's bytes."""
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        reply = await response.json(content_type=None)
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {json.dumps(reply)[:300]}")
    choice = reply["choices"][0]
    entries = (choice.get("logprobs") or {}).get("content") or []
    return {"text": choice["message"]["content"] or "", "tokens": [e["bytes"] for e in entries]}


async def chat_tokens(
    url: str, model: str, max_tokens: int, together: bool, prompts: list[str] = PROMPTS
) -> list[dict]:
    """Each prompt's greedy reply (``text``, ``tokens``: each token's bytes), the prompts sent
    at once when ``together``, else one after another."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        bodies = [_body(model, p, max_tokens, logprobs=True) for p in prompts]
        if together:
            return list(await asyncio.gather(*(_one(session, url, b) for b in bodies)))
        return [await _one(session, url, body) for body in bodies]


def same_tokens(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> dict:
    """How many replies agree token for token, each over the shorter of the two (a reference
    that stopped at an end-of-sequence token is compared up to it), and where the first
    disagreement of each other reply is."""
    matched, first_difference = 0, {}
    for n, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        length = min(len(a), len(b))
        if length and a[:length] == b[:length]:
            matched += 1
        else:
            where = next((i for i in range(length) if a[i] != b[i]), length)
            first_difference[n] = where
    return {"matched": matched, "of": len(ours), "first_difference": first_difference}


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, into: dict) -> None:
    into.update(text="", chunks=0, errors=[], done=False)
    async with session.post(url + "/v1/chat/completions", json=body | {"stream": True}) as r:
        if r.status != 200:
            into["errors"].append(f"HTTP {r.status}")
            return
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                into["done"] = True
                return
            event = json.loads(line[6:])
            if "error" in event:
                into["errors"].append(event["error"].get("message", "error"))
                continue
            delta = (event.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                into["text"] += delta["content"]
                into["chunks"] += 1


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {name with its labels: value}."""
    import urllib.request

    from nanoserve.bench.metrics import samples

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        return samples(response.read().decode())


async def kill_mid_stream(
    url: str, model: str, max_tokens: int, worker_pid: Callable[[], int], after_chunks: int = 4
) -> dict:
    """Stream every prompt, SIGKILL the worker once each stream has ``after_chunks`` chunks,
    and wait for every stream to end (they resume on the restarted worker)."""
    streams = [{} for _ in PROMPTS]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        tasks = [
            asyncio.create_task(_stream(session, url, _body(model, p, max_tokens), s))
            for p, s in zip(PROMPTS, streams, strict=True)
        ]
        deadline = time.monotonic() + 300
        while not all(s.get("chunks", 0) >= after_chunks or s.get("done") for s in streams):
            if time.monotonic() > deadline or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.005)
        in_flight = sum(not s.get("done") for s in streams)
        pid = worker_pid()
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "streams": streams,
        "in_flight_at_kill": in_flight,
        "killed_pid": pid,
        "seconds_to_last_end": round(time.monotonic() - killed_at, 2),
    }


class GpuUtilization:
    """The GPU's utilization, sampled every ``period`` seconds between ``start`` and ``stop``
    (NVML's figure: the share of the last sample period a kernel was running)."""

    def __init__(self, period: float = 0.1) -> None:
        self.period = period
        self.samples: list[float] = []
        self.source: str | None = None
        self.result: dict = {"mean_pct": None, "samples": 0, "source": None}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._smi: subprocess.Popen | None = None

    def start(self) -> GpuUtilization:
        self.samples, self._stop = [], threading.Event()
        read = self._nvml()
        if read is not None:
            self.source = "nvml"
            self._thread = threading.Thread(target=self._poll, args=(read,), daemon=True)
        elif shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
            self._smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
                + [f"-lms={int(self.period * 1000)}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._thread = threading.Thread(target=self._read_smi, daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def stop(self) -> dict:
        """The mean and the number of samples (None without NVML or nvidia-smi)."""
        self.result = self._stop_sampling()
        return self.result

    def _stop_sampling(self) -> dict:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait(5)
            self._smi = None
        if self._thread is not None:
            self._thread.join(5)
        mean = sum(self.samples) / len(self.samples) if self.samples else None
        return {"mean_pct": mean, "samples": len(self.samples), "source": self.source}

    def _nvml(self) -> Callable[[], float] | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # noqa: BLE001 - no pynvml, no driver, no GPU: try nvidia-smi
            return None

    def _poll(self, read: Callable[[], float]) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(read())

    def _read_smi(self) -> None:
        for line in self._smi.stdout:  # type: ignore[union-attr]
            if self._stop.is_set():
                return
            if line.strip().isdigit():
                self.samples.append(float(line))
