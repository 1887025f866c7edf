"""The documentation site ``make docs`` built, for the tests that read it (``make test`` builds it
first): skipped where it is missing, unless ``HOOKSCOPE_BROWSER_TESTS=require`` (set by CI), where
that fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parents[1] / "docs" / "_build" / "html"


def built_site(needs: str = "index.html") -> Path:
    """The site's folder, once ``needs`` (a path in it) is there; else skip, or fail where required."""
    if not (SITE / needs).exists():
        if os.environ.get("HOOKSCOPE_BROWSER_TESTS") == "require":
            pytest.fail(f"the documentation site is not built at {SITE}; run `make docs` first")
        pytest.skip(f"the documentation site is not built at {SITE}; `make docs` builds it")
    return SITE
