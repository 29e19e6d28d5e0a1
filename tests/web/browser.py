"""Debian's Chromium driven by playwright, for the web page's tests.

Without Chromium or playwright a browser test skips, unless NANOSERVE_REQUIRE_BROWSER=1 (CI, set
by .ci/run) makes that a failure. ``NANOSERVE_SCREENSHOT_DIR`` keeps a copy of every screenshot
there too (the README's pictures come from it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def chromium_path() -> str:
    """Chromium's path and a working playwright, or skip (fail when they are required)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        path = None
    if path is None:
        why = "no Chromium (apt-get install chromium) or no playwright (pip install '.[test]')"
        if os.environ.get("NANOSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"NANOSERVE_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    return path


async def screenshot(page, directory: Path, name: str) -> Path:
    """Save the whole page as ``directory/name`` (and into NANOSERVE_SCREENSHOT_DIR if set)."""
    path = directory / name
    await page.screenshot(path=path, full_page=True)
    keep = os.environ.get("NANOSERVE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(keep) / name)
    return path
