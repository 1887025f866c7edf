"""The report in a real headless Chromium (Debian's, driven by Playwright; no browser download).

Marked ``browser``. Where Chromium or Playwright is missing the tests are skipped, unless
``HOOKSCOPE_BROWSER_TESTS=require`` (set by CI), where they fail: CI must run them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

import hookscope as hs
from tests.models import SmallCNN, tiny_resnet, track
from tests.report.test_report import EVIL, evil_model

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
# As root in a closed network: no sandbox, and no background requests that would be refused.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("HOOKSCOPE_BROWSER_TESTS") == "require":
        pytest.fail(f"browser tests are required here but {reason}; run `bash .ci/install-browser`")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        _unavailable(f"{CHROMIUM} is not installed (Debian package chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield launched
        launched.close()


class Page:
    """One report opened in a fresh page, with every console error and dialog it caused."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("dialog", self._dialog)
        self.page.goto(path.as_uri())
        self.page.wait_for_load_state("load")

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def column(self, index: int) -> list[str]:
        """The text of one column over the table's visible rows, in page order."""
        script = """i => Array.from(document.querySelectorAll('#hs-trace tbody tr.row'))
            .filter(r => !r.classList.contains('hidden')).map(r => r.cells[i].textContent.trim())"""
        return list(self.page.evaluate(script, index))

    def images(self) -> list[tuple[bool, int, int]]:
        script = "() => Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])"
        return [tuple(image) for image in self.page.evaluate(script)]  # type: ignore[misc]

    def close(self, screenshot: Path) -> None:
        self.page.screenshot(path=str(screenshot), full_page=True)
        assert screenshot.stat().st_size > 10_000
        self.page.close()


@pytest.fixture
def opened(browser: Any, tmp_path: Path) -> Iterator[Page]:
    model = SmallCNN()
    labels = torch.tensor([0, 3, 5, 9])
    path = hs.report(
        model, torch.randn(4, 3, 32, 32), out=tmp_path / "report.html", loss_fn=lambda y: cross_entropy(y, labels)
    )
    page = Page(browser, path)
    yield page
    page.close(tmp_path / "report.png")
    assert page.errors == [], "the page logged errors"


def test_loads_without_errors_and_every_image_decodes(opened: Page) -> None:
    images = opened.images()
    assert len(images) == 5
    assert all(complete and width > 0 and height > 0 for complete, width, height in images)
    assert opened.page.title() == "hookscope report: SmallCNN"


def test_sorting_a_column_reorders_the_rows(opened: Page) -> None:
    names = ["(root)", "conv1", "relu", "pool", "fc"]
    assert [name.strip() for name in opened.column(1)] == names
    header = opened.page.locator("#hs-trace th[data-key='max']")
    header.click()
    maxima = [float(value) for value in opened.column(7)]
    assert maxima == sorted(maxima)
    assert opened.column(1) != names
    assert header.get_attribute("aria-sort") == "ascending"
    header.click()
    assert [float(value) for value in opened.column(7)] == sorted(maxima, reverse=True)
    opened.page.locator("#hs-trace th[data-key='order']").click()
    assert [name.strip() for name in opened.column(1)] == names
    opened.page.locator("#hs-trace th[data-key='name']").click()
    assert [name.strip() for name in opened.column(1)] == sorted(names)  # text, case-blind


def test_the_filter_box_hides_rows(opened: Page) -> None:
    opened.page.fill("#hs-filter", "conv")
    assert [name.strip() for name in opened.column(1)] == ["conv1"]
    assert opened.page.inner_text("#hs-count") == "1 of 5 calls"
    assert opened.page.locator("#hs-trace tr.row.hidden").count() == 4
    assert not opened.page.locator("#hs-trace tr.row", has_text="relu").is_visible()  # hidden, not just marked
    assert opened.page.locator("#hs-trace tr.row", has_text="conv1").is_visible()
    opened.page.fill("#hs-filter", "linear")  # classes match too
    assert [name.strip() for name in opened.column(1)] == ["fc"]
    opened.page.fill("#hs-filter", "")
    assert len(opened.column(1)) == 5


def test_a_row_opens_onto_its_statistics(opened: Page) -> None:
    row = opened.page.locator("#hs-trace tr.row", has_text="conv1")
    row.click()
    detail = opened.page.locator("#hs-trace tr.detail")
    assert detail.count() == 1
    text = detail.inner_text()
    assert "conv1#0 · Conv2d · 448 own parameters" in text
    assert "inputs" in text
    assert "outputs" in text
    assert "[4, 16, 30, 30]" in text
    assert "32,768 of 57,600 values counted" in text
    assert detail.locator("svg rect").count() == 64  # the output's histogram
    row.click()
    assert opened.page.locator("#hs-trace tr.detail").count() == 0
    row.press("Enter")
    assert opened.page.locator("#hs-trace tr.detail").count() == 1
    opened.page.click("#hs-collapse")
    assert opened.page.locator("#hs-trace tr.detail").count() == 0


def test_markup_in_names_is_shown_as_text(browser: Any, tmp_path: Path) -> None:
    path = hs.report(evil_model(), torch.randn(1, 3, 8, 8), out=tmp_path / "evil.html", title=EVIL)
    page = Page(browser, path)
    assert page.dialogs == []
    assert page.page.inner_text("h1") == EVIL
    assert EVIL in [name.strip() for name in page.column(1)]
    page.page.locator("#hs-trace tr.row", has_text=EVIL).click()
    assert EVIL in page.page.inner_text("#hs-trace tr.detail")
    assert page.page.evaluate("() => document.scripts.length") == 2
    assert page.dialogs == []
    assert page.errors == []
    # the NaN row is highlighted, and the box shows it alone
    bad = page.page.locator("#hs-trace tr.row.bad")
    colour = bad.first.evaluate("r => getComputedStyle(r).backgroundColor")
    plain = page.page.locator("#hs-trace tr.row:not(.bad)").first.evaluate("r => getComputedStyle(r).backgroundColor")
    assert colour != plain
    page.page.check("#hs-bad-only")
    assert [name.strip() for name in page.column(1)] == ["(root)", "head"]
    page.close(tmp_path / "evil.png")


def test_a_model_of_a_thousand_modules_stays_usable(browser: Any, tmp_path: Path) -> None:
    blocks = [nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU()) for _ in range(300)]
    model = track(nn.Sequential(*blocks).eval())
    path = hs.report(model, torch.randn(1, 2, 8, 8), out=tmp_path / "big.html")
    page = Page(browser, path)
    timing = page.page.evaluate("() => performance.getEntriesByType('navigation')[0].toJSON()")
    assert timing["loadEventEnd"] < 2000, f"the page took {timing['loadEventEnd']:.0f} ms to load"
    images = page.images()
    assert len(images) == 2 + 6  # depth, histograms, six feature-map grids: a subset, not one per module
    assert all(width > 0 for _, width, _ in images)
    page.page.fill("#hs-filter", "299.")
    assert page.page.inner_text("#hs-count") == "3 of 1201 calls"
    page.page.fill("#hs-filter", "")
    page.page.locator("#hs-trace th[data-key='std']").click()
    stds = [float(value) for value in page.column(9)]
    assert stds == sorted(stds)
    assert len(stds) == 1201
    assert page.errors == []
    page.close(tmp_path / "big.png")


@pytest.mark.transformers
def test_a_transformers_resnet(browser: Any, tmp_path: Path) -> None:
    path = hs.report(
        tiny_resnet(), torch.randn(2, 3, 32, 32), out=tmp_path / "resnet.html", loss_fn=lambda o: o.pooler_output.sum()
    )
    page = Page(browser, path)
    images = page.images()
    assert len(images) >= 4
    assert all(width > 0 for _, width, _ in images)
    assert "ResNetModel" in page.page.inner_text("header")
    assert page.errors == []
    page.close(tmp_path / "resnet.png")
