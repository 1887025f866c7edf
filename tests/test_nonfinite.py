"""Where the first NaN/Inf appears: trace.first_nonfinite() and hs.detect_nonfinite()."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.errors import NonFiniteError
from tests.models import RaisesMidForward, track


class Injector(nn.Module):
    """Turns one element into NaN when armed: a layer that 'makes' a NaN from finite inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        out = x.clone()
        out.view(-1)[0] = math.nan
        return out


class MaskBuilder(nn.Module):
    """Builds an additive causal mask: -inf above the diagonal, on purpose."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        return torch.full((n, n), -math.inf).triu(1)


class MaskedMix(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(x @ x.transpose(1, 2) + mask, dim=-1)
        return weights @ x


class MLP6(nn.Module):
    """A -inf mask, a masked mix, then six Linear layers each followed by an Injector."""

    def __init__(self) -> None:
        super().__init__()
        self.mask = MaskBuilder()
        self.mix = MaskedMix()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(6)])
        self.inject = nn.ModuleList([Injector() for _ in range(6)])
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mix(x, self.mask(x))
        for layer, inject in zip(self.layers, self.inject, strict=True):
            x = torch.relu(inject(layer(x)))
        return x


def example() -> torch.Tensor:
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("k", range(6))
def test_first_nonfinite_names_layer_k_only(k: int) -> None:
    model = MLP6()
    model.inject[k].armed = True
    trace = hs.trace(model, example())
    culprit = trace.first_nonfinite(allow="mask")
    assert culprit is not None
    assert culprit.site == f"inject.{k}#0"
    assert culprit.inputs[0].stats is not None
    assert culprit.inputs[0].stats.finite
    assert culprit.stats is not None
    assert culprit.stats.nan == 1
    later = [row for row in trace if row.name.startswith("layers.") and int(row.name.split(".")[1]) > k]
    assert all(row.output_finite is False for row in later)  # downstream is NaN too, but not blamed


@pytest.mark.parametrize("k", [0, 3, 5])
def test_detect_nonfinite_raises_at_layer_k(k: int) -> None:
    model = MLP6()
    model.inject[k].armed = True
    with hs.detect_nonfinite(model, allow=["mask"]), pytest.raises(NonFiniteError) as raised:
        model(example())
    error = raised.value
    assert (error.module, error.call, error.what, error.path) == (f"inject.{k}", 0, "output", "")
    assert f"'inject.{k}' (Injector, call 0)" in str(error)


def test_the_mask_builder_is_blamed_without_the_allow_list() -> None:
    model = MLP6()
    assert hs.trace(model, example()).first_nonfinite() is not None
    assert hs.trace(model, example()).first_nonfinite().name == "mask"  # type: ignore[union-attr]
    with hs.detect_nonfinite(model), pytest.raises(NonFiniteError, match="-inf first appears in output of 'mask'"):
        model(example())
    with hs.detect_nonfinite(model, allow="mask"):
        model(example())  # intended -inf only: nothing to report


def test_a_minus_inf_mask_passed_as_a_keyword_input_is_accepted() -> None:
    mix = track(MaskedMix())
    x = example()
    mask = torch.full((5, 5), -math.inf).triu(1)
    assert hs.trace(mix, x, mask=mask).first_nonfinite() is None
    with hs.detect_nonfinite(mix):
        mix(x, mask=mask)


def test_nan_in_the_model_input_is_not_blamed_on_a_layer() -> None:
    model = MLP6()
    x = example()
    x[0, 0, 0] = math.nan
    assert hs.trace(model, x).first_nonfinite(allow="mask") is None
    detector = hs.detect_nonfinite(model, allow="mask")
    with detector, pytest.raises(NonFiniteError, match="came in with the input") as raised:
        model(x)
    assert "input: input[0] of '(root)'" in str(raised.value)
    assert (raised.value.module, raised.value.what, raised.value.path) == ("", "input", "[0]")


def test_raise_immediately_stops_at_the_culprit() -> None:
    model = MLP6()
    model.inject[2].armed = True
    ran: list[str] = []
    hook = model.layers[3].register_forward_hook(lambda *_: ran.append("layers.3"))
    try:
        with hs.detect_nonfinite(model, allow="mask", raise_immediately=True), pytest.raises(NonFiniteError):
            model(example())
        assert ran == []
        with hs.detect_nonfinite(model, allow="mask"), pytest.raises(NonFiniteError):
            model(example())
        assert ran == ["layers.3"]  # by default the forward completes, then the check runs once
    finally:
        hook.remove()


def test_finite_values_whose_sum_overflows_are_not_reported() -> None:
    model = track(nn.Sequential(nn.Identity(), nn.Linear(2, 2)))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.zero_()
    with hs.detect_nonfinite(model):
        model(torch.full((4, 2), 3e38))


def test_half_precision_sums_do_not_overflow_into_false_alarms() -> None:
    model = track(nn.Sequential(nn.Identity()))
    with hs.detect_nonfinite(model):
        model(torch.full((10_000,), 60_000.0, dtype=torch.float16))


def test_a_forward_that_raises_keeps_its_own_error() -> None:
    model = RaisesMidForward()
    with hs.detect_nonfinite(model), pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4))


@pytest.mark.transformers
def test_gpt2_runs_clean_and_a_nan_weight_is_found() -> None:
    from tests.models import gpt2_input, tiny_gpt2

    model = tiny_gpt2()
    ids = gpt2_input()
    with hs.detect_nonfinite(model):
        model(input_ids=ids)
    with torch.no_grad():
        model.h[1].mlp.c_proj.weight[0, 0] = math.nan
    with hs.detect_nonfinite(model), pytest.raises(NonFiniteError) as raised:
        model(input_ids=ids)
    assert raised.value.module == "h.1.mlp.c_proj"
    culprit = hs.trace(model, input_ids=ids).first_nonfinite()
    assert culprit is not None
    assert culprit.name == "h.1.mlp.c_proj"


def test_selector_errors_surface_at_attach() -> None:
    with pytest.raises(hs.SelectionError, match="did you mean 'mask'"):
        hs.detect_nonfinite(MLP6(), allow="mask_")


def test_rows_of_a_detector_are_gone_after_the_block() -> None:
    model = MLP6()
    detector: Any = hs.detect_nonfinite(model, allow="mask")
    with detector:
        assert hs.attached(model)
    assert not detector.live
    assert not hs.attached(model)


def test_a_caught_exception_inside_the_forward_is_not_blamed() -> None:
    from tests.test_trace import CatchesChild

    model = CatchesChild()
    with hs.detect_nonfinite(model):
        out = model(torch.randn(2, 4))
    assert out.shape == (2, 4)


def test_float8_outputs_are_checked() -> None:
    class ToFloat8(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.float8_e4m3fn)

    model = track(nn.Sequential(ToFloat8()))
    with hs.detect_nonfinite(model):
        model(torch.randn(4, 4))
    with hs.detect_nonfinite(model), pytest.raises(NonFiniteError, match="came in with the input"):
        model(torch.tensor([1.0, math.nan]))
