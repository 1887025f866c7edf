"""The HTML of a report: one jinja2 template with the stylesheet and script inlined.

Autoescaping is on for everything, so a module named ``<script>`` is text. The only values
marked safe are the package's own CSS and JS, and the details JSON, which :func:`script_json`
makes safe to sit inside a ``<script>`` element.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from hookscope._shared.json import finite_json
from hookscope._shared.optional import require

__all__ = ["render", "script_json"]


def render(context: dict[str, Any]) -> str:
    """The report's HTML for ``context`` (the template's variables, assets added here)."""
    jinja2 = require("jinja2", purpose="hs.report", extra="report")
    assets = resources.files("hookscope._report") / "assets"
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    template = environment.from_string((assets / "report.html.j2").read_text(encoding="utf-8"))
    html: str = template.render(
        **context,
        css=(assets / "report.css").read_text(encoding="utf-8"),
        js=(assets / "report.js").read_text(encoding="utf-8"),
    )
    return html


def script_json(value: Any) -> str:
    """JSON that can sit inside ``<script type="application/json">``: ``<``, ``>`` and ``&`` are
    written as escapes, so no string in it can close the element; NaN and Inf become strings.

    >>> script_json({"name": "</script><b>", "x": float("nan")})
    '{"name": "\\\\u003c/script\\\\u003e\\\\u003cb\\\\u003e", "x": "nan"}'
    """
    text = json.dumps(finite_json(value), allow_nan=False, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
