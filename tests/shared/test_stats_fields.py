"""``stats=`` as a list: the statistics chosen match a float64 reference, the others read NaN and cost nothing."""

from __future__ import annotations

import math

import pytest
import torch

import hookscope as hs
from hookscope._shared.stats import kernel as fused
from hookscope._shared.stats import raw_stats, read_stats
from hookscope.errors import SpecError
from tests.cli.test_cli import run_cli
from tests.models import tiny_gpt2

STRATEGIES = ["fused", "chunked", "device"]
FIELDS = {"min": "min", "max": "max", "mean": "mean", "std": "std", "abs_mean": "abs_mean", "zeros": "zero_frac"}


def measured(values: torch.Tensor, strategy: str, fields: frozenset[str]) -> hs.Stats:
    if strategy == "fused" and not fused.available():
        pytest.skip("the fused statistics kernel is not built here")
    previous = fused.use_fused(strategy == "fused")
    try:
        return read_stats([raw_stats(values, branching=strategy != "device", fields=fields)])[0]
    finally:
        fused.use_fused(previous)


def reference(values: torch.Tensor) -> dict[str, float]:
    x = values.to(torch.float64).reshape(-1)
    return {
        "min": x.min().item(),
        "max": x.max().item(),
        "mean": x.mean().item(),
        "std": x.std().item(),
        "abs_mean": x.abs().mean().item(),
        "zero_frac": (x == 0).double().mean().item(),
    }


VALUES = {
    "mixed": lambda: torch.randn(70_000, generator=torch.Generator().manual_seed(0)).relu_() - 0.3,
    "post_relu": lambda: torch.randn(70_000, generator=torch.Generator().manual_seed(1)).relu_(),
    "float64": lambda: torch.randn(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("values", list(VALUES))
@pytest.mark.parametrize("chosen", [("min",), ("mean", "std"), ("abs_mean",), ("zeros",), ("max", "zeros", "std")])
def test_chosen_statistics_match_and_the_others_read_nan(chosen: tuple[str, ...], values: str, strategy: str) -> None:
    tensor = VALUES[values]()
    tensor[7] = 0.0
    stats = measured(tensor, strategy, frozenset(chosen))
    expected = reference(tensor)
    for choice, field in FIELDS.items():
        got = getattr(stats, field)
        if choice in chosen:
            assert got == pytest.approx(expected[field], rel=1e-5, abs=1e-7), field
        else:
            assert math.isnan(got), field
    assert (stats.count, stats.nan, stats.posinf, stats.neginf) == (tensor.numel(), 0, 0, 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nonfinite_counts_are_always_kept(strategy: str) -> None:
    tensor = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    tensor[[1, 2, 5]] = torch.tensor([math.nan, math.inf, -math.inf])
    stats = measured(tensor, strategy, frozenset({"nonfinite"}))
    assert (stats.nan, stats.posinf, stats.neginf) == (1, 1, 1)
    assert math.isnan(stats.min)
    assert math.isnan(stats.mean)


def aten_ops(fn: object) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()  # type: ignore[operator]
    return {event.name for event in profile.events()}


def test_statistics_not_chosen_are_not_computed() -> None:
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(4))
    everything = aten_ops(lambda: raw_stats(values, branching=False))
    only_extremes = aten_ops(lambda: raw_stats(values, branching=False, fields=frozenset({"min", "max"})))
    assert {"aten::linalg_vector_norm", "aten::sum"} <= everything
    assert "aten::aminmax" in only_extremes
    assert not {"aten::linalg_vector_norm", "aten::sum"} & only_extremes
    previous = fused.use_fused(False)
    try:  # the CPU's chunked path: no |x| pass and no sign pass without abs_mean and zeros
        chunked = aten_ops(lambda: raw_stats(values, fields=frozenset({"mean", "std"})))
    finally:
        fused.use_fused(previous)
    assert "aten::dot" in chunked
    assert not {"aten::abs", "aten::sign"} & chunked


@pytest.mark.parametrize("strategy", ["chunked", "device"])  # the kernel does not read integers
def test_integer_extremes_not_chosen_read_nan(strategy: str) -> None:
    stats = measured(torch.arange(10), strategy, frozenset({"min"}))
    assert stats.min == 0
    assert math.isnan(stats.max)


def test_an_unknown_statistic_is_refused_with_the_choices() -> None:
    with pytest.raises(SpecError, match="'median', not a statistic; expected some of min, max"):
        hs.TraceOptions(stats=["min", "median"])
    with pytest.raises(SpecError, match="chose no statistic"):
        hs.TraceOptions(stats=[])
    with pytest.raises(SpecError, match="expected True"):
        hs.TraceOptions(stats=3)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="unknown statistics"):
        raw_stats(torch.ones(3), fields=frozenset({"mode"}))


@pytest.mark.transformers
def test_a_gpt2_trace_keeps_the_chosen_statistics_equal_to_a_full_trace() -> None:
    model, ids = tiny_gpt2(), torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = hs.trace(model, ids)
        chosen = hs.trace(model, ids, stats=["min", "max", "zeros"])
    assert chosen.meta["stats"] == ["max", "min", "zeros"]
    assert len(full) == len(chosen)
    for whole, part in zip(full, chosen, strict=True):
        if whole.stats is None:
            assert part.stats is None
            continue
        assert part.stats is not None
        assert (part.stats.min, part.stats.max, part.stats.zero_frac) == (
            whole.stats.min,
            whole.stats.max,
            whole.stats.zero_frac,
        )
        assert all(math.isnan(value) for value in (part.stats.mean, part.stats.std, part.stats.abs_mean))
    header = chosen.table().splitlines()[0].split()
    assert header[-4:] == ["min", "max", "zeros", "nan/inf"]


def test_the_command_line_takes_a_list_of_statistics(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "trace", "demo:cnn", "--stats", "min,max", "-d", "1")
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert header.split()[-3:] == ["min", "max", "nan/inf"]
    code, out, err = run_cli(capsys, "trace", "demo:cnn", "--stats", "min,mode")
    assert code == 2
    assert "'mode', not a statistic" in out + err
