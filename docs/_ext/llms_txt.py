"""The site for tools and coding agents: each page as Markdown, ``llms.txt`` and ``llms-full.txt``.

When the HTML build finishes, every page's resolved doctree (cell outputs and autodoc entries
included) is written as Markdown at the page's URL with ``.md`` appended (``guides/capture.html.md``),
the convention of https://llmstxt.org. At the site's root, ``llms.txt`` lists the pages under the
captions of the root page's tables of contents, each with its first sentence, and ``llms-full.txt``
holds every page's Markdown in the order of the tables of contents.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from md_export import MarkdownWriter
from sphinx import addnodes
from sphinx.application import Sphinx

_SENTENCE = re.compile(r"^(.+?[.!?])(\s|$)")


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("build-finished", write_exports)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


def write_exports(app: Sphinx, exception: BaseException | None) -> None:
    """Writes the pages' Markdown, ``llms.txt`` and ``llms-full.txt`` after a successful HTML build."""
    if exception is not None or app.builder.format != "html" or app.builder.name not in ("html", "dirhtml"):
        return
    env, builder, outdir = app.env, app.builder, Path(app.outdir)
    uris = {docname: _md_uri(builder.get_target_uri(docname)) for docname in env.found_docs}
    # a page's HTML address, as a link to it reads once normalised (``guides/capture/`` under dirhtml)
    html_to_md = {posixpath.normpath(builder.get_target_uri(docname)): md for docname, md in uris.items()}

    def writer(docname: str, root: bool) -> MarkdownWriter:
        here = posixpath.dirname(uris[docname])

        def link(uri: str) -> str:
            path, hash_, fragment = uri.partition("#")
            if not path:
                return uri
            target = posixpath.normpath(posixpath.join(here, path))
            if target in html_to_md:
                target = html_to_md[target]
            elif not path.endswith((".html", "/")):
                return uri if not root else target + hash_ + fragment
            return (target if root else posixpath.relpath(target, here or ".")) + hash_ + fragment

        def image(uri: str) -> str:
            if uri not in env.images:  # a remote image, or one the build did not copy
                return uri
            target = posixpath.join(builder.imagedir, env.images[uri][1])  # where the builder copies it
            return target if root else posixpath.relpath(target, here or ".")

        return MarkdownWriter(link=link, image=image)

    trees = {docname: env.get_and_resolve_doctree(docname, builder) for docname in sorted(env.found_docs)}
    for docname, doctree in trees.items():
        target = outdir / uris[docname]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(writer(docname, root=False).page(doctree), encoding="utf-8")

    root = app.config.root_doc
    sections = _sections(env, root)
    order = [root] + [docname for _, docnames in sections for docname in docnames]
    order += sorted(set(env.found_docs) - set(order))
    (outdir / "llms.txt").write_text(_llms_txt(app, sections, uris, trees, writer), encoding="utf-8")
    full = [writer(docname, root=True).page(trees[docname]) for docname in order]
    (outdir / "llms-full.txt").write_text("\n---\n\n".join(full), encoding="utf-8")


def _md_uri(uri: str) -> str:
    """A page's Markdown URI: its HTML URI with ``.md`` appended (``index.html.md`` for a folder)."""
    return (uri + "index.html" if uri == "" or uri.endswith("/") else uri) + ".md"


def _sections(env: Any, root: str) -> list[tuple[str, list[str]]]:
    """The root page's tables of contents: each caption with its pages and their descendants, in order."""
    sections: list[tuple[str, list[str]]] = []
    for toctree in env.get_doctree(root).findall(addnodes.toctree):
        docnames: list[str] = []
        for _, ref in toctree["entries"]:
            if ref in env.found_docs:
                _descend(env, ref, docnames)
        sections.append((toctree.get("caption") or "Pages", docnames))
    return sections


def _descend(env: Any, docname: str, into: list[str]) -> None:
    if docname in into:
        return
    into.append(docname)
    for child in env.toctree_includes.get(docname, []):
        _descend(env, child, into)


def _llms_txt(
    app: Sphinx,
    sections: list[tuple[str, list[str]]],
    uris: dict[str, str],
    trees: dict[str, nodes.document],
    writer: Any,
) -> str:
    env = app.env
    root = app.config.root_doc
    lines = [f"# {app.config.project}", "", f"> {_first_paragraph(trees[root], writer(root, True))}", ""]
    lines += [
        f"Each page's Markdown is at its HTML address with `.md` appended; the home page is "
        f"[{env.titles[root].astext()}]({uris[root]}), and `llms-full.txt` holds every page in this order.",
    ]
    for caption, docnames in sections:
        lines += ["", f"## {caption}", ""]
        for docname in docnames:
            doctree = trees[docname]
            summary = _first_sentence(_first_paragraph(doctree, writer(docname, True)) or _entries(doctree))
            title = env.titles[docname].astext()
            lines.append(f"- [{title}]({uris[docname]})" + (f": {summary}" if summary else ""))
    return "\n".join(lines) + "\n"


def _first_paragraph(doctree: nodes.Node, writer: MarkdownWriter) -> str:
    """The page's first paragraph of prose: a direct child of its first section."""
    section = doctree.next_node(nodes.section)
    for child in section.children if section is not None else []:
        if isinstance(child, nodes.paragraph):
            return writer.inline(child)
    return ""


def _entries(doctree: nodes.Node) -> str:
    """A reference page's summary: the names it documents."""
    names = []
    for signature in doctree.findall(addnodes.desc_signature):
        if isinstance(signature.parent.parent, addnodes.desc_content):
            continue  # a member of a documented class
        parts = signature.findall(lambda n: isinstance(n, addnodes.desc_addname | addnodes.desc_name))
        names.append("`" + "".join(part.astext() for part in parts) + "`")
    return ("Reference entries of " + ", ".join(names) + ".") if names else ""


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    match = _SENTENCE.match(text)
    sentence = match.group(1) if match else text
    return sentence.rstrip(":") + ("." if sentence.endswith(":") else "")
