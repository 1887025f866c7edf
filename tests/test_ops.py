"""Op sites (issue 19, first step): op names and the site grammar."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

import hookscope as hs
from hookscope._core.op_sites import OpPattern, OpSite, op_name, op_pattern

# -- names and text -------------------------------------------------------------------------------


class NameOf(TorchFunctionMode):
    """The reference for what a function mode is handed: every function, by identity."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_op_name_reads_every_spelling_of_an_op_as_users_write_it() -> None:
    assert {op_name(f) for f in (torch.softmax, torch.Tensor.softmax, functional.softmax)} == {"softmax"}
    dunders = {
        "__add__": "add",
        "__radd__": "add",
        "__iadd__": "add_",
        "__rsub__": "sub",
        "__mul__": "mul",
        "__rtruediv__": "div",
        "__matmul__": "matmul",
        "__getitem__": "getitem",
        "__invert__": "bitwise_not",
        "__len__": "len",
    }
    assert {name: op_name(getattr(torch.Tensor, name)) for name in dunders} == dunders
    assert op_name(functional.scaled_dot_product_attention) == "scaled_dot_product_attention"
    assert op_name(torch.ops.aten.mul.Tensor) == op_name(torch.ops.aten.mul) == "mul"

    a, b = torch.randn(2, 3), torch.randn(3, 2)
    seen = NameOf()
    with seen:
        _ = a + 1, 1 - a, 2 / a, a @ b, a[0], a.T, -a
        c = a.clone()
        c += 1
    assert [op_name(f) for f in seen.funcs] == ["add", "sub", "div", "matmul", "getitem", "T", "neg", "clone", "add_"]


def test_op_sites_print_and_parse_back() -> None:
    site = OpSite("h.0.attn", 1, "softmax", 2)
    assert str(site) == "h.0.attn#1:op[softmax#2]"
    assert OpSite.parse("h.0.attn:op[softmax#0]") == OpSite("h.0.attn", 0, "softmax", 0)
    for odd in (OpSite("fc#1", 0, "add_", 3), OpSite("a:b", 2, "T", 0), OpSite("", 0, "add", 1)):
        assert OpSite.parse(str(odd)) == odd
    assert str(OpSite("fc#1", 0, "mul", 0)) == r"fc\#1#0:op[mul#0]"
    with pytest.raises(hs.SpecError, match=r"names a pattern.*e\.g\. h:op\[softmax#0\]"):
        OpSite.parse("h:op[softmax]")
    with pytest.raises(hs.SpecError, match=r"is not of the form 'module\[#call\]:op\[name\[#index\]\]'"):
        OpSite.parse("h:output")
    with pytest.raises(hs.SpecError, match="count from 0"):
        OpSite("h", -1, "add", 0)


def test_op_patterns_glob_names_and_indices() -> None:
    every = OpPattern.parse("h.*.attn:op[scaled_dot_product_attention]")
    assert (every.module, every.call, every.index) == ("h.*.attn", None, None)
    assert every.matches("scaled_dot_product_attention", 7)
    assert not every.matches("softmax", 0)
    adds = OpPattern.parse("layer1.0#1:op[add*]")
    assert adds.call == 1
    assert adds.matches_call(1)
    assert not adds.matches_call(0)
    assert [adds.matches(op, 0) for op in ("add", "add_", "addmm", "mul")] == [True, True, True, False]
    first = OpPattern.parse("h.0.attn:op[softmax#0]")
    assert (first.matches("softmax", 0), first.matches("softmax", 1)) == (True, False)
    assert OpPattern.parse("h.0.attn:op[softmax#*]").matches("softmax", 12)
    regex = OpPattern.parse(r"re:h\.[0-9]+\.attn:op[softmax]")
    assert regex.module == r"re:h\.[0-9]+\.attn"
    for text in ("h.*.attn:op[add*]", r"fc\#1#2:op[mul#3]", r"re:h\.[0-9]:op[softmax#*]"):
        assert str(OpPattern.parse(text)) == text
    assert op_pattern("h.0.attn") is None
    assert op_pattern(nn.Linear) is None
    with pytest.raises(hs.SpecError, match="op selector name 'soft max'"):
        op_pattern("h:op[soft max]")
    with pytest.raises(hs.SpecError, match="is not of the form"):
        op_pattern("h:op[softmax")
