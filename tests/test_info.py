"""``hs.info()`` and ``hookscope info``: what this installation runs on, read from the real state.

Every field is checked against a reference read without hookscope: the versions against the
packages themselves, the statistics path against the kernel's state, an extra reported present
by importing it, one reported missing by failing to find it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import platform
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch

import hookscope as hs
from hookscope._info import statistics_path
from hookscope._info.packages import INTEGRATIONS, OPTIONAL
from hookscope._shared import malloc
from hookscope._shared.stats import kernel


def info_lines(**env: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "hookscope", "info"],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_info_names_the_statistics_path_that_runs() -> None:
    lines = info_lines()
    assert lines[0].startswith("hookscope ")
    expected = "statistics: fused C kernel" if kernel.available() else "statistics: torch reductions"
    assert lines[-1].startswith(expected)
    assert lines[-1] == f"statistics: {statistics_path()}"
    # the CLI's text is str(hs.info()); the malloc line differs where a capture in this process
    # (another test's) changed the policy
    here = str(hs.info()).splitlines()
    assert [line for line in lines if "malloc:" not in line] == [line for line in here if "malloc:" not in line]


def test_info_says_when_the_kernel_is_turned_off() -> None:
    lines = info_lines(HOOKSCOPE_FUSED_STATS="0", HOOKSCOPE_MALLOC="default")
    assert lines[-1] == "statistics: torch reductions (fused C kernel turned off: HOOKSCOPE_FUSED_STATS=0)"
    assert "  malloc: left to the C library's defaults: HOOKSCOPE_MALLOC=default" in lines
    assert any(line.startswith("  statistics threads: torch reductions") for line in lines)


def test_statistics_path_follows_use_fused() -> None:
    previous = kernel.use_fused(False)
    try:
        assert statistics_path().startswith("torch reductions")
        found = hs.info()
        assert found.statistics.startswith("torch reductions")
        assert found.fused_kernel is False
        assert found.memory["statistics threads"].startswith("torch reductions")
    finally:
        kernel.use_fused(previous)
    assert statistics_path().startswith("fused C kernel" if previous else "torch reductions")
    assert hs.info().fused_kernel is kernel.enabled()


def test_versions_are_the_packages_own() -> None:
    found = hs.info()
    assert found.hookscope == hs.__version__
    assert found.torch == torch.__version__
    assert found.python == platform.python_version()
    assert str(found).splitlines()[:2] == [f"hookscope {hs.__version__}", f"python {found.python}, torch {found.torch}"]
    assert f"torch on {torch.get_num_threads()} threads" in found.devices
    assert ("CUDA: not available" in found.devices) is (not torch.cuda.is_available())


def test_each_package_reported_present_is_importable_and_each_missing_one_is_not_found() -> None:
    found = hs.info()
    assert list(found.integrations) == [package.module for package in INTEGRATIONS]
    assert list(found.extras) == [package.module for package in OPTIONAL]
    light = {"pandas", "jinja2", "safetensors", "fsspec", "google_crc32c", "zarr", "xarray", "matplotlib"}
    for name, version in {**found.integrations, **found.extras}.items():
        if version is None:
            assert importlib.util.find_spec(name) is None, name
            assert name in found.missing()
            assert f"  {name} (" in str(found)
        elif name in light:  # the heavy ones (lightning, wandb, mlflow ...): the slow test imports them
            module = importlib.import_module(name)
            assert getattr(module, "__version__", version) == version, name


@pytest.mark.slow
def test_every_package_reported_present_imports() -> None:
    """Each in a fresh interpreter, as a user's first import would be."""
    found = hs.info()
    for name, version in {**found.integrations, **found.extras}.items():
        if version is None:
            continue
        done = subprocess.run(
            [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, f"{name} {version} was reported present but does not import:\n{done.stderr}"


def test_a_package_imported_already_reports_its_own_version() -> None:
    import numpy  # a dependency, always present: stands in for an extra that a session imported

    from hookscope._info.packages import Package

    assert Package("numpy", "arrays", "pip install numpy").found() == numpy.__version__
    assert Package("no_such_package_anywhere", "nothing", "pip install nothing").found() is None


def test_the_memory_policy_is_the_one_in_force() -> None:
    found = hs.info()
    assert found.memory["malloc"] == malloc.describe()
    state = malloc.allocator_state()
    if state["trim_threshold"] == 0 and state["skipped"] is None and malloc.check_setting():
        assert found.memory["malloc"].startswith("steady")
    threads = found.memory["statistics threads"]
    if kernel.enabled():
        team = kernel.team_threads()
        assert (f"OpenMP team of {team} threads" in threads) is (team > 0)


def test_the_kernel_team_follows_torch_threads() -> None:
    if not kernel.enabled():
        pytest.skip("the fused kernel is not built here")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernel.team_threads() == 0
        assert "calling thread (torch runs on one thread)" in hs.info().memory["statistics threads"]
    finally:
        torch.set_num_threads(threads)
    assert kernel.team_threads() in (0, threads)


def test_info_is_frozen() -> None:
    found = hs.info()
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.torch = "0"  # type: ignore[misc]
    with pytest.raises(TypeError):
        found.extras["pandas"] = "0"  # type: ignore[index]


class _Cells(HTMLParser):
    """The text of every table cell and paragraph, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[str] = []
        self._open = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("td", "th", "p"):
            self._open = True
            self.cells.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th", "p"):
            self._open = False

    def handle_data(self, data: str) -> None:
        if self._open:
            self.cells[-1] += data


def test_the_html_holds_every_fact_escaped() -> None:
    found = hs.info()
    parser = _Cells()
    parser.feed(found._repr_html_())
    cells = parser.cells
    assert cells[0] == f"hookscope {hs.__version__}"
    assert cells[cells.index("torch") + 1] == torch.__version__
    assert cells[cells.index("statistics") + 1] == found.statistics
    assert cells[cells.index("malloc") + 1] == found.memory["malloc"].replace("  ", "\xa0\xa0")
    odd = dataclasses.replace(found, torch="<b>2&3</b>")
    html = odd._repr_html_()
    assert "<b>2&3</b>" not in html
    assert "&lt;b&gt;2&amp;3&lt;/b&gt;" in html
