"""Suite-wide guards (nothing is downloaded, no test leaves a hook behind) and the golden files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from hookscope._core.attach import live_groups
from tests.models import BUILT

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# Libraries that install hooks of their own and keep them (transformers 5 captures hidden states so).
_FOREIGN = ("transformers.",)


def raw_hook_count(model: nn.Module) -> int:
    """Hooks on ``model``'s modules and its parameters' post-accumulate-grad hooks, read from
    PyTorch's own dicts (tests only), foreign libraries' aside."""
    on_modules = [hook for module in model.modules() for attr in _HOOK_DICTS for hook in getattr(module, attr).values()]
    on_parameters = [hook for p in model.parameters() for hook in (p._post_accumulate_grad_hooks or {}).values()]
    return sum(1 for hook in on_modules + on_parameters if not getattr(hook, "__module__", "").startswith(_FOREIGN))


@pytest.fixture(autouse=True)
def no_hook_left_behind() -> Iterator[None]:
    """After every test: no live hookscope group anywhere, and no hook at all on any zoo model."""
    yield
    leaked = live_groups()
    for group in leaked:  # clean up first, so one leak does not fail every later test
        group.remove()
    dirty = {type(model).__name__: raw_hook_count(model) for model in list(BUILT) if raw_hook_count(model)}
    BUILT.clear()
    assert not leaked, f"hook groups left attached: {leaked}"
    assert not dirty, f"hooks left on zoo models: {dirty}"


#: Set to 1 to write the golden files from what the code prints now (then review the diff and commit).
UPDATE_GOLDEN = "HOOKSCOPE_UPDATE_GOLDEN"


@dataclass
class Golden:
    """The golden files in ``folder`` (``tests/golden``), compared with what the code prints now."""

    folder: Path

    def check(self, name: str, text: str) -> None:
        """Compare with ``folder/name``; ``HOOKSCOPE_UPDATE_GOLDEN=1`` writes the file instead.

        A missing file fails the test: written silently, it would pass whatever the code printed.
        """
        path = self.folder / name
        hint = f"{UPDATE_GOLDEN}=1 pytest {os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}"
        if os.environ.get(UPDATE_GOLDEN) == "1":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
        if not path.is_file():
            pytest.fail(f"golden file {path} is missing; write it with `{hint}`, review it and commit it")
        assert text + "\n" == path.read_text(), f"{path} differs; if the change is intended: `{hint}`"


@pytest.fixture
def golden() -> Golden:
    """The suite's golden files: ``golden.check("layers_small_cnn.txt", str(table))``."""
    return Golden(Path(__file__).parent / "golden")
