"""Every result Jupyter shows has a compact ``_repr_html_``: read back with ``html.parser``, it holds
the result's own content, and every string a user chose (a module's name, a token, a family) is
escaped: no tag of the user's survives as markup.
"""

from __future__ import annotations

import math
import tempfile
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._core.sites import Site
from tests.models import track

SCRIPT = "<script>alert(1)</script>"


class Page(HTMLParser):
    """The tags of a fragment, the text of each paragraph, and the rows of its tables, in order."""

    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.texts: list[str] = []  # paragraphs
        self.rows: list[list[str]] = []  # table rows, cells as text (&nbsp; read as a space)
        self._in: str | None = None
        self.feed(fragment)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._in = "cell"
            self.rows[-1].append("")
        elif tag == "p":
            self._in = "p"
            self.texts.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("p", "td", "th"):
            self._in = None

    def handle_data(self, data: str) -> None:
        data = data.replace("\xa0", " ")
        if self._in == "cell":
            self.rows[-1][-1] += data
        elif self._in == "p":
            self.texts[-1] += data

    @property
    def text(self) -> str:
        return "\n".join(self.texts)


def shown(result: object) -> Page:
    fragment = result._repr_html_()  # type: ignore[attr-defined]
    page = Page(fragment)
    assert "script" not in page.tags, "a user's tag became markup"
    assert set(page.tags) <= {"p", "b", "table", "thead", "tbody", "tr", "th", "td"}, page.tags
    return page


def test_std_map() -> None:
    site = hs.StdSite("blocks.0.attn", f"h.0.{SCRIPT}", f"h.0.{SCRIPT}:op[add#0]", f"h.0.{SCRIPT}", "module")
    embed = hs.StdSite("embed", "wte:output", "wte:output", "wte", "output")
    std = hs.StdMap(SCRIPT, {"embed": embed, "blocks.0.attn": site}, missing={"blocks.0.mlp.router": "<no MoE>"})
    page = shown(std)
    assert page.texts[0] == std.table().splitlines()[0]
    assert SCRIPT in page.texts[0]
    assert page.rows[0] == ["canonical name", "read", "edits"]
    assert page.rows[1] == ["embed", "wte:output", ""]  # edits the same site it reads: not repeated
    assert page.rows[2] == ["blocks.{i}.attn", f"h.{{i}}.{SCRIPT}", f"h.{{i}}.{SCRIPT}:op[add#0]"]
    assert page.texts[-1] == "not defined here: blocks.*.mlp.router: <no MoE>"


def test_monitor_step_and_monitor() -> None:
    model = track(nn.Sequential(nn.Linear(2, 3)))
    model.add_module(SCRIPT, nn.Linear(3, 1))
    with hs.monitor(model) as mon:
        model(torch.randn(4, 2)).sum().backward()
        step = mon.step()
        assert step is not None
        page = shown(step)
        assert page.texts[0].startswith(f"step 0: {len(step.records)} gradients, 0 flags")
        assert page.rows[0] == ["layer", "what", "norm", "mean |g|", "max |g|", "nan/inf"]
        assert [row[:3] for row in page.rows[1:]] == [[r.column, r.what, f"{r.norm:.4g}"] for r in step.records]
        assert any(row[0] == f"{SCRIPT}#0" for row in page.rows)
        monitor_page = shown(mon)
        assert monitor_page.texts[0] == "hs.monitor of 2 layers: 1 steps logged; step 0:"
        assert monitor_page.rows == page.rows


def test_a_monitor_step_without_gradients_lists_its_scalars() -> None:
    model = track(nn.Sequential(nn.Linear(2, 3)))
    with hs.monitor(model, grads=False, params=False) as mon:
        assert shown(mon).text == "hs.monitor of 1 layers: 0 steps logged"
        model(torch.randn(4, 2)).sum().backward()
        step = mon.step()
    assert step is not None
    assert not step.records
    assert step.scalars
    page = shown(step)
    assert page.rows[0] == ["scalar", "value"]
    assert {row[0]: row[1] for row in page.rows[1:]} == {k: f"{v:.4g}" for k, v in step.scalars.items()}


def test_a_nonfinite_gradient_row_is_marked() -> None:
    step = hs.MonitorStep(3, [hs.GradRecord(3, "fc", "Linear", 0, "grad_output", "", math.nan, 1.0, 2.0, 1, 0, 4)])
    fragment = step._repr_html_()
    assert '<tr style="background:#fdd">' in fragment
    assert shown(step).rows[1][-1] == "1/0"


def test_cache() -> None:
    cache = hs.Cache({Site(SCRIPT, 0): torch.zeros(2, 3)})
    page = shown(cache)
    assert page.rows[1][:2] == [f"{SCRIPT}#0:output", "(2, 3)"]


def test_effects() -> None:
    effects = hs.methods.Effects(
        torch.tensor([[0.25, 1.0]]), torch.tensor([[1.5, 3.0]]), ("site", "position"),
        {"site": [SCRIPT], "position": [0, 1]}, clean=3.0, corrupted=1.0, method="patch_sweep", metric=SCRIPT,
    )  # fmt: skip
    page = shown(effects)
    assert SCRIPT in page.texts[0]
    assert page.rows[0] == ["site", "position", "effect"]
    assert page.rows[1] == [SCRIPT, "1", "+1.000"]


def test_lens() -> None:
    logits = torch.tensor([[[[0.0, 5.0]]], [[[5.0, 0.0]]]])  # (layer, row, position, vocab)
    lens = hs.methods.Lens(logits, ["blocks.0", SCRIPT], decode=["<a>", "<b>"])
    page = shown(lens)
    assert page.texts[0] == "Logit lens: 2 layers"
    assert page.rows[2][0] == SCRIPT
    assert page.rows[2][1].startswith("<a> 0.99")


def test_trace_and_diff() -> None:
    model = track(nn.Sequential())
    model.add_module(SCRIPT, nn.Linear(2, 2))
    x = torch.randn(1, 2)
    trace = hs.trace(model, x)
    page = shown(trace)
    assert page.rows[2][1:3] == [f"  {SCRIPT}", "Linear"]  # indented under the root
    diff = hs.diff(model, model, x)
    assert shown(diff).rows[1][1:3] == [f"{SCRIPT}#0", "Linear"]


@pytest.mark.slow
def test_store() -> None:
    pytest.importorskip("zarr")
    model = nn.Sequential(nn.Linear(4, 3))
    out = tempfile.mkdtemp() + "/f.zarr"
    store = hs.extract(model, torch.randn(6, 4), out, layers="0", progress=False)
    page = shown(store)
    assert page.texts == [f"<Store {out}: 6 rows, 1 site, complete>"]
    assert page.rows == [["array", "site", "shape", "dtype", "size"], ["0", "0#0:output", "(N, 3)", "float32", "72 B"]]
