"""One grammar for leaves: ``what`` plus a relative path in every record, one label, one parser."""

from __future__ import annotations

import copy
from typing import Any, get_args

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hookscope as hs
from hookscope._core.names import LEAF_KINDS, leaf_label, parse_leaf, split_leaf
from hookscope._core.sites import SiteKind
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope.errors import SpecError
from tests.models import KeywordOnly, gpt2_input, tiny_gpt2

SIDES = ("input", "output")
RELATIVE = st.from_regex(r"(\[[0-9]+\]|\.[a-z_][a-z_0-9]*|\['[a-z.:\[\] ]*'\]){0,4}", fullmatch=True)


# -- the label and the parser ---------------------------------------------------------------------


def test_the_site_kinds_are_the_leaf_kinds() -> None:
    assert get_args(SiteKind) == LEAF_KINDS


@given(st.sampled_from(LEAF_KINDS), RELATIVE)
def test_a_label_splits_back_into_what_and_path(what: str, path: str) -> None:
    assert split_leaf(leaf_label(what, path)) == (what, path)
    assert split_leaf(path) == (None, path)
    assert str(hs.Site("m", 0, what, path)) == f"m#0:{leaf_label(what, path)}"  # type: ignore[arg-type]


@given(st.sampled_from(SIDES), RELATIVE)
def test_the_full_and_the_relative_form_parse_to_one_path(side: str, path: str) -> None:
    assert parse_leaf(leaf_label(side, path), side) == path
    assert parse_leaf(path, side) == path
    other = "input" if side == "output" else "output"
    with pytest.raises(SpecError, match=f"is a leaf of the {other}, but a leaf of the {side} was expected"):
        parse_leaf(leaf_label(other, path), side)


nested = st.recursive(
    st.just(torch.zeros(1)) | st.none() | st.integers(0, 3),
    lambda children: (
        st.lists(children, max_size=3)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(st.text("ab.:[]' ", max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)


@given(nested)
def test_every_path_the_tree_makes_parses_back(value: Any) -> None:
    for path, _ in flatten_tensors(value, ""):
        assert parse_leaf(leaf_label("output", path), "output") == path
        assert parse_leaf(path, "output") == path
    for path, _ in call_leaves((value,), {"mask": value}):
        assert parse_leaf(leaf_label("input", path), "input") == path
    # The public default still gives the full label, as it always has.
    assert [path for path, _ in flatten_tensors(value)] == [
        leaf_label("output", path) for path, _ in flatten_tensors(value, "")
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("outputs[0]", "names 'outputs'; expected one of input, output"),
        ("logits", "names 'logits'"),
        ("0", "is not a leaf path"),
        (" [0]", "is not a leaf path"),
    ],
)
def test_a_malformed_leaf_is_a_spec_error(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        split_leaf(text)
    with pytest.raises(SpecError, match=message):
        hs.edits.zero(path=text)  # refused when the edit is made


def test_site_text_and_cache_keys_read_leaves_with_the_same_parser() -> None:
    with pytest.raises(SpecError, match="names 'output0'"):
        hs.Site.parse("fc:output0")
    with pytest.raises(SpecError, match="not of the form"):
        hs.Site.parse("fc:[0]")  # a site names its value
    _, cache = hs.run_with_capture(KeywordOnly(), torch.ones(2, 4), layers="block", keep="input")
    assert cache.sites()[1] == hs.Site("block", 0, "input", "['scale']")
    assert cache["block:['scale']"] is cache["block:input['scale']"]  # relative to the value kept
    assert cache["block:[0]"] is cache[hs.Site.parse("block#0:input[0]")]
    with pytest.raises(hs.SiteNotFoundError, match="names 'outptu'"):
        cache["block:outptu"]
    assert "block:outptu" not in cache


# -- edits: the full and the relative path name one tensor ------------------------------------------


@pytest.mark.transformers
def test_output_paths_in_full_and_relative_edit_the_same_tensor_of_a_gpt2_block() -> None:
    model = tiny_gpt2()
    seen: dict[str, tuple[str, str, str]] = {}

    def scaled(label: str) -> Any:
        def edit(value: torch.Tensor, ctx: hs.EditContext) -> torch.Tensor:
            seen[label] = (ctx.path, ctx.label, ctx.site)
            return value * 0.5

        edit.path = label  # type: ignore[attr-defined]
        return edit

    with torch.no_grad():
        plain = model(input_ids=gpt2_input()).last_hidden_state
        # The attention inside a block returns a tuple (attn_output, attn_weights).
        full, _ = hs.run_with_edits(
            model, input_ids=gpt2_input(), edits={"h.0.attn": hs.edits.scale(0.5, path="output[0]")}
        )
        relative, _ = hs.run_with_edits(
            model, input_ids=gpt2_input(), edits={"h.0.attn": hs.edits.scale(0.5, path="[0]")}
        )
        default, _ = hs.run_with_edits(model, input_ids=gpt2_input(), edits={"h.0.attn": hs.edits.scale(0.5)})
        hs.run_with_edits(model, input_ids=gpt2_input(), edits={"h.0.attn": [scaled("output[0]"), scaled("[0]")]})
        # The block itself returns its hidden states: "output" and "" name them.
        block_full, _ = hs.run_with_edits(
            model, input_ids=gpt2_input(), edits={"h.0": hs.edits.zero(neurons=[3], path="output")}
        )
        block_relative, _ = hs.run_with_edits(
            model, input_ids=gpt2_input(), edits={"h.0": hs.edits.zero(neurons=[3], path="")}
        )
    assert not torch.equal(full.last_hidden_state, plain)
    assert torch.equal(full.last_hidden_state, relative.last_hidden_state)
    assert torch.equal(full.last_hidden_state, default.last_hidden_state)
    assert seen == dict.fromkeys(("output[0]", "[0]"), ("[0]", "output[0]", "h.0.attn#0:output[0]"))
    assert not torch.equal(block_full.last_hidden_state, plain)
    assert torch.equal(block_full.last_hidden_state, block_relative.last_hidden_state)


@pytest.mark.transformers
def test_input_paths_in_full_and_relative_edit_the_same_tensor() -> None:
    model = tiny_gpt2()
    with torch.no_grad():
        plain = model(input_ids=gpt2_input()).last_hidden_state
        runs = [
            hs.run_with_edits(model, input_ids=gpt2_input(), edits={"h.1": hs.edits.scale(2.0, path=path)}, on="input")[
                0
            ]
            for path in ("input[0]", "[0]")
        ]
        edit = hs.edit(model, {"h.1": hs.edits.scale(2.0, path="input[0]")}, on="input")
        with edit, hs.capture(model, "h.1", keep="input") as cache:  # attached after the edit: sees it
            model(input_ids=gpt2_input())
        hidden = hs.run_with_capture(model, input_ids=gpt2_input(), layers="h.0")[1]["h.0:output"]
    assert not torch.equal(runs[0].last_hidden_state, plain)
    assert torch.equal(runs[0].last_hidden_state, runs[1].last_hidden_state)
    assert torch.equal(cache["h.1:input[0]"], hidden * 2.0)
    assert torch.equal(cache["h.1:[0]"], cache["h.1:input[0]"])
    keyword = KeywordOnly()
    x = torch.randn(2, 4)
    with torch.no_grad():
        a, b = (
            hs.run_with_edits(keyword, x, edits={"block": hs.edits.scale(3.0, path=path)}, on="input")[0]
            for path in ("input['scale']", "['scale']")
        )
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("path", "on", "message"),
    [
        (
            "input[0]",
            "output",
            r"path='input\[0\]' is a leaf of the input, but a leaf of the output was expected.*"
            r"pass on='input'",
        ),
        (
            "output[0]",
            "input",
            r"path='output\[0\]' is a leaf of the output, but a leaf of the input was expected.*"
            r"leave on='output'",
        ),
        ("output", "input", "a leaf of the input was expected"),
    ],
)
@pytest.mark.transformers
def test_a_path_on_the_wrong_side_is_refused_before_the_forward(path: str, on: str, message: str) -> None:
    model = tiny_gpt2()
    with pytest.raises(SpecError, match=message):
        hs.edit(model, {"h.0": hs.edits.zero(path=path)}, on=on)  # type: ignore[arg-type]
    assert not hs.attached(model)


@pytest.mark.transformers
def test_a_missing_leaf_is_named_in_full() -> None:
    model = tiny_gpt2()
    with pytest.raises(
        hs.EditError,
        match=r"h\.0\.attn#0:output\[5\]: no tensor at 'output\[5\]'; the tensors are "
        r"at output\[0\]",
    ):
        hs.run_with_edits(model, input_ids=gpt2_input(), edits={"h.0.attn": hs.edits.zero(path="[5]")})


# -- every feature records the same leaf the same way ---------------------------------------------


@pytest.mark.transformers
def test_trace_grads_capture_diff_and_edits_agree_on_the_relative_path_of_a_leaf() -> None:
    model = tiny_gpt2()
    layers = ["h.0", "h.0.attn"]
    trace = hs.trace(model, input_ids=gpt2_input(), layers=layers)
    traced = {(row.name, info.what, info.path) for row in trace for info in (*row.inputs, *row.outputs)}
    _, cache = hs.run_with_capture(model, input_ids=gpt2_input(), layers=layers, keep="both")
    captured = {(site.module, site.what, site.path) for site in cache.sites()}
    assert traced == captured
    assert ("h.0.attn", "output", "[0]") in traced
    assert ("h.0", "output", "") in traced

    with hs.watch_grads(model, layers=layers, params=False) as monitor:
        model(input_ids=gpt2_input()).last_hidden_state.pow(2).sum().backward()
        step = monitor.step()
    assert step is not None
    side = {"grad_output": "output", "grad_input": "input"}
    graded = {(r.module, side[r.what], r.path) for r in step.records}
    assert graded <= captured  # only the float leaves gradients reach
    assert ("h.0.attn", "output", "[0]") in graded
    attn = next(r for r in step.of("grad_output") if r.module == "h.0.attn")
    assert (attn.leaf, attn.column) == ("output[0]", "h.0.attn#0:output[0]")

    diff = hs.diff(model, copy.deepcopy(model), input_ids=gpt2_input(), layers=layers)
    assert {(row.name, row.what, row.path) for row in diff} == {k for k in captured if k[1] == "output"}
    assert diff["h.0.attn#0:output[0]"].label == "output[0]"
    assert {(r["name"], r["what"], r["path"]) for r in diff.records()} == {k for k in captured if k[1] == "output"}
    assert {(leaf.what, leaf.path) for leaf in diff["h.0.attn#0:output[0]"].inputs} <= {
        (what, path) for module, what, path in captured if module == "h.0.attn"
    }

    infos = {info.label: info.to_dict() for info in trace["h.0.attn"].outputs}
    assert (infos["output[0]"]["what"], infos["output[0]"]["path"]) == ("output", "[0]")
    leaf_rows = [r for r in trace.to_pandas(per="leaf").to_dict("records") if r["name"] == "h.0.attn"]
    assert [(r["what"], r["path"]) for r in leaf_rows] == [("output", "[0]")]
    assert "input[0] [2, 8, 32] float32" in trace["h.0"].describe()
    assert trace.records()[0]["inputs"].startswith("input[0] [2, 8, 32] float32")
