"""Statistics of the tensors torch has few kernels for, of expanded views, and of tiny float64 values.

References are numpy float64 (or Python's exact ``statistics``), never hookscope's own output;
every case runs the three strategies of ``test_stats``.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import hookscope as hs
from hookscope._shared.histogram import BLOCK, SAMPLE, raw_histogram, read_histograms
from hookscope._shared.stats import RunningStats, Stats, raw_stats, read_stats, unexpanded
from hookscope._shared.stats import kernel as fused

STRATEGIES = ["fused", "chunked", "device"]


def measured(tensor: torch.Tensor, strategy: str) -> Stats:
    if strategy == "fused" and not fused.available():
        pytest.skip("the fused statistics kernel is not built here")
    previous = fused.use_fused(strategy == "fused")
    try:
        return read_stats([raw_stats(tensor, branching=strategy != "device")])[0]
    finally:
        fused.use_fused(previous)


def assert_numpy_stats(stats: Stats, values: np.ndarray) -> None:
    """``stats`` against numpy float64 of the same values (``values`` as they are, any dtype)."""
    wide = values.astype(np.float64).reshape(-1)
    rel = 1e-6 if values.dtype == np.float32 else 1e-12  # float32 values are summed in float32 chunks
    assert stats.count == wide.size
    assert (stats.min, stats.max) == (values.min(), values.max())  # exact, also for integers past 2**53
    assert stats.mean == pytest.approx(wide.mean(), rel=rel, abs=1e-12)
    assert stats.std == pytest.approx(wide.std(ddof=1), rel=max(rel, 1e-9))
    assert stats.abs_mean == pytest.approx(np.abs(wide).mean(), rel=rel)
    assert stats.zero_frac == np.mean(wide == 0)
    assert (stats.nan, stats.posinf, stats.neginf) == (0, 0, 0)


# -- unsigned integers: uint16, uint32, uint64 (torch has no aminmax or count_nonzero for them) ---------

UNSIGNED = {
    torch.uint16: (np.uint16, [0, 7, 65535, 300, 0, 12]),
    torch.uint32: (np.uint32, [0, 2**32 - 1, 5, 2**31, 9, 0]),
    torch.uint64: (np.uint64, [0, 2**64 - 1, 2**63 + 5, 3, 2**53 + 1, 0]),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", list(UNSIGNED), ids=str)
def test_unsigned_tensors_are_measured_exactly(dtype: torch.dtype, strategy: str) -> None:
    kind, values = UNSIGNED[dtype]
    array = np.array(values, dtype=kind)
    tensor = torch.from_numpy(array)
    assert tensor.dtype == dtype
    stats = measured(tensor, strategy)
    assert isinstance(stats.min, int)
    assert isinstance(stats.max, int)
    assert_numpy_stats(stats, array)


def test_uint64_extremes_merge_exactly_over_batches() -> None:
    running = RunningStats()
    halves = [np.array([2**63 + 9, 4], dtype=np.uint64), np.array([2**64 - 2, 2**63], dtype=np.uint64)]
    for half in halves:
        running.update(torch.from_numpy(half))
    assert_numpy_stats(running.result(), np.concatenate(halves))


class _Unsigned(nn.Module):
    """Returns its input's magnitude as an unsigned integer tensor (a quantiser's codes)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.proj = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x).abs() * 1000).to(torch.int64).to(self.dtype)


@pytest.mark.parametrize("dtype", list(UNSIGNED), ids=str)
def test_trace_of_a_model_with_unsigned_outputs(dtype: torch.dtype) -> None:
    model = _Unsigned(dtype).eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    seen: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda module, args, output: seen.append(output.to(torch.int64)))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    trace = hs.trace(model, x)
    row = next(row for row in trace if row.name == "")
    assert row.outputs[0].dtype == str(dtype).removeprefix("torch.")
    assert_numpy_stats(row.outputs[0].stats, seen[0].numpy())  # type: ignore[arg-type]


# -- expanded views: statistics of the tensor they repeat, without their logical size ----------------


def _largest_allocation(run: object) -> int:
    """The largest CPU allocation any op made while ``run()`` ran (torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()  # type: ignore[operator]
    return max((event.cpu_memory_usage for event in prof.events()), default=0)


EXPANDED = {
    "row": lambda: torch.tensor([[0.5, -2.0, 0.0, 3.0]]).expand(2**16, 4),
    "middle": lambda: torch.randn(3, 1, 5, generator=torch.Generator().manual_seed(1)).expand(3, 2**12, 5),
    "scalar": lambda: torch.tensor(0.0, dtype=torch.float64).expand(2**12, 8),
    "int": lambda: torch.tensor([[-7], [0], [9]]).expand(3, 2**14),
    "nan": lambda: torch.tensor([1.0, float("nan"), float("-inf"), 0.0]).expand(2**12, 4),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", list(EXPANDED))
def test_expanded_view_statistics_match_numpy(case: str, strategy: str) -> None:
    view = EXPANDED[case]()
    values = view.numpy()  # numpy reads the view through its strides: no copy either
    stats = measured(view, strategy)
    assert stats.count == view.numel()
    if case == "nan":
        wide = values.astype(np.float64)
        assert (stats.nan, stats.neginf, stats.posinf) == (int(np.isnan(wide).sum()), int(np.isneginf(wide).sum()), 0)
        assert stats.zero_frac == np.mean(wide == 0)
        return
    assert_numpy_stats(stats, np.ascontiguousarray(values))


def test_a_view_of_several_expanded_dimensions_counts_every_repeat() -> None:
    base = torch.randn(1, 3, 1, 2, generator=torch.Generator().manual_seed(2))
    view = base.expand(5, 3, 7, 2)
    cut, repeats = unexpanded(view)
    assert (tuple(cut.shape), repeats) == ((1, 3, 1, 2), 35)
    assert_numpy_stats(measured(view, "chunked"), view.contiguous().numpy())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_statistics_of_an_expanded_view_allocate_nothing_of_its_size(strategy: str) -> None:
    view = torch.tensor([1.0, -1.0, 0.25, 0.0]).expand(2**26, 4)  # 1 GiB logical, 16 bytes stored
    largest = _largest_allocation(lambda: measured(view, strategy))
    assert largest < 1 << 20, f"{largest} bytes allocated for a 16-byte view"


class _Broadcast(nn.Module):
    """Returns a bias broadcast over a long sequence (as position or attention-bias code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.tensor([0.5, -1.5, 2.0, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(x.shape[0], 2**24, 4)


def test_trace_with_histograms_of_an_expanded_output_stays_small() -> None:
    model = _Broadcast().eval()
    x = torch.zeros(4, 1)
    seen: list[torch.Tensor] = []
    model.register_forward_hook(lambda module, args, output: seen.append(output.detach()))

    def run() -> None:
        with torch.no_grad():
            trace = hs.trace(model, x, histograms=True)
        info = trace.rows[0].outputs[0]
        assert_numpy_stats(info.stats, np.ascontiguousarray(seen[0].numpy()))  # type: ignore[arg-type]
        assert info.histogram is not None
        assert info.histogram.total == seen[0].numel()

    largest = _largest_allocation(run)
    assert largest < 1 << 24, f"{largest} bytes allocated for a 16-byte view of 1 GiB"


def test_histogram_of_a_small_expanded_view_counts_every_value() -> None:
    view = torch.tensor([0.0, 1.0, 1.0, 3.0]).expand(100, 4)
    histogram = read_histograms([raw_histogram(view, bins=3)])[0]
    expected, _ = np.histogram(view.numpy(), bins=3, range=(0.0, 3.0))
    assert list(histogram.counts) == expected.tolist()
    assert histogram.total == 400


def _sampled_numpy_histogram(values: np.ndarray, bins: int) -> list[int]:
    """The counts of the values a histogram samples, by numpy: evenly spread runs of BLOCK values
    of the row-major flat array, SAMPLE values in all."""
    flat = values.reshape(-1)
    rows = flat.size // BLOCK
    picked = np.round(np.linspace(0, rows - 1, min(rows, SAMPLE // BLOCK))).astype(np.int64)
    sampled = flat[: rows * BLOCK].reshape(rows, BLOCK)[picked].reshape(-1)
    return np.histogram(sampled, bins=bins, range=(0.0, bins - 1.0))[0].tolist()


@pytest.mark.parametrize(
    ("base_shape", "expanded_shape"),
    [
        pytest.param((SAMPLE * 2,), (3, SAMPLE * 2), id="source-larger-than-the-sample"),
        pytest.param((SAMPLE // 2,), (3, SAMPLE // 2), id="source-between-sample-and-view"),
        pytest.param((64, 1, 40), (64, 30, 40), id="repeated-middle-dimension"),
    ],
)
def test_histogram_of_an_expanded_view_is_that_of_its_contiguous_copy(
    base_shape: tuple[int, ...], expanded_shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    bins = 8
    base = torch.randint(0, bins, base_shape).float()  # whole numbers: numpy's buckets and hookscope's agree
    view = base.expand(expanded_shape)
    copy = np.ascontiguousarray(view.numpy())
    expanded, contiguous = read_histograms(
        [raw_histogram(view, bins=bins), raw_histogram(view.contiguous(), bins=bins)]
    )
    assert expanded == contiguous
    assert expanded.total == copy.size
    assert expanded.counted == SAMPLE
    assert list(expanded.counts) == _sampled_numpy_histogram(copy, bins)


# -- float64 values whose squares underflow -------------------------------------------------------


TINY = {
    "1e-200": np.array([1e-200, 2e-200, 3e-200, -5e-201]),
    "1e-300 around a mean": np.array([1e-300 + k * 1e-304 for k in range(9)]),
    "subnormal": np.array([5e-324, 1e-323, 4e-322, 0.0, -2e-322]),
    "1e-170 mixed with zeros": np.array([0.0, 4e-170, -3e-170, 0.0, 1e-171]),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", list(TINY))
def test_std_of_tiny_float64_values(case: str, strategy: str) -> None:
    values = TINY[case]
    stats = measured(torch.from_numpy(values.copy()), strategy)
    # numpy's own std of these values underflows too: scaled by a power of two first, exactly
    scale = 2.0**1000
    expected = np.std(values * scale, ddof=1) / scale
    assert expected == pytest.approx(float(statistics.stdev(values.tolist())), rel=1e-12)  # the exact reference agrees
    assert stats.std > 0
    assert stats.std == pytest.approx(expected, rel=1e-9)
    assert stats.mean == pytest.approx(np.mean(values * scale) / scale, rel=1e-9, abs=1e-330)
    assert stats.abs_mean == pytest.approx(np.abs(values).mean(), rel=1e-9)
    assert stats.zero_frac == np.mean(values == 0)
    assert (stats.min, stats.max) == (values.min(), values.max())
