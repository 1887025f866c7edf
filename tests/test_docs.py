"""The documentation site's sources: every public name has a reference entry, and every Python
example either runs when the site is built (a MyST-NB code cell) or says why it cannot.

``make docs`` builds the site with warnings as errors and runs every code cell; these checks are
the ones a build cannot make: what is missing from the pages, and examples left out of the run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hookscope as hs

DOCS = Path(__file__).resolve().parents[1] / "docs"
PUBLIC_MODULES = ("edits", "methods", "plots", "sinks", "io", "tensors")

# An example fence of Python code that is not a code cell (```python, ~~~py, ```{code-block} python,
# indented or not, any case); it must be marked just above.
_PYTHON_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(\{code-block\}\s*)?(i?py(thon3?)?|pycon)\b", re.IGNORECASE)
_CODE_CELL = re.compile(r"^\s*(`{3,}|~{3,})\{code-cell\}", re.MULTILINE)
_NOT_RUN = re.compile(r"^<!-- not run: .{10,} -->$")


@pytest.mark.parametrize(
    ("line", "python"),
    [
        ("```python", True),
        ("```py", True),
        ("~~~Python3", True),
        ("   ```ipython", True),
        ("```python {linenos}", True),
        ("```{code-block} python", True),
        ("```pycon", True),
        ("```{code-cell} python", False),
        ("```sh", False),
        ("```pyproject", False),
        ("```text", False),
    ],
)
def test_the_fence_rule_knows_a_python_block(line: str, python: bool) -> None:
    assert bool(_PYTHON_FENCE.match(line)) is python


def pages() -> list[Path]:
    return sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.parts)


def test_every_public_name_has_a_reference_entry() -> None:
    reference = "\n".join(path.read_text() for path in (DOCS / "reference").glob("*.md"))
    documented = set(re.findall(r"^\.\. auto\w+:: hookscope\.(\w+)$", reference, flags=re.MULTILINE))
    whole_modules = set(re.findall(r"^\.\. automodule:: hookscope\.(\w+)$", reference, flags=re.MULTILINE))
    wanted = {name for name in hs.__all__ if not name.startswith("__")} - set(PUBLIC_MODULES)
    assert sorted(wanted - documented) == []
    assert sorted(set(PUBLIC_MODULES) - whole_modules) == []


@pytest.mark.parametrize("page", pages(), ids=lambda path: str(path.relative_to(DOCS)))
def test_every_python_example_runs_or_says_why_not(page: Path) -> None:
    lines = page.read_text().splitlines()
    unmarked = [
        f"{page.relative_to(DOCS)}:{number + 1}"
        for number, line in enumerate(lines)
        if _PYTHON_FENCE.match(line) and not (number > 0 and _NOT_RUN.match(lines[number - 1].strip()))
    ]
    assert unmarked == [], "a Python block that is not a {code-cell} needs '<!-- not run: why -->' above it"


def test_a_page_with_code_cells_is_a_notebook() -> None:
    """A code cell runs only on a page MyST-NB reads as a notebook (its front matter says so)."""
    plain = [
        str(page.relative_to(DOCS))
        for page in pages()
        if _CODE_CELL.search(page.read_text()) and not page.read_text().startswith("---\nfile_format: mystnb")
    ]
    assert plain == []
