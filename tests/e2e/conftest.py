"""One real server (scheduler, worker, frontend processes, default model, audit on) per module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import Server, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The default model behind the real three processes, audited between every iteration."""
    running = start_server(tmp_path_factory.mktemp("server"), audit=1, num_slots=96)
    try:
        yield running
    finally:
        running.stop()


def generate_offline(tmp_path: Path, lines: list[dict], *flags: str) -> list[dict]:
    """Run ``nanoserve generate`` on JSONL prompts and return its JSON lines, in order."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "nanoserve.cli", "generate", "--prompts-file", str(prompts)]
    done = subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"generate failed ({done.returncode}): {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


__all__ = ["Server", "generate_offline"]
