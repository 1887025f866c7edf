"""Where the first NaN/Inf appears: trace.first_nonfinite() and hs.detect_nonfinite()."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.errors import NonFiniteError
from hookscope.tensors import flatten_tensors
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
    found = hs.trace(model, x).first_nonfinite(allow="mask")
    assert found is not None
    assert found.from_input
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
    from tests.tracing.test_trace import CatchesChild

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


class Spoiler(nn.Module):
    """Writes a chosen number of NaN, +inf and -inf values into a copy of its input."""

    def __init__(self, nan: int = 0, posinf: int = 0, neginf: int = 0) -> None:
        super().__init__()
        self.counts = (nan, posinf, neginf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        flat, start = out.view(-1), 0
        for value, n in zip((math.nan, math.inf, -math.inf), self.counts, strict=True):
            flat[start : start + n] = value
            start += n
        return out


def spoiled_model(nan: int, posinf: int, neginf: int) -> nn.Module:
    return track(nn.Sequential(nn.Linear(8, 8), Spoiler(nan, posinf, neginf), nn.Linear(8, 8)))


def raw_counts(model: nn.Module, name: str, x: torch.Tensor) -> tuple[int, int, int, int]:
    """NaN, +inf, -inf and all values of ``name``'s output, counted in numpy from a plain forward hook."""
    seen: list[np.ndarray] = []
    handle = model.get_submodule(name).register_forward_hook(lambda m, a, o: seen.append(o.detach().numpy().copy()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    values = seen[0].astype(np.float64)
    return int(np.isnan(values).sum()), int((values == np.inf).sum()), int((values == -np.inf).sum()), values.size


@pytest.mark.parametrize("immediately", [False, True])
@pytest.mark.parametrize("counts", [(3, 0, 2), (0, 1, 1), (0, 0, 4), (1, 0, 0)])
def test_the_error_counts_each_kind_of_non_finite_value(counts: tuple[int, int, int], immediately: bool) -> None:
    model = spoiled_model(*counts)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    nan, posinf, neginf, total = raw_counts(model, "1", x)
    assert (nan, posinf, neginf) == counts  # the reference sees what the spoiler wrote
    with hs.detect_nonfinite(model, raise_immediately=immediately), pytest.raises(NonFiniteError) as raised:
        model(x)
    error = raised.value
    assert (error.module, error.what, error.nan, error.posinf, error.neginf) == ("1", "output", nan, posinf, neginf)
    kinds = [f"{n} {word}" for n, word in zip((nan, posinf, neginf), ("NaN", "+inf", "-inf"), strict=True) if n]
    assert f"made {' and '.join(kinds)} value{'s' if sum(counts) > 1 else ''} (of {total})" in str(error)
    if nan == 0:
        assert "NaN" not in str(error).split(":")[0]  # the kinds named first are those seen


def test_an_input_that_came_in_non_finite_is_counted_in_the_error() -> None:
    model = MLP6()
    x = example()
    x[0, 0, :3] = math.nan
    x[1, 0, 0] = -math.inf
    with hs.detect_nonfinite(model, allow="mask"), pytest.raises(NonFiniteError, match="came in with") as raised:
        model(x)
    error = raised.value
    assert (error.what, error.nan, error.posinf, error.neginf) == ("input", 3, 0, 1)
    assert f"3 NaN and 1 -inf values (of {x.numel()})" in str(error)


def test_first_nonfinite_prints_as_one_line_with_its_counts() -> None:
    model = spoiled_model(3, 0, 2)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    nan, posinf, neginf, total = raw_counts(model, "1", x)
    culprit = hs.trace(model, x).first_nonfinite()
    assert culprit is not None
    assert (culprit.what, culprit.path, culprit.nan, culprit.posinf, culprit.neginf) == (
        "output",
        "",
        nan,
        posinf,
        neginf,
    )
    assert not culprit.from_input
    for text in (str(culprit), repr(culprit)):
        assert "\n" not in text, text
        assert len(text) < 200, text
        assert "'1' (Spoiler, call 0)" in text
        assert f"output: {nan} NaN, {posinf} +inf, {neginf} -inf (of {total})" in text
        assert "inputs finite" in text
        assert "TensorInfo(" not in text
        assert "Stats(" not in text


def test_a_trace_row_prints_as_one_line() -> None:
    model = spoiled_model(0, 0, 0)
    row = hs.trace(model, torch.randn(10, 8))[1]
    for text in (str(row), repr(row)):
        assert "\n" not in text, text
        assert len(text) < 200, text
        assert "'0' (Linear, call 0)" in text
        assert "input[0] [10, 8] float32 -> output [10, 8] float32" in text
        assert "TensorInfo(" not in text
        assert "Stats(" not in text


def reference_first_bad(model: nn.Module, x: torch.Tensor, skip: str) -> tuple[str, bool]:
    """From plain forward hooks: the first call to return with a non-finite output (``skip`` aside),
    and whether its inputs were finite."""

    def finite(value: Any) -> bool:
        return all(bool(torch.isfinite(t).all()) for _, t in flatten_tensors(value) if t.is_floating_point())

    returned: list[tuple[str, bool, bool]] = []
    handles = [
        module.register_forward_hook(lambda m, a, o, name=name: returned.append((name, finite(a), finite(o))))
        for name, module in model.named_modules()
        if name != skip
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    name, inputs_ok, _ = next(call for call in returned if not call[2])
    return name, inputs_ok


def test_nan_from_the_model_input_is_told_apart_from_all_finite() -> None:
    model = MLP6()
    x = example()
    assert hs.trace(model, x).first_nonfinite(allow="mask") is None  # all finite: nothing to show
    x[0, 0, 0] = math.nan
    expected, inputs_ok = reference_first_bad(model, x, skip="mask")
    assert not inputs_ok  # the reference agrees: no module made it
    found = hs.trace(model, x).first_nonfinite(allow="mask")
    assert found is not None
    assert found.from_input
    assert (found.name, found.what, found.path, found.nan, found.posinf, found.neginf) == (
        expected,
        "input",
        "[0]",
        1,
        0,
        0,
    )
    assert "came in with its input" in str(found)


def test_the_table_says_when_the_nan_came_in_with_the_input() -> None:
    model = track(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    x = torch.randn(2, 4)
    x[1, 2] = math.nan
    text = hs.trace(model, x).table()
    assert "first NaN/Inf: no call made it; it came in with input[0] of 0#0" in text
    assert "made by" not in text
