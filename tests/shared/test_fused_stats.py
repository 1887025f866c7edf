"""The fused statistics kernel: one read per tensor, against numpy float64, alone and with torch's OpenMP team."""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from hookscope._shared.stats import kernel as fused
from hookscope._shared.stats import raw_stats, read_stats

pytestmark = pytest.mark.skipif(not fused.available(), reason="the fused statistics kernel is not built here")

SUB = fused.BLOCK_VALUES  # values per float32 partial sum in the kernel (read from the library)
SEGMENT = fused.SEGMENT_VALUES  # values per segment (the unit torch's OpenMP team shares)


def reference(values: torch.Tensor) -> tuple[float, float, float, float, float, float]:
    """min, max, zeros, mean, root mean square deviation, mean |x| in numpy float64."""
    x = values.detach().to(torch.float64).numpy().reshape(-1)
    return (
        x.min(),
        x.max(),
        float((x == 0).sum()),
        x.mean(),
        float(np.sqrt(((x - x.mean()) ** 2).mean())),
        np.abs(x).mean(),
    )


def assert_part_matches(values: torch.Tensor, rel: float = 1e-6) -> None:
    part = fused.measure(values)
    assert part is not None
    low, high, zeros, mean, spread, abs_mean = reference(values)
    assert (part.low, part.high, part.zeros) == (low, high, zeros)  # exact
    scale = max(spread, abs(mean), 1e-30)
    assert abs(part.mean - mean) <= rel * scale
    assert part.spread == pytest.approx(spread, rel=rel, abs=1e-30)
    assert part.abs_mean == pytest.approx(abs_mean, rel=rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("count", [1, 7, SUB - 1, SUB, SUB + 1, SEGMENT - 1, SEGMENT + 9, 3 * SEGMENT + 1000])
def test_every_length_and_dtype_matches_float64(count: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(count)
    values = (torch.randn(count, generator=generator) * 3 + 1).to(dtype)
    values[::5] = 0.0  # zeros counted exactly
    assert_part_matches(values)


def test_post_relu_activations_and_negative_zero() -> None:
    values = torch.randn(4, 64, 56, 56, generator=torch.Generator().manual_seed(0)).relu()
    values.view(-1)[:10] = -0.0
    assert_part_matches(values)


def test_a_mean_far_above_its_spread_is_summed_again_around_it() -> None:
    # the first value (the shift) is far from the rest: a second pass around the mean keeps the digits
    values = torch.full((100_000,), 3000.0) + torch.randn(100_000, generator=torch.Generator().manual_seed(1)) * 1e-3
    values[0] = -5.0e4
    assert_part_matches(values, rel=1e-5)


def test_non_contiguous_values_give_the_same_result() -> None:
    values = torch.randn(300, 700, generator=torch.Generator().manual_seed(2))
    assert fused.measure(values.t()) == fused.measure(values.t().contiguous())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_left_to_the_exact_count(bad: float) -> None:
    values = torch.randn(SEGMENT * 2)
    values[SEGMENT + 3] = bad
    assert fused.measure(values) is None  # the caller counts them exactly
    stats = read_stats([raw_stats(values)])[0]
    assert (stats.nan, stats.posinf, stats.neginf) == (
        int(np.isnan(bad)),
        int(bad == float("inf")),
        int(bad == -float("inf")),
    )


def test_sums_that_overflow_float32_fall_back() -> None:
    values = torch.full((1000,), 3.0e38)
    values[0] = 0.0
    assert fused.measure(values) is None
    assert read_stats([raw_stats(values)])[0].mean == pytest.approx(3.0e38 * 999 / 1000, rel=1e-6)


def test_unread_dtypes_are_left_to_torch() -> None:
    for values in (torch.ones(10, dtype=torch.float16), torch.arange(10), torch.ones(3, dtype=torch.bool)):
        assert fused.measure(values) is None


def reading_with(team: int) -> None:
    """Set how the kernel reads a long tensor: torch's OpenMP team of ``team`` threads for any tensor
    of more than one segment, or (0) the calling thread alone; kept until ``fused._threads = -1``."""
    assert fused._use_team is not None
    fused._use_team(team, SEGMENT + 1)
    fused._team_choice(1)  # always the team, not the faster way
    fused._threads = torch.get_num_threads()  # keep this choice until reset


@pytest.fixture
def restore_reading() -> Iterator[None]:
    yield
    fused._team_choice(0)
    fused._threads = -1  # the next measure sets the library up for torch's threads again


def test_the_layout_constants_come_from_the_library() -> None:
    assert ctypes.c_int32.in_dll(fused._library, "hookscope_abi_version").value == fused.ABI_VERSION == 3
    assert SUB % 16 == 0
    assert SEGMENT % SUB == 0
    assert fused.TEAM_MIN_VALUES >= SEGMENT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_no_values_are_refused_in_c(dtype: torch.dtype) -> None:
    out = (ctypes.c_double * 8)()
    values = torch.ones(4, dtype=dtype)
    for kernels in (fused._KERNELS, fused._FINITE):
        for count in (0, -1):
            assert kernels[dtype](values.data_ptr(), count, 0.0, ctypes.addressof(out)) == -1
            assert (out[0], out[1], out[2], out[5], out[7]) == (math.inf, -math.inf, 0.0, 0.0, 0.0)


@pytest.mark.usefixtures("restore_reading")
def test_alone_and_with_torchs_team_give_the_same_bits() -> None:
    values = torch.randn(5 * SEGMENT + 123, generator=torch.Generator().manual_seed(3))
    results = []
    for team in (0, 2, 0, 2):
        reading_with(team)
        results.append(fused.measure(values))
    assert results[0] is not None
    assert all(result == results[0] for result in results)


@pytest.mark.usefixtures("restore_reading")
def test_the_faster_way_chosen_as_it_reads_tries_both_and_gives_the_same_bits() -> None:
    """Long tensors go alone or to the team by their timings, and about one in 16 the other way:
    over many reads, statistics and finiteness reads each go both ways, every read with the bits
    of a read alone."""
    values = torch.randn(5 * SEGMENT + 123, generator=torch.Generator().manual_seed(4))
    reading_with(0)
    alone = fused.measure(values)
    finite_alone = fused.all_finite(values)
    reading_with(2)
    if not fused._use_team(2, SEGMENT + 1):
        pytest.skip("torch runs without a GNU OpenMP team here: every tensor is read alone")
    fused._team_choice(0)  # the faster way, timed as it reads
    before = {(kind, shared): fused._long_reads(kind, shared) for kind in (0, 1) for shared in (0, 1)}
    for _ in range(200):  # statistics and finiteness alternating, as a trace beside detect_nonfinite reads
        assert fused.measure(values) == alone
        assert fused.all_finite(values) == finite_alone
    made = {key: fused._long_reads(*key) - count for key, count in before.items()}
    assert all(count > 0 for count in made.values()), made
    assert sum(made.values()) == 400


@pytest.mark.usefixtures("restore_reading")
@pytest.mark.parametrize("team", [0, 2])
def test_python_threads_reading_at_once(team: int) -> None:
    reading_with(team)
    tensors = [torch.randn(3 * SEGMENT + i, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    expected = [fused.measure(t) for t in tensors]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert list(pool.map(fused.measure, tensors)) == expected


def _child_measures(values: torch.Tensor, queue: multiprocessing.Queue[object]) -> None:
    queue.put(fused.measure(values))


@pytest.mark.usefixtures("restore_reading")
@pytest.mark.parametrize("team", [0, 2])
def test_a_forked_child_measures_without_the_parents_threads(team: int) -> None:
    values = torch.randn(4 * SEGMENT, generator=torch.Generator().manual_seed(4))
    reading_with(team)
    expected = fused.measure(values)  # torch's team is running now
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[object] = context.Queue()
    child = context.Process(target=_child_measures, args=(values, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got == expected


def test_the_kernel_can_be_turned_off_by_environment() -> None:
    code = (
        "import torch; from hookscope._shared.stats import kernel as fused, tensor_stats; "
        "print(fused.available(), fused.measure(torch.ones(4)), tensor_stats(torch.arange(4.0)).mean)"
    )
    env = dict(os.environ, HOOKSCOPE_FUSED_STATS="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None", "1.5"]


def test_use_fused_switches_paths_that_agree() -> None:
    values = torch.randn(3, 1000, 1000, generator=torch.Generator().manual_seed(5))
    with_kernel = read_stats([raw_stats(values)])[0]
    previous = fused.use_fused(False)
    try:
        assert fused.measure(values) is None
        with_torch = read_stats([raw_stats(values)])[0]
    finally:
        fused.use_fused(previous)
    for field in ("min", "max", "count", "zero_frac", "nan"):
        assert getattr(with_kernel, field) == getattr(with_torch, field)
    wide = values.double()
    exact = {"mean": wide.mean().item(), "std": wide.std().item(), "abs_mean": wide.abs().mean().item()}
    for field, value in exact.items():
        # float32 lanes widened every BLOCK_VALUES values: closer to float64 than torch's float32 sums
        assert getattr(with_kernel, field) == pytest.approx(value, rel=1e-8, abs=1e-8)
        assert getattr(with_torch, field) == pytest.approx(value, rel=1e-5, abs=1e-8)


def test_values_that_are_not_plain_memory_are_left_to_torch() -> None:
    negated = torch.tensor([1 + 2j, 3 - 4j]).conj().imag  # a lazily negated view: -2.0, 4.0
    assert negated.is_neg()
    assert fused.measure(negated) is None
    stats = read_stats([raw_stats(negated)])[0]
    assert (stats.min, stats.max, stats.mean) == (-2.0, 4.0, 1.0)
    zeros = torch._efficientzerotensor(1000)  # no memory behind it
    assert fused.measure(zeros) is None
    assert read_stats([raw_stats(zeros)])[0].zero_frac == 1.0


def test_a_tensor_subclass_is_left_to_torch() -> None:
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    pair = two_tensor.TwoTensor(torch.arange(4.0), torch.arange(4.0) * 2)
    assert fused.measure(pair) is None
    assert read_stats([raw_stats(pair)])[0].max == 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [255, 256, SUB - 1, SUB, 300_000])
def test_tiny_values_keep_their_spread(count: int, dtype: torch.dtype) -> None:
    # vanishing gradients: squares of values below ~1e-19 underflow float32
    values = (torch.randn(count, generator=torch.Generator().manual_seed(count)) * 1e-25).to(dtype)
    assert_part_matches(values, rel=1e-5)
    previous = fused.use_fused(False)
    try:
        chunked = read_stats([raw_stats(values)])[0]
    finally:
        fused.use_fused(previous)
    assert chunked.std == pytest.approx(values.double().std().item(), rel=1e-5)


@pytest.mark.usefixtures("restore_reading")
def test_flushed_subnormals_read_the_same_by_every_thread() -> None:
    values = torch.full((8 * SEGMENT,), 1e-40)  # subnormal
    reading_with(0)
    try:
        torch.set_flush_denormal(True)
        alone = fused.measure(values)
        reading_with(2)
        shared = [fused.measure(values) for _ in range(5)]
    finally:
        torch.set_flush_denormal(False)
    assert alone is not None
    assert all(part == alone for part in shared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 17, SEGMENT + 5, 3 * SEGMENT - 1])
def test_all_finite_reads_the_exponent_bits(where: int, bad: float | None, dtype: torch.dtype) -> None:
    values = torch.randn(3 * SEGMENT, generator=torch.Generator().manual_seed(6)).to(dtype) * 1e30
    values[7] = torch.finfo(dtype).max  # finite, however large; their sum would overflow
    if bad is not None:
        values[where] = bad
    assert fused.all_finite(values) is (bad is None)
    assert fused.all_finite(values[where:]) is (bad is None)  # an offset view, and a short tail


def test_all_finite_leaves_other_tensors_to_torch() -> None:
    assert fused.all_finite(torch.ones(4, dtype=torch.float16)) is None
    assert fused.all_finite(torch.tensor([1 + 2j]).conj().imag) is None
