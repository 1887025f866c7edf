"""The documentation site as a reader sees it, in headless Chromium: the built pages show their
executed outputs and reference entries, with no script error.

Reads the site ``make docs`` built (``make test`` builds it before the tests run). Marked
``browser``: skipped where Chromium or the built site is missing, unless
``HOOKSCOPE_BROWSER_TESTS=require`` (set by CI), where that fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docs_site import built_site
from tests.report.test_report_browser import browser  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def site() -> Path:
    return built_site()


@pytest.fixture
def opened(browser: Any, site: Path) -> Iterator[Any]:  # noqa: F811  (the imported fixture)
    """Open a page of the site by its path; the page's script errors are checked after the test."""
    errors: list[str] = []
    pages: list[Any] = []

    def open_page(path: str) -> Any:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda message: message.type == "error" and errors.append(message.text))
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto((site / path).as_uri())
        page.wait_for_load_state("load")
        pages.append(page)
        return page

    yield open_page
    for page in pages:
        page.close()
    assert errors == []


def test_the_index_leads_to_the_quick_starts_and_the_reference(opened: Any) -> None:
    page = opened("index.html")
    assert "hookscope" in page.title()
    links = page.locator(".sidebar-tree a").all_inner_texts()
    assert "Quick start: look inside a transformer" in links
    assert "Reference" in links


def test_a_quick_start_shows_what_its_cells_computed(opened: Any) -> None:
    page = opened("getting-started/quickstart-interpret.html")
    outputs = " ".join(page.locator(".cell_output").all_inner_texts())
    assert "torch.Size([1, 4, 12, 12])" in outputs  # the pattern's (batch, heads, queries, keys)
    assert "Logit lens: 2 layers" in outputs
    assert "transformer.h.1.attn:attn.z" in outputs  # the edit says where it applied


def test_the_reference_of_capture_and_of_the_errors(opened: Any) -> None:
    capture = opened("reference/capture.html")
    entry = capture.locator("[id='hookscope.capture']")
    assert entry.is_visible()
    assert "capture(" in entry.inner_text()
    options = capture.locator("[id='hookscope.CaptureOptions']").locator("xpath=..").inner_text()
    assert "max_bytes" in options
    assert "A budget in bytes" in options
    errors = opened("reference/errors.html")
    assert errors.locator("[id='hookscope.SpecError']").is_visible()
    assert errors.locator("[id='hookscope.HookscopeError']").is_visible()


def test_the_hooks_tutorial_shows_its_plots_and_cell_outputs(opened: Any) -> None:
    page = opened("tutorials/hooks-first-principles.html")
    images = page.locator(".cell_output img")
    assert images.count() >= 2  # the feature maps of conv1 and conv3
    first = images.first
    first.scroll_into_view_if_needed()
    assert first.is_visible()
    # Loaded, not a broken image: the browser decoded it and knows its size.
    assert first.evaluate("image => image.complete && image.naturalWidth") > 0
    outputs = " ".join(page.locator(".cell_output").all_inner_texts())
    assert "accuracy on 64 fresh images" in outputs
    assert "raw hook == true output: False | capture == true output: True" in outputs
