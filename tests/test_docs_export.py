"""The documentation site for tools and coding agents: each page as Markdown, ``llms.txt`` and
``llms-full.txt`` (written by ``docs/_ext/llms_txt.py`` when the HTML build ends).

The translator's tests parse small reST and MyST snippets and need no build. The site's tests read
what ``make docs`` built (``make test`` builds it first): skipped where it is missing, unless
``HOOKSCOPE_BROWSER_TESTS=require`` (set by CI), where that fails.
"""

from __future__ import annotations

import html
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")

from docutils import nodes
from docutils.core import publish_doctree
from docutils.utils import new_document
from myst_parser.parsers.docutils_ import Parser as MystParser
from sphinx import addnodes

import hookscope as hs
from tests.docs_site import built_site

DOCS = Path(__file__).resolve().parents[1] / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

from md_export import MarkdownWriter  # noqa: E402  (docs/_ext is not a package)

_SETTINGS = {"doctitle_xform": False, "report_level": 5, "halt_level": 5, "myst_enable_extensions": ["deflist"]}


def rst(text: str) -> nodes.document:
    return publish_doctree(text, settings_overrides=_SETTINGS)


def myst(text: str) -> nodes.document:
    return publish_doctree(text, parser=MystParser(), settings_overrides=_SETTINGS)


def markdown(doctree: nodes.Node, link: Callable[[str], str] | None = None) -> str:
    return (MarkdownWriter(link=link) if link else MarkdownWriter()).page(doctree)


# -- the translator, on small doctrees -----------------------------------------------------------------


def test_sections_become_headings_by_depth() -> None:
    text = markdown(myst("# Top\n\nIntro.\n\n## Middle\n\n### Low\n\n#### Lowest\n\nText.\n"))
    assert text == "# Top\n\nIntro.\n\n## Middle\n\n### Low\n\n#### Lowest\n\nText.\n"


def test_inline_markup_and_links() -> None:
    text = markdown(
        rst("A ``code`` word, *emphasis*, **strong**, `a site <https://pytorch.org>`_ and `local <other.html#x>`_.\n"),
        link=lambda uri: uri.replace(".html", ".html.md"),
    )
    assert text.strip() == (
        "A `code` word, *emphasis*, **strong**, [a site](https://pytorch.org) and [local](other.html.md#x)."
    )


def test_internal_references_go_through_the_link_rewriter() -> None:
    paragraph = nodes.paragraph("", "", nodes.reference("", "", nodes.literal("", "hs.capture()"), internal=True))
    paragraph[0]["refuri"] = "../reference/capture.html#hookscope.capture"
    text = MarkdownWriter(link=lambda uri: uri.replace(".html", ".html.md")).inline(paragraph)
    assert text == "[`hs.capture()`](../reference/capture.html.md#hookscope.capture)"


def test_literal_blocks_become_fences_with_their_language() -> None:
    text = markdown(myst("```python\nx = 1\n```\n\n```\nplain\n```\n\n````sh\necho ```\n````\n"))
    assert "```python\nx = 1\n```" in text
    assert "```text\nplain\n```" in text
    assert "````sh\necho ```\n````" in text  # a fence longer than any run of backticks inside


def test_lists_nested_and_numbered() -> None:
    text = markdown(rst("- one\n- two\n\n  - inner\n\n3. three\n4. four\n"))
    assert "- one\n\n- two\n\n  - inner" in text
    assert "3. three\n4. four" in text


def test_definition_lists() -> None:
    text = markdown(rst("term\n    What the term means.\n\nother\n    Another meaning.\n"))
    assert text.strip() == "term\n: What the term means.\n\nother\n: Another meaning."


def test_tables_become_pipe_tables() -> None:
    table = rst(
        "=====  ==========\nname   what\n=====  ==========\n``a``  one | two\nb      *three*\n=====  ==========\n"
    )
    assert markdown(table).strip() == ("| name | what |\n| --- | --- |\n| `a` | one \\| two |\n| b | *three* |")


def test_admonitions_become_quotes_with_their_kind() -> None:
    text = markdown(rst(".. note::\n\n   Keep it short.\n\n.. admonition:: Why\n\n   Because.\n"))
    assert "> **Note:** Keep it short." in text
    assert "> **Why:** Because." in text


def test_an_autodoc_entry_gives_its_name_its_signature_and_its_content() -> None:
    signature = addnodes.desc_signature("", "")
    signature += addnodes.desc_addname("", "hookscope.")
    signature += addnodes.desc_name("", "capture")
    parameters = addnodes.desc_parameterlist()
    parameters += addnodes.desc_parameter("", "model")
    parameters += addnodes.desc_parameter("", "*selectors")
    signature += parameters
    content = addnodes.desc_content("", nodes.paragraph("", "Keep the outputs."))
    document = new_document("reference")
    document += nodes.section("", nodes.title("", "Capture"), addnodes.desc("", signature, content))
    text = MarkdownWriter().page(document)
    assert text == (
        "# Capture\n\n## `hookscope.capture`\n\n```python\nhookscope.capture(model, *selectors)\n```\n\n"
        "Keep the outputs.\n"
    )


def test_a_notebook_cell_gives_its_source_and_its_outputs() -> None:
    source = nodes.container("", nodes.literal_block("", "print(1 + 1)", language="ipython3"))
    source["nb_element"] = "cell_code_source"
    output = nodes.container(
        "",
        nodes.literal_block("", "2\n", classes=["output", "stream"], language="myst-ansi"),
        nodes.image(uri="figure.png"),
    )
    output["nb_element"] = "cell_code_output"
    cell = nodes.container("", source, output)
    cell["nb_element"] = "cell_code"
    text = MarkdownWriter(image=lambda uri: "../_images/" + uri).page(nodes.section("", cell))
    assert text == "```python\nprint(1 + 1)\n```\n\n```text\n2\n```\n\n![figure](../_images/figure.png)\n"


def test_an_unknown_node_gives_its_text() -> None:
    class gadget(nodes.General, nodes.TextElement):  # noqa: N801  (docutils names nodes in lower case)
        pass

    assert markdown(nodes.section("", gadget("", "what it says"))) == "what it says\n"


# -- the built site ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site() -> Path:
    return built_site("llms.txt")


def toctree_pages(docname: str = "index") -> list[str]:
    """Every page the tables of contents reach from ``docname``, read from the sources, in order."""
    source = (DOCS / docname).with_suffix(".md").read_text(encoding="utf-8")
    pages: list[str] = []
    for block in re.findall(r"```\{toctree\}\n(.*?)```", source, re.DOTALL):
        for line in block.splitlines():
            if line.strip() and not line.startswith(":"):
                child = str(Path(docname).parent / line.strip()).removeprefix("./")
                pages += [child, *(p for p in toctree_pages(child) if p not in pages)]
    return pages


@pytest.mark.slow
def test_llms_txt_lists_every_page_of_the_toctree_and_each_link_exists(site: Path) -> None:
    llms = (site / "llms.txt").read_text(encoding="utf-8")
    assert llms.startswith("# hookscope\n\n> ")
    links = re.findall(r"^- \[[^\]]+\]\(([^)]+)\)", llms, re.MULTILINE)
    assert [link.removesuffix(".html.md") for link in links] == toctree_pages()
    for link in links:
        assert (site / link).is_file(), link
    assert {"## Getting started", "## How-to guides", "## Reference"} <= set(llms.splitlines())


@pytest.mark.slow
def test_the_capture_guide_holds_its_executed_outputs(site: Path) -> None:
    page = (site / "guides" / "capture.html").read_text(encoding="utf-8")
    exported = (site / "guides" / "capture.html.md").read_text(encoding="utf-8")
    cells = re.findall(r'<div class="cell_output docutils container">(.*?)</pre>', page, re.DOTALL)
    outputs = [cell.split("<pre>", 1)[1] for cell in cells if "<pre>" in cell]
    assert outputs
    for output in outputs:
        text = html.unescape(re.sub(r"<[^>]+>", "", output)).strip()
        assert f"```text\n{text}\n```" in exported
    assert exported.startswith("# Capture")


@pytest.mark.slow
def test_the_reference_of_capture_holds_its_signature_and_docstring(site: Path) -> None:
    exported = (site / "reference" / "capture.html.md").read_text(encoding="utf-8")
    signature = re.search(r"^```python\n(hookscope\.capture\(.*\))\n```$", exported, re.MULTILINE)
    assert signature is not None
    assert all(name in signature.group(1) for name in inspect.signature(hs.capture).parameters)
    first_sentence = " ".join((hs.capture.__doc__ or "").split(".")[0].split()) + "."
    assert first_sentence in exported


@pytest.mark.slow
def test_llms_full_txt_holds_every_page(site: Path) -> None:
    full = (site / "llms-full.txt").read_text(encoding="utf-8")
    for docname in ["index", *toctree_pages()]:
        exported = (site / f"{docname}.html.md").read_text(encoding="utf-8")
        heading = exported.splitlines()[0]
        assert heading.startswith("# ")
        assert f"\n{heading}\n" in f"\n{full}", docname


@pytest.mark.slow
def test_every_relative_link_of_the_exported_pages_exists(site: Path) -> None:
    missing = []
    for page in site.rglob("*.html.md"):
        text = re.sub(r"^(`{3,}).*?^\1$", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
        text = re.sub(r"`[^`\n]*`", "", text)  # links, not code that looks like one
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path):
                continue  # a link within the page, or to another site
            resolved = (page.parent / path).resolve()
            if not (resolved.exists() and resolved.is_relative_to(site.resolve())):
                missing.append(f"{page.relative_to(site)}: {target}")
    assert missing == []
