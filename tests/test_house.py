"""The house's one size rule: every module of the process packages (frontend, scheduler, worker,
protocol, holder) is at most 300 lines, short enough to read at a sitting. A module that grows
past it splits along a seam (``worker.kv.written`` came out of ``worker.kv.shared`` so)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("frontend", "scheduler", "worker", "protocol", "holder")
MAX_MODULE_LINES = 300


def long_modules(root: Path, packages: tuple[str, ...], limit: int) -> list[str]:
    """``path: N lines`` for each Python module under ``packages`` of ``root`` over ``limit``."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_module_of_a_process_package_is_over_300_lines() -> None:
    assert long_modules(ROOT, PACKAGES, MAX_MODULE_LINES) == []


def test_a_long_module_is_named(tmp_path: Path) -> None:
    (tmp_path / "worker" / "kv").mkdir(parents=True)
    (tmp_path / "worker" / "kv" / "big.py").write_text("x = 1\n" * 301)
    (tmp_path / "worker" / "short.py").write_text("x = 1\n" * 300)
    assert long_modules(tmp_path, ("worker",), 300) == ["worker/kv/big.py: 301 lines"]
