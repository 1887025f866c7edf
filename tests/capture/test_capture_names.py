"""The names a capture answers to: a module picked whole and by a leaf keeps both, and a held
value answers to each of its names (module name, canonical name). References are raw hooks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.models import gpt2_input, tiny_gpt2

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def raw_io(model: nn.Module, name: str, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The first input and the (first) output of module ``name``, by plain PyTorch hooks."""
    module = dict(model.named_modules())[name]
    seen: dict[str, torch.Tensor] = {}

    def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
        seen["input"] = inputs[0].detach().clone()
        seen["output"] = (output[0] if isinstance(output, tuple) else output).detach().clone()  # type: ignore[index]

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(*args)
    finally:
        handle.remove()
    return seen["input"], seen["output"]


# -- a module selector and a leaf selector of the same module: the union -------------------------


def test_a_module_and_its_input_leaf_are_both_kept() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    x = torch.randn(2, 3)
    want_in, want_out = raw_io(model, "0", x)
    for selectors in (("0", "0:input[0]"), ("0:input[0]", "0"), (["0", "0:input[0]"],)):
        with torch.no_grad(), hs.capture(model, *selectors) as cap:
            model(x)
        assert torch.equal(cap.cache["0:input[0]"], want_in), selectors
        assert torch.equal(cap.cache["0"], want_out), selectors
    with torch.no_grad(), hs.capture(model, "0", "0:output", keep="input") as cap:  # keep= applies to the whole
        model(x)
    assert torch.equal(cap.cache["0:input[0]"], want_in)
    assert torch.equal(cap.cache["0:output"], want_out)


@pytest.mark.parametrize("keep", ["output", "input", "both"])
def test_a_leaf_that_names_nothing_is_an_error_beside_its_whole_module(keep: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    x = torch.randn(2, 3)
    _, out = raw_io(model, "0", x)
    assert isinstance(model[0](x), torch.Tensor)  # a tensor: no "output[0]" in it
    assert out.shape == (2, 4)
    for selectors in (["0", "0:output[0]"], ["0:output[0]", "0"], ["*", "0:output[0]"]):
        missing = pytest.raises(hs.CaptureError, match=r"'0' output has no tensor at 'output\[0\]'")
        with missing, torch.no_grad(), hs.capture(model, selectors, keep=keep):
            model(x)
        assert hs.attached(model) == []


@pytest.mark.transformers
def test_canonical_blocks_and_one_block_s_names_keep_resid_pre() -> None:
    model, ids = tiny_gpt2(), gpt2_input()
    want_in, want_out = raw_io(model, "h.0", ids)
    with torch.no_grad(), hs.capture(model, "h.0", "h.0:input[0]") as cap:
        model(ids)
    assert torch.equal(cap.cache["h.0:input[0]"], want_in)
    assert torch.equal(cap.cache["h.0"], want_out)
    with torch.no_grad(), hs.capture(model, "std:blocks.*", "std:blocks.0.*") as cap:
        model(ids)
    assert torch.equal(cap.cache["std:blocks.0.resid_pre"], want_in)
    assert torch.equal(cap.cache["std:blocks.0"], want_out)


@pytest.mark.transformers
def test_extract_keeps_a_module_and_its_input_leaf(tmp_path: Path) -> None:
    model, ids = tiny_gpt2(), gpt2_input()
    want_in, want_out = raw_io(model, "h.0", ids)
    store = hs.extract(model, ids, tmp_path / "store", layers=["h.0", "h.0:input[0]"])
    assert torch.equal(torch.as_tensor(store["h.0#0:input[0]"][:]), want_in)
    assert torch.equal(torch.as_tensor(store["h.0#0:output"][:]), want_out)


# -- a reduction that does not fit is named as written -------------------------------------------


def test_a_reduction_that_does_not_fit_is_named_as_written(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(hs.SpecError, match=r"reduce='mean:3' failed on '0#0:output', a \(2, 4\)"):
        hs.run_with_capture(model, torch.ones(2, 3), layers="0", reduce="mean:3")
    with pytest.raises(hs.SpecError, match=r"reduce='mean:3' failed") as raised:
        hs.extract(model, torch.ones(2, 3), tmp_path / "store", layers="0", reduce="mean:3")
    assert "function" not in str(raised.value)
    assert "0x" not in str(raised.value)


# -- one value answers to every name it has --------------------------------------------------------


@pytest.mark.transformers
def test_a_value_captured_by_module_name_answers_to_its_canonical_name() -> None:
    model, ids = tiny_gpt2(), gpt2_input()
    _, want = raw_io(model, "h.1", ids)
    _, cache = hs.run_with_capture(model, ids, layers="h.1")  # no "std:" selector, no map made before
    assert torch.equal(cache["std:blocks.1.resid_post"], want)
    assert torch.equal(cache["std:blocks.1"], want)
    assert "std:blocks.1.resid_post" in cache
    assert "std:blocks.0.resid_post" not in cache
    with pytest.raises(hs.SiteNotFoundError, match=r"'std:blocks\.0\.resid_post' is 'h\.0:output'.*'h\.1'"):
        cache["std:blocks.0.resid_post"]
    with pytest.raises(hs.SiteNotFoundError, match="has 2 blocks"):
        cache["std:blocks.5.resid_post"]
    _, every = hs.run_with_capture(model, ids, layers="h.*")
    values, labels = every.stack("std:blocks.*.resid_post")
    assert labels == ["blocks.0.resid_post", "blocks.1.resid_post"]
    assert torch.equal(values[1], want)


@pytest.mark.transformers
def test_stack_of_canonical_names_takes_values_held_under_module_names_too() -> None:
    model, ids = tiny_gpt2(), gpt2_input()
    _, want0 = raw_io(model, "h.0", ids)
    _, want1 = raw_io(model, "h.1", ids)
    _, cache = hs.run_with_capture(model, ids, layers=["std:blocks.0.resid_post", "h.1"])
    values, labels = cache.stack("std:blocks.*.resid_post")
    assert labels == ["blocks.0.resid_post", "blocks.1.resid_post"]
    assert torch.equal(values[0], want0)
    assert torch.equal(values[1], want1)


@pytest.mark.transformers
def test_a_trace_answers_to_canonical_names() -> None:
    model, ids = tiny_gpt2(), gpt2_input()
    trace = hs.trace(model, ids)
    assert trace["std:blocks.1.resid_post"].name == "h.1"
    assert trace["std:blocks.0.mlp"].name == "h.0.mlp"


@pytest.mark.transformers
def test_a_canonical_name_read_while_hooks_are_attached_says_how_to_make_the_map() -> None:
    model, ids = tiny_gpt2(), gpt2_input()
    with torch.no_grad(), hs.capture(model, "h.1") as cap:
        model(ids)
        with pytest.raises(hs.SiteNotFoundError, match=r"hs\.std_map\(model\)"):
            cap.cache["std:blocks.1.resid_post"]
        assert len(cap.cache) == 1  # no forward ran through the capture
    hs.std_map(model)  # made before: read inside the capture too
    with torch.no_grad(), hs.capture(model, "h.1") as cap:
        model(ids)
        assert torch.equal(cap.cache["std:blocks.1.resid_post"], cap.cache["h.1"])


def test_a_model_without_a_canonical_map_says_why() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    _, cache = hs.run_with_capture(model, torch.ones(1, 2), layers="0")
    with pytest.raises(hs.SiteNotFoundError, match="no canonical map"):
        cache["std:blocks.0.resid_post"]
    assert "std:blocks.0.resid_post" not in cache
