"""Sphinx configuration of hookscope's documentation site (``make docs``).

The pages are MyST Markdown. Pages whose examples run are MyST-NB text notebooks
(``file_format: mystnb`` in their front matter): their ``{code-cell}`` blocks execute at build
time, so every example shows its real output and a broken one fails the build. Why Sphinx with
MyST-NB, and not MkDocs: see ``architecture.md`` ("The documentation site").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))  # this site's own extensions
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import hookscope  # noqa: E402  (after the path and the offline switches)

project = "hookscope"
author = "hookscope maintainers"
copyright = "hookscope maintainers"  # noqa: A001  (Sphinx reads this name)
release = hookscope.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "llms_txt",  # each page as Markdown, llms.txt and llms-full.txt (docs/_ext)
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "examples", "**/.ipynb_checkpoints"]

# MyST: headings get anchors down to level 3, so a page's sections can be linked to.
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist", "attrs_inline"]
myst_heading_anchors = 3

# MyST-NB: every code cell runs at build time, in a fresh kernel per page; one that raises fails the
# build (a cell that is meant to raise says so with the ``raises-exception`` tag).
nb_execution_mode = "force"
nb_execution_timeout = 180
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# Libraries' stderr chatter (a progress bar without widgets, a config note) is not what a page shows;
# a page that means to show a warning prints it.
nb_output_stderr = "remove"

# The reference is read from the docstrings; options are documented once, on their fields.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"hookscope {release}"
html_static_path: list[str] = []
html_copy_source = True  # each page's Markdown source is published beside it, for tools and agents
html_show_sourcelink = True


def _options_fields(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    """An options class's fields, each with the docstring written under it (``Options.field_docs``):
    the package names itself as their ``__module__``, so autodoc would look for them elsewhere."""
    from hookscope._shared.options import Options

    if what != "class" or not (isinstance(obj, type) and issubclass(obj, Options)):
        return
    lines += ["", "**Options** (each also a keyword of the functions that take this class):", ""]
    for field, text in obj.field_docs().items():
        lines += [f"``{field}``", *(f"   {line}" for line in text.splitlines()), ""]


def setup(app: object) -> None:
    app.connect("autodoc-process-docstring", _options_fields)  # type: ignore[attr-defined]
