"""Optional packages are refused the same way everywhere: what needed them and the one install line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hookscope as hs
from hookscope._shared.optional import require


def test_a_present_module_is_returned() -> None:
    import json

    assert require("json", purpose="this test") is json


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"purpose": "hs.plots", "extra": "plots"}, "hs.plots needs missing_pkg_xyz: pip install 'hookscope[plots]'"),
        ({"purpose": "to_pandas()"}, "to_pandas() needs missing_pkg_xyz: pip install missing_pkg_xyz"),
        (
            {"purpose": "saving .safetensors files", "hint": " (or save to .npz or .pt)"},
            "saving .safetensors files needs missing_pkg_xyz: pip install missing_pkg_xyz (or save to .npz or .pt)",
        ),
    ],
)
def test_a_missing_module_names_the_install_line(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(hs.MissingDependencyError) as caught:
        require("missing_pkg_xyz.sub", **kwargs)  # type: ignore[arg-type]
    assert caught.value.args[0] == message
    assert isinstance(caught.value, ImportError)


def test_too_old_a_version_is_refused_with_the_upgrade_line() -> None:
    with pytest.raises(hs.MissingDependencyError, match=r"needs numpy>=999, found .*: pip install -U 'numpy>=999'"):
        require("numpy", purpose="this test", minimum=(999,))
    assert require("numpy", purpose="this test", minimum=(1,)).__name__ == "numpy"


@pytest.mark.slow
def test_plots_without_matplotlib_say_which_extra_to_install() -> None:
    """A real interpreter in which matplotlib cannot be imported (a None entry in sys.modules)."""
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = None\n"
        "import hookscope as hs, torch\n"
        "try:\n"
        "    hs.plots.layer_stats(hs.trace(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.ones(1, 2)))\n"
        "except hs.MissingDependencyError as error:\n"
        "    print(error.args[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "hs.plots needs matplotlib: pip install 'hookscope[plots]'"
