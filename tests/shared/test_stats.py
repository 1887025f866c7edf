"""On-device statistics: exact against float64 references, both strategies, merging, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hookscope._shared.stats import (
    RawStats,
    RunningStats,
    Stats,
    is_measurable,
    merge_raw,
    raw_stats,
    read_stats,
    tensor_stats,
)
from hookscope._shared.stats import kernel as fused
from hookscope.errors import SpecError

# The CPU's fused one-pass kernel, the CPU's chunked torch reductions with shortcuts (where the kernel
# is not built, or for float16), and the unconditional accelerator path (run on the CPU here).
STRATEGIES = ["fused", "chunked", "device"]


def reference(tensor: torch.Tensor) -> dict[str, float]:
    x = tensor.detach().to(torch.float64).reshape(-1)
    return {
        "min": x.min().item(),
        "max": x.max().item(),
        "mean": x.mean().item(),
        "std": x.std().item() if x.numel() > 1 else 0.0,
        "abs_mean": x.abs().mean().item(),
        "zero_frac": (x == 0).double().mean().item(),
    }


def raw(tensor: torch.Tensor, strategy: str) -> RawStats:
    """``raw_stats`` by one strategy; ``fused`` is skipped where the kernel was not built."""
    if strategy == "fused" and not fused.available():
        pytest.skip("the fused statistics kernel is not built here")
    previous = fused.use_fused(strategy == "fused")
    try:
        return raw_stats(tensor, branching=strategy != "device")
    finally:
        fused.use_fused(previous)


def measured(tensor: torch.Tensor, strategy: str) -> Stats:
    return read_stats([raw(tensor, strategy)])[0]


def assert_matches(stats: Stats, tensor: torch.Tensor, rel: float = 1e-5) -> None:
    expected = reference(tensor)
    assert stats.count == tensor.numel()
    for field, value in expected.items():
        assert getattr(stats, field) == pytest.approx(value, rel=rel, abs=1e-6), field
    assert (stats.nan, stats.posinf, stats.neginf) == (0, 0, 0)


CASES = {
    "normal": lambda: torch.randn(64, 33, generator=torch.Generator().manual_seed(0)),
    "post_relu": lambda: torch.randn(4, 8, 5, 5, generator=torch.Generator().manual_seed(1)).relu(),
    "all_negative": lambda: -torch.rand(100, generator=torch.Generator().manual_seed(2)) - 0.5,
    "all_non_positive": lambda: -torch.rand(100, generator=torch.Generator().manual_seed(3)).relu(),
    "transposed": lambda: torch.randn(7, 5, generator=torch.Generator().manual_seed(4)).t(),
    "int64": lambda: torch.arange(-5, 17),
    "bool": lambda: torch.tensor([True, False, True, True]),
    "float64": lambda: torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(5)),
    "scalar": lambda: torch.tensor(3.5),
    "constant": lambda: torch.full((9,), -2.0),
}


@pytest.mark.parametrize("branching", STRATEGIES)
@pytest.mark.parametrize("case", list(CASES))
def test_statistics_match_a_float64_reference(case: str, branching: bool) -> None:
    tensor = CASES[case]()
    assert_matches(measured(tensor, branching), tensor)


@pytest.mark.parametrize("branching", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_values_around_300_keep_their_std(dtype: torch.dtype, branching: bool) -> None:
    values = (300 + torch.randn(100_000, generator=torch.Generator().manual_seed(0))).to(dtype)
    stats = measured(values, branching)
    exact = values.double()
    assert stats.std == pytest.approx(exact.std().item(), rel=1e-3)
    assert stats.mean == pytest.approx(exact.mean().item(), rel=1e-6)
    assert stats.finite
    assert math.isfinite(stats.std)


@pytest.mark.parametrize("branching", STRATEGIES)
def test_float32_with_a_mean_far_above_its_spread(branching: bool) -> None:
    values = 1e4 + 1e-2 * torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    stats = measured(values, branching)
    assert stats.std == pytest.approx(values.double().std().item(), rel=1e-3)


@pytest.mark.parametrize("branching", STRATEGIES)
def test_finite_values_whose_sum_overflows_float32_are_still_finite(branching: bool) -> None:
    values = torch.full((8,), 3e38)
    stats = measured(values, branching)
    assert stats.finite
    assert stats.mean == pytest.approx(3e38, rel=1e-6)
    assert stats.std == pytest.approx(0.0, abs=1e30)


@pytest.mark.parametrize("branching", STRATEGIES)
def test_nan_and_inf_are_counted_exactly(branching: bool) -> None:
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    values[[3, 10, 11]] = math.nan
    values[[5, 6]] = math.inf
    values[[7, 8, 9, 20]] = -math.inf
    values[[30, 31]] = 0.0
    stats = measured(values, branching)
    assert (stats.nan, stats.posinf, stats.neginf, stats.inf) == (3, 2, 4, 6)
    assert not stats.finite
    assert stats.zero_frac == pytest.approx(2 / 1000)


@pytest.mark.parametrize("branching", STRATEGIES)
def test_only_minus_inf_gives_minus_inf_extremes(branching: bool) -> None:
    values = torch.tensor([0.0, 1.0, -math.inf])
    stats = measured(values, branching)
    assert (stats.min, stats.max, stats.neginf, stats.nan) == (-math.inf, 1.0, 1, 0)


def test_empty_tensor_has_count_zero_and_nan_statistics() -> None:
    stats = tensor_stats(torch.empty(0, 3))
    assert stats.count == 0
    assert math.isnan(stats.mean)
    assert math.isnan(stats.min)
    assert stats.finite


def test_complex_and_meta_tensors_are_not_measurable() -> None:
    assert not is_measurable(torch.zeros(2, dtype=torch.complex64))
    assert not is_measurable(torch.empty(2, device="meta"))
    assert is_measurable(torch.zeros(2, dtype=torch.int8))
    with pytest.raises(SpecError, match="cannot summarise"):
        raw_stats(torch.empty(2, device="meta"))


def test_gradient_graphs_are_not_extended() -> None:
    weight = torch.randn(3, requires_grad=True)
    raw = raw_stats(weight * 2)
    assert not raw.vector.requires_grad


def test_read_stats_keeps_the_order_of_mixed_dtypes() -> None:
    tensors = [
        torch.arange(4.0),
        torch.arange(3, dtype=torch.int32),
        torch.ones(2, dtype=torch.float16),
        torch.zeros(5),
    ]
    means = [s.mean for s in read_stats([raw_stats(t) for t in tensors])]
    assert means == [1.5, 1.0, 1.0, 0.0]
    assert read_stats([]) == []


@pytest.mark.parametrize("branching", STRATEGIES)
def test_running_statistics_merge_exactly(branching: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=generator) * (i + 1) + 10 * i for i, n in enumerate([1, 7, 100, 33, 2])]
    running = RunningStats()
    for batch in batches:
        running.add(raw(batch, branching))
    running.add(raw_stats(torch.empty(0)))  # an empty batch changes nothing
    whole = torch.cat(batches)
    stats = running.result()
    assert running.count == whole.numel()
    assert_matches(stats, whole, rel=1e-6)


def test_merging_nan_keeps_the_counts() -> None:
    merged = merge_raw(raw_stats(torch.tensor([1.0, math.nan])), raw_stats(torch.tensor([math.inf, 2.0])))
    stats = read_stats([merged])[0]
    assert (stats.count, stats.nan, stats.posinf) == (4, 1, 1)


def test_running_stats_without_values_says_so() -> None:
    with pytest.raises(SpecError, match="no values yet"):
        RunningStats().result()


def test_stats_dict_round_trip() -> None:
    stats = tensor_stats(torch.tensor([1.0, 2.0]))
    assert Stats(**stats.to_dict()) == stats


@settings(max_examples=60, deadline=None)
@given(
    arrays(
        np.float32,
        st.integers(1, 300),
        elements=st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False),
    ),
    st.booleans(),
)
def test_any_finite_array_matches_numpy(values: np.ndarray, branching: bool) -> None:
    tensor = torch.from_numpy(values)
    stats = measured(tensor, branching)
    exact = values.astype(np.float64)
    assert stats.min == exact.min()
    assert stats.max == exact.max()
    assert stats.mean == pytest.approx(exact.mean(), rel=1e-5, abs=1e-3)
    spread = exact.std(ddof=1) if exact.size > 1 else 0.0
    assert stats.std == pytest.approx(spread, rel=1e-4, abs=1e-3)
    assert stats.abs_mean == pytest.approx(np.abs(exact).mean(), rel=1e-5, abs=1e-3)
    assert stats.zero_frac == pytest.approx((exact == 0).mean())


@pytest.mark.parametrize("branching", STRATEGIES)
def test_large_tensors_are_reduced_in_chunks_that_merge_exactly(branching: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    step = 1 << 20  # a chunk holds 4 MiB of float32
    parts = [
        torch.rand(step, generator=generator) + 1.0,  # positive, no zeros
        torch.randn(step, generator=generator).relu(),  # non-negative, half zeros
        torch.randn(step, generator=generator) * 3 - 7,  # both signs
        -torch.rand(step // 3, generator=generator),  # non-positive, a short last chunk
    ]
    parts[2][::1000] = 0.0  # zeros inside a mixed chunk
    values = torch.cat(parts)
    stats = measured(values, branching)
    assert_matches(stats, values, rel=1e-6)
    assert stats.zero_frac == pytest.approx((values == 0).double().mean().item(), rel=1e-9)


def test_chunks_far_from_zero_keep_their_variance() -> None:
    values = 5e3 + 1e-3 * torch.randn(3 << 20, generator=torch.Generator().manual_seed(0))
    stats = tensor_stats(values)
    assert stats.std == pytest.approx(values.double().std().item(), rel=1e-3)


@pytest.mark.parametrize("branching", STRATEGIES)
def test_huge_values_of_both_signs_do_not_overflow_the_mean(branching: bool) -> None:
    values = torch.tensor([3e38, -3e38, 1.0, 2.0])
    stats = measured(values, branching)
    assert stats.mean == pytest.approx(0.75, abs=1e-15 * 3e38)  # float64 resolves ~1e23 at this scale
    assert stats.finite
    assert math.isfinite(stats.std)
    assert stats.abs_mean == pytest.approx(1.5e38, rel=1e-6)


@pytest.mark.parametrize("branching", STRATEGIES)
def test_a_constant_has_exactly_zero_spread(branching: bool) -> None:
    stats = measured(torch.full((3 << 20,), 0.1), branching)
    assert stats.std == 0.0
    assert stats.mean == pytest.approx(0.1)
    assert stats.abs_mean == pytest.approx(0.1)


def _exact_mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std in exact rational arithmetic: no sum can overflow."""
    from fractions import Fraction

    exact = [Fraction(v) for v in values]
    mean = sum(exact) / len(exact)
    variance = sum((v - mean) ** 2 for v in exact) / (len(exact) - 1)
    return float(mean), math.sqrt(float(variance / Fraction(1e300) ** 2)) * 1e300


@pytest.mark.parametrize("branching", STRATEGIES)
@pytest.mark.parametrize(
    "values", [[1e308, 1e308, 1e308], [1e308, 1.5e308, 1.7e308], [-1e308, 1e308, 1.7e308], [-1.7e308, 3.0, 1e-300]]
)
def test_float64_values_near_the_largest_give_their_mean_and_std(values: list[float], branching: bool) -> None:
    result = read_stats([raw(torch.tensor(values, dtype=torch.float64), branching)])[0]
    mean, std = _exact_mean_std(values)
    assert result.mean == pytest.approx(mean, rel=1e-12)
    assert result.std == pytest.approx(std, rel=1e-12)
    assert result.abs_mean == pytest.approx(float(sum(abs(v) / 3 for v in values)), rel=1e-12)


def test_merging_batches_of_huge_values_stays_finite() -> None:
    values = [1.7e308, 1.6e308, -1.7e308, 1.0e308, 1.2e308, -0.5e308]
    running = RunningStats()
    for batch in torch.tensor(values, dtype=torch.float64).split(2):
        running.update(batch)
    mean, std = _exact_mean_std(values)
    assert running.result().mean == pytest.approx(mean, rel=1e-12)
    assert running.result().std == pytest.approx(std, rel=1e-12)


@pytest.mark.parametrize("branching", STRATEGIES)
def test_int64_min_and_max_are_exact_past_2_to_the_53(branching: bool) -> None:
    values = [2**62 + 1, 2**62 + 3, -(2**63)]
    result = read_stats([raw(torch.tensor(values, dtype=torch.int64), branching)])[0]
    assert (result.min, result.max) == (-(2**63), 2**62 + 3)
    assert isinstance(result.max, int)
    running = RunningStats()
    running.update(torch.tensor(values[:2]))
    running.update(torch.tensor([2**62 + 5]))
    assert running.result().max == 2**62 + 5


@pytest.mark.parametrize("branching", STRATEGIES)
def test_scaling_huge_values_leaves_the_counts_alone(branching: bool) -> None:
    """Values scaled down to be summed are counted as they are: a tiny value is no zero, and a
    finite 1e308 beside an inf is not an inf."""
    tiny = read_stats([raw(torch.tensor([1e300, 1e-300, 3.0], dtype=torch.float64), branching)])[0]
    assert tiny.zero_frac == 0.0
    both = read_stats([raw(torch.tensor([math.inf, 1e308, 1.0], dtype=torch.float64), branching)])[0]
    assert (both.posinf, both.neginf) == (1, 0)


def test_a_merge_with_an_inf_has_a_nan_std_as_torch_does() -> None:
    merged = merge_raw(raw_stats(torch.tensor([math.inf, 1.0])), raw_stats(torch.tensor([2.0, 3.0])))
    reference = torch.tensor([math.inf, 1.0, 2.0, 3.0]).std()
    assert math.isnan(read_stats([merged])[0].std)
    assert math.isnan(float(reference))


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
def test_the_compiled_device_path_agrees_with_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    # the accelerator path as one compiled kernel per tensor (Triton on CUDA), run here on the CPU
    import hookscope._shared.stats.compiled as stats_module
    from hookscope._shared.stats.fields import _ALL
    from hookscope._shared.stats.torch_path import _unconditional_of

    monkeypatch.setattr(stats_module, "COMPILED_DEVICES", {"cpu"})
    generator = torch.Generator().manual_seed(7)
    cases = [
        torch.randn(1000, generator=generator) * 3 + 1,
        torch.randn(37, 11, generator=generator).relu().to(torch.bfloat16),  # upcast inside the kernel
        torch.randn(5000, dtype=torch.float64, generator=generator),
        torch.tensor([1.0, math.nan, math.inf, -math.inf, 0.0]),
        torch.arange(-5, 17),
    ]
    for values in cases:
        compiled = read_stats([raw_stats(values, branching=False)])[0]
        assert stats_module._compile_failed is None
        op_by_op = read_stats([RawStats(values.numel(), _unconditional_of(values.reshape(-1), _ALL))])[0]
        for field in ("count", "min", "max", "zero_frac", "nan", "posinf", "neginf"):
            assert getattr(compiled, field) == getattr(op_by_op, field) or math.isnan(getattr(op_by_op, field))
        for field in ("mean", "std", "abs_mean"):
            expected = getattr(op_by_op, field)
            assert getattr(compiled, field) == pytest.approx(expected, rel=1e-9, nan_ok=True)
    chosen = read_stats([raw_stats(cases[0], branching=False, fields=frozenset({"min"}))])[0]
    assert chosen.min == cases[0].min().item()
    assert math.isnan(chosen.mean)
    with torch.inference_mode():
        assert read_stats([raw_stats(torch.ones(300), branching=False)])[0].mean == 1.0
    # every dtype, one value, ids and masks, grad on and off, other fields: no recompile limit is
    # reached, so compiling stays on (one graph per floating dtype; the rest goes op by op)
    for _ in range(2):
        for values in (
            torch.randn(10, dtype=torch.float16, requires_grad=True),
            torch.tensor([2.5]),
            torch.tensor([True, False]),
            torch.randint(0, 9, (4, 4)),
            torch.randn(99).to(torch.bfloat16),
            torch.randn(7, dtype=torch.float64),
        ):
            for fields in (None, frozenset({"min"}), frozenset({"std", "zeros"})):
                got = read_stats([raw_stats(values, branching=False, fields=fields)])[0]
                exact = values.detach().double()
                assert got.count == values.numel()
                if fields is None or "min" in fields:
                    assert got.min == pytest.approx(exact.min().item())
    assert stats_module._compile_failed is None
