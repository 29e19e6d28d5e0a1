"""One real server (scheduler, worker, frontend processes, default model, audit on) per module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.servers import Server, server_fixture

# The default model behind the real three processes, audited between every iteration.
server = server_fixture(audit=1, num_slots=96)


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
