"""Attention sub-sites in a capture (issue 19, third step): ``hs.capture(model, "h.*.attn:attn.pattern")``.

Every value is checked against a reference computed without hookscope: the eager twin's
``attn_weights`` (one set of weights built twice), and the arguments and output of each
``scaled_dot_product_attention`` call as a plain ``TorchFunctionMode`` written here sees them.
"""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from hookscope._core.op_sites import OpPattern, op_pattern
from hookscope._core.sites import Site


def stack_depth() -> int:
    return int(torch._C._len_torch_function_stack())


# -- grammar --------------------------------------------------------------------------------------


def test_sub_site_text_round_trips_and_leaves_out_index_0() -> None:
    site = Site("h.0.attn", 0, "output", "", op="attn.pattern#0")
    assert str(site) == "h.0.attn#0:attn.pattern"
    assert Site.parse("h.0.attn#0:attn.pattern") == site
    assert Site.parse("h.0.attn:attn.pattern") == site
    second = Site("h.0.attn", 1, "output", "", op="attn.z#1")
    assert str(second) == "h.0.attn#1:attn.z#1"
    assert Site.parse(str(second)) == second
    with pytest.raises(hs.SpecError, match=r"attn\.q, attn\.k, attn\.v, attn\.scores, attn\.pattern, attn\.z"):
        Site.parse("h.0.attn:attn.weights")


def test_sub_site_selectors_parse_to_the_kernel_s_op_calls() -> None:
    pattern = op_pattern("h.*.attn:attn.pattern")
    assert isinstance(pattern, OpPattern)
    assert (pattern.module, pattern.op, pattern.index) == ("h.*.attn", "scaled_dot_product_attention", None)
    assert pattern.sub == "pattern"
    assert str(pattern) == "h.*.attn:attn.pattern"
    assert str(op_pattern("h.0.attn#1:attn.z#1")) == "h.0.attn#1:attn.z#1"
    with pytest.raises(hs.SpecError, match="attn.scores"):
        op_pattern("h.0.attn:attn.weights")
