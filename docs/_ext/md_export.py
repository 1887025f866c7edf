"""A resolved Sphinx doctree written as Markdown, for readers that are tools rather than people.

The page's Markdown source alone lacks what the build adds: the outputs of its executed code cells
(MyST-NB) and the reference entries autodoc reads from the docstrings. Written from the doctree the
HTML builder resolved, the Markdown holds both. It is compact, not a round trip: what Markdown cannot
say (a figure's layout, a raw HTML widget) is reduced to a line that says it is there.

``MarkdownWriter(link=..., image=...).page(doctree)`` gives one page; ``link`` rewrites an internal
link's target (the HTML page's relative URI), ``image`` an image's URI.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from docutils import nodes
from sphinx import addnodes

__all__ = ["MarkdownWriter"]

_ADMONITIONS = (
    nodes.attention,
    nodes.caution,
    nodes.danger,
    nodes.error,
    nodes.hint,
    nodes.important,
    nodes.note,
    nodes.tip,
    nodes.warning,
    addnodes.seealso,
)
# Nodes that carry nothing a reader of the Markdown needs.
_SKIPPED = (
    nodes.comment,
    nodes.target,
    nodes.substitution_definition,
    nodes.system_message,
    nodes.meta,
    nodes.colspec,
    addnodes.index,
)
_LANGUAGES = {"ipython3": "python", "ipython": "python", "python3": "python", "py": "python", "default": "python"}
_TEXT_LANGUAGES = {"none", "text", "ipythontb", "pytb", ""}
_MAX_HTML_OUTPUT = 4000  # characters of a cell's raw HTML output kept; a longer one becomes a note


def _identity(uri: str) -> str:
    return uri


class MarkdownWriter:
    """Writes one resolved doctree as Markdown (see the module's docstring)."""

    def __init__(self, link: Callable[[str], str] = _identity, image: Callable[[str], str] = _identity) -> None:
        self.link = link
        self.image = image

    # -- the page -------------------------------------------------------------------------------------

    def page(self, doctree: nodes.Node) -> str:
        """The page's Markdown, ending with one newline."""
        return "\n\n".join(self.blocks(doctree, level=1)).strip() + "\n"

    def blocks(self, node: nodes.Node, level: int) -> list[str]:
        """The Markdown blocks of ``node``'s children; ``level`` is the heading level of a section."""
        out: list[str] = []
        for child in node.children:
            out += self.block(child, level)
        return [block for block in out if block.strip()]

    def block(self, node: nodes.Node, level: int) -> list[str]:
        """One node's Markdown blocks."""
        if isinstance(node, _SKIPPED):
            return []
        if isinstance(node, nodes.raw):
            return self._raw(node)
        if isinstance(node, nodes.section):
            return self._section(node, level)
        if isinstance(node, addnodes.compact_paragraph) and node.get("toctree"):
            return self._titled(node, level)  # a resolved table of contents: its caption, then its list
        if isinstance(node, nodes.title):
            return ["#" * min(level, 6) + " " + self.inline(node)]
        if isinstance(node, nodes.paragraph):
            return [self.inline(node)]
        if isinstance(node, nodes.rubric):
            return [f"**{self.inline(node)}**"]
        if isinstance(node, nodes.literal_block | nodes.doctest_block):
            return [self._fence(node)]
        if isinstance(node, nodes.math_block):
            return ["$$\n" + node.astext().strip() + "\n$$"]
        if isinstance(node, nodes.bullet_list):
            return [self._list(node, lambda _: "- ")]
        if isinstance(node, nodes.enumerated_list):
            start = int(node.get("start", 1))
            return [self._list(node, lambda index: f"{start + index}. ")]
        if isinstance(node, nodes.definition_list):
            return [self._definitions(node, level)]
        if isinstance(node, nodes.field_list):
            return self._fields(node, level)
        if isinstance(node, nodes.table):
            return self._table(node, level)
        if isinstance(node, (*_ADMONITIONS, nodes.admonition)):
            return [self._admonition(node, level)]
        if isinstance(node, nodes.block_quote):
            return [_prefix("\n\n".join(self.blocks(node, level)), "> ")]
        if isinstance(node, nodes.line_block):
            return ["\\\n".join(self.inline(line) for line in node.findall(nodes.line))]
        if isinstance(node, nodes.transition):
            return ["---"]
        if isinstance(node, nodes.image):
            return [self._image(node)]
        if isinstance(node, nodes.figure):
            return self.blocks(node, level)
        if isinstance(node, nodes.caption | nodes.legend):
            return [f"*{self.inline(node)}*"]
        if isinstance(node, nodes.footnote | nodes.citation):
            label = node.next_node(nodes.label)
            body = [child for child in node.children if not isinstance(child, nodes.label)]
            text = " ".join(b for child in body for b in self.block(child, level))
            return [f"[{label.astext() if label else '?'}] {text}"]
        if isinstance(node, nodes.topic | nodes.sidebar):
            return self._titled(node, level)
        if isinstance(node, addnodes.desc):
            return self._desc(node, level)
        if isinstance(node, nodes.container) and node.get("nb_element"):
            return self._cell(node, level)
        if isinstance(node, nodes.Text):
            return [node.astext().strip()]
        if isinstance(node, nodes.TextElement):  # an unknown node: its text
            return [self.inline(node)]
        return self.blocks(node, level)  # compound, container, toctree wrappers, and the unknown

    # -- inline ---------------------------------------------------------------------------------------

    def inline(self, node: nodes.Node) -> str:
        """The inline Markdown of ``node``'s children, on one line."""
        return "".join(self._inline(child) for child in node.children).replace("\n", " ").strip()

    def _inline(self, node: nodes.Node) -> str:
        if isinstance(node, nodes.Text):
            return str(node.astext())  # without docutils' escapes (a null before an escaped space)
        if isinstance(node, (_SKIPPED, nodes.raw)):
            return ""
        if isinstance(node, addnodes.literal_emphasis):  # a type in a field list: plain, as typed
            return self._children(node)
        if isinstance(node, nodes.literal):
            return _code(node.astext())
        if isinstance(node, nodes.emphasis | nodes.title_reference):
            return _wrap(self._children(node), "*")
        if isinstance(node, nodes.strong):
            return _wrap(self._children(node), "**")
        if isinstance(node, nodes.reference):
            return self._reference(node)
        if isinstance(node, nodes.math):
            return f"${node.astext()}$"
        if isinstance(node, nodes.footnote_reference | nodes.citation_reference):
            return f"[{node.astext()}]"
        if isinstance(node, nodes.image):
            return self._image(node)
        return self._children(node) if node.children else node.astext()

    def _children(self, node: nodes.Node) -> str:
        return "".join(self._inline(child) for child in node.children)

    def _reference(self, node: nodes.Element) -> str:
        text = self.inline(node) or node.get("refuri", "")
        if "refuri" in node:
            uri = node["refuri"]
            target = self.link(uri) if node.get("internal") or not re.match(r"^[a-z][a-z0-9+.-]*:", uri) else uri
        elif "refid" in node:
            target = "#" + node["refid"]
        else:
            return text
        return f"[{text}]({target})" if target else text

    # -- blocks ---------------------------------------------------------------------------------------

    def _section(self, node: nodes.Element, level: int) -> list[str]:
        out: list[str] = []
        for child in node.children:
            out += self.block(child, level if isinstance(child, nodes.title) else level + 1)
        return out

    def _titled(self, node: nodes.Element, level: int) -> list[str]:
        title = node.next_node(nodes.title)
        out = [f"**{self.inline(title)}**"] if title is not None and title.parent is node else []
        rest = [child for child in node.children if not isinstance(child, nodes.title)]
        return out + [b for child in rest for b in self.block(child, level)]

    def _fence(self, node: nodes.Element, language: str | None = None) -> str:
        text = node.astext().rstrip("\n")
        if language is None:
            classes = [name for name in node.get("classes", ()) if name != "code"]  # docutils' own parsers
            default = "python" if isinstance(node, nodes.doctest_block) else (classes[0] if classes else "")
            language = node.get("language", default)
            language = _LANGUAGES.get(language, language)
            if language in _TEXT_LANGUAGES:
                language = "text"
        ticks = "`" * max(3, max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
        return f"{ticks}{language}\n{text}\n{ticks}"

    def _list(self, node: nodes.Element, marker: Callable[[int], str]) -> str:
        items = []
        for index, item in enumerate(node.children):
            if not isinstance(item, nodes.list_item):
                continue
            lead = marker(index)
            body = "\n\n".join(self.blocks(item, level=6)) or ""
            items.append(lead + _prefix(body, " " * len(lead))[len(lead) :])
        loose = any("\n\n" in item for item in items)
        return ("\n\n" if loose else "\n").join(items)

    def _definitions(self, node: nodes.Element, level: int) -> str:
        out = []
        for item in node.findall(nodes.definition_list_item):
            if item.parent is not node:
                continue
            term = " ".join(self.inline(term) for term in item.children if isinstance(term, nodes.term))
            definition = item.next_node(nodes.definition)
            body = "\n\n".join(self.blocks(definition, level)) if definition is not None else ""
            out.append(f"{term}\n: " + _prefix(body, "  ")[2:])
        return "\n\n".join(out)

    def _fields(self, node: nodes.Element, level: int) -> list[str]:
        out = []
        for field in node.children:
            if not isinstance(field, nodes.field):
                continue
            name = self.inline(field[0])
            body = self.blocks(field[1], level)
            if len(body) == 1 and "\n" not in body[0]:
                out.append(f"**{name}:** {body[0]}")
            else:
                out.append(f"**{name}:**\n\n" + "\n\n".join(body))
        return out

    def _table(self, node: nodes.Element, level: int) -> list[str]:
        title = node.next_node(nodes.title)
        head = [self._row(row) for row in _rows(node, nodes.thead)]
        body = [self._row(row) for row in _rows(node, nodes.tbody)]
        if not head and body:
            head, body = body[:1], body[1:]
        if not head:
            return []
        width = max(len(row) for row in head + body)
        lines = [_pipe(head[0], width), "| " + " | ".join(["---"] * width) + " |"]
        lines += [_pipe(row, width) for row in head[1:] + body]
        caption = [f"*{self.inline(title)}*"] if title is not None and title.parent is node else []
        return [*caption, "\n".join(lines)]

    def _row(self, row: nodes.Element) -> list[str]:
        cells = []
        for entry in row.children:
            text = "<br>".join(block.replace("\n", " ") for block in self.blocks(entry, level=6))
            cells.append(text.replace("|", "\\|"))
        return cells

    def _admonition(self, node: nodes.Element, level: int) -> str:
        title = node.next_node(nodes.title)
        if isinstance(node, nodes.admonition) and title is not None and title.parent is node:
            label = self.inline(title)
        else:
            label = "See also" if isinstance(node, addnodes.seealso) else node.tagname.capitalize()
        rest = [child for child in node.children if not isinstance(child, nodes.title)]
        body = "\n\n".join(b for child in rest for b in self.block(child, level))
        return _prefix(f"**{label}:** {body}", "> ")

    def _desc(self, node: nodes.Element, level: int) -> list[str]:
        """An autodoc entry: its name as a heading, the full signature as a code line, then its content."""
        out = []
        for signature in node.children:
            if isinstance(signature, addnodes.desc_signature):
                names = signature.findall(lambda n: isinstance(n, addnodes.desc_addname | addnodes.desc_name))
                name = "".join(part.astext() for part in names) or signature.astext()
                out.append("#" * min(level, 6) + " " + _code(name))
                out.append("```python\n" + _signature(signature) + "\n```")
        for content in node.children:
            if isinstance(content, addnodes.desc_content):
                out += self.blocks(content, level + 1)
        return out

    def _cell(self, node: nodes.Element, level: int) -> list[str]:
        """A MyST-NB cell: its source as a Python fence, each text output as a text fence."""
        element = node["nb_element"]
        if element == "cell_code_source":
            return [self._fence(block, "python") for block in node.findall(nodes.literal_block)]
        if element == "cell_code_output":
            out: list[str] = []
            for child in node.children:
                if isinstance(child, nodes.literal_block):
                    out.append(self._fence(child, "text"))
                else:
                    out += self.block(child, level)
            return out
        return self.blocks(node, level)

    def _raw(self, node: nodes.Element) -> list[str]:
        """A cell's HTML output is kept when short (Markdown readers read HTML); other raw text is not."""
        if node.get("format") != "html" or "output" not in node.get("classes", ()):
            return []
        text = node.astext().strip()
        if len(text) > _MAX_HTML_OUTPUT:
            return [f"*(an HTML output of {len(text)} characters, shown on the HTML page)*"]
        return [text]

    def _image(self, node: nodes.Element) -> str:
        uri = node.get("uri", "")
        if uri.startswith("data:"):
            return "*(an embedded image, shown on the HTML page)*"
        return f"![{node.get('alt', 'figure')}]({self.image(uri)})"


def _signature(signature: nodes.Element) -> str:
    """The signature as written: ``hookscope.capture(model, *layers, ...) -> Capture``."""
    text = signature.astext().replace("\n", " ")
    return re.sub(r"\s*\[source\]\s*$", "", text).strip()


def _rows(table: nodes.Element, part: type[nodes.Element]) -> Iterable[nodes.Element]:
    for section in table.findall(part):
        yield from (row for row in section.children if isinstance(row, nodes.row))


def _pipe(cells: list[str], width: int) -> str:
    return "| " + " | ".join(cells + [""] * (width - len(cells))) + " |"


def _wrap(text: str, mark: str) -> str:
    """``text`` between ``mark``s, the spaces at its ends kept outside them (``*a* b``, not ``*a *b``)."""
    core = text.strip()
    if not core:
        return text
    start = text.index(core[0])
    return f"{text[:start]}{mark}{core}{mark}{text[start + len(core) :]}"


def _code(text: str) -> str:
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _prefix(text: str, prefix: str) -> str:
    """Every line of ``text`` with ``prefix`` (blank lines keep only its non-space part)."""
    return "\n".join(prefix + line if line.strip() else prefix.rstrip() for line in text.split("\n"))
