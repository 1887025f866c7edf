"""The README is the front page: short, its examples run as written, its links lead somewhere.

Its Python blocks run in order in one namespace, as a reader pasting them into one session
would; every relative link names a file of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def test_the_readme_is_a_front_page() -> None:
    assert len(README.read_text().splitlines()) < 200


def test_every_relative_link_names_a_file() -> None:
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert targets, "the README links into the site"
    missing = sorted({target for target in targets if not (ROOT / target).exists()})
    assert missing == []


@pytest.mark.slow
@pytest.mark.transformers
def test_the_examples_run_in_order_and_say_what_they_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) == 3  # debug, interpret, extract
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # the README's own examples
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("<NonFiniteRow '2' (Linear")  # the broken Linear made the first NaN/Inf
    assert namespace["pattern"].shape == (1, 4, 12, 12)  # type: ignore[attr-defined]
    assert float(printed[1]) > 0  # the ablation moved the logits
    assert printed[-1] == "(8, 8) 64"  # eight rows of Linear 0's 8 outputs; 64 rows stored
