"""The pieces of extraction on their own: masked reductions, chunk sizes, array names, the
configuration check, the model fingerprint, batches and random rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hookscope._core.sites import Site
from hookscope._extract.config import differences, fingerprint, model_identity
from hookscope._extract.data import TensorRows, make_source, split_batch
from hookscope._extract.reduce import describe_reduction, extraction_reduction
from hookscope._shared.bits import numpy_dtype
from hookscope._shared.reduce import reduce_value
from hookscope._store.layout import Layout, SiteLayout, array_names, choose_chunk_rows
from hookscope.cli.parse.data_specs import RandomRows
from hookscope.errors import DataError, SpecError


@pytest.fixture
def padded() -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([5, 2, 1])
    return values, torch.arange(5) < lengths[:, None]


@pytest.mark.parametrize("name", ["mean", "sum", "norm", "max", "min"])
def test_masked_reductions_equal_reducing_the_real_tokens(name: str, padded: tuple[torch.Tensor, torch.Tensor]) -> None:
    values, mask = padded
    reduce = extraction_reduction(f"{name}:1")
    assert reduce is not None
    got = reduce_value(reduce, values, mask)
    for row in range(3):
        real = values[row, : int(mask[row].sum())]
        expected = {
            "mean": real.mean(0),
            "sum": real.sum(0),
            "norm": real.norm(dim=0),
            "max": real.amax(0),
            "min": real.amin(0),
        }[name]
        assert torch.allclose(got[row], expected, atol=1e-6)


@pytest.mark.parametrize(("spec", "positions"), [("cls", [0, 0, 0]), ("last", [4, 1, 0]), ("first:1", [0, 0, 0])])
def test_masked_positions(spec: str, positions: list[int], padded: tuple[torch.Tensor, torch.Tensor]) -> None:
    values, mask = padded
    reduce = extraction_reduction(spec)
    assert reduce is not None
    assert torch.equal(reduce_value(reduce, values, mask), values[torch.arange(3), torch.tensor(positions)])
    left = mask.flip(1)  # left padding: the first real token is not position 0
    first = extraction_reduction("cls")
    assert first is not None
    assert torch.equal(reduce_value(first, values, left), values[torch.arange(3), torch.tensor([0, 3, 4])])


def test_a_value_that_is_not_the_masks_sequence_is_reduced_plainly() -> None:
    mask = torch.tensor([[True, False]])
    reduce = extraction_reduction("mean:1")
    assert reduce is not None
    conv = torch.randn(1, 3, 4, 4)
    assert torch.equal(reduce_value(reduce, conv, mask), conv.mean(1))
    half = torch.randn(1, 2, 3).half()
    assert (
        reduce_value(reduce, half, mask).dtype == torch.float32
    )  # accumulated in float32 like the capture's reductions
    assert describe_reduction("cls") == "first:1"
    assert describe_reduction(None) is None


def test_chunk_rows_are_whole_batches() -> None:
    assert choose_chunk_rows(32, 3072, 2048, None) == 1024  # the row cap
    assert choose_chunk_rows(32, 3072, 100, None) == 128  # never more than the data
    assert choose_chunk_rows(8, 2**20, None, None) == 8  # the byte cap, at least one batch
    assert choose_chunk_rows(8, 4, None, 24) == 24
    with pytest.raises(SpecError, match="not a multiple of the batch size 8: .* use e.g. 16"):
        choose_chunk_rows(8, 4, None, 20)


def test_layout_spans_and_dtypes() -> None:
    site = SiteLayout("fc", "fc#0:output", "fc", (10,), "bfloat16", None)
    layout = Layout((site,), rows=50, batch_size=8, chunk_rows=16)
    assert layout.chunks == 4
    assert layout.span(3) == (48, 50)
    assert list(layout.chunks_of(10, 40)) == [0, 1, 2]
    assert site.as_bits
    assert site.stored == np.uint16
    assert site.row_bytes == 20
    assert numpy_dtype(torch.int64) == np.int64
    assert numpy_dtype(torch.float8_e4m3fn) == np.uint8
    assert SiteLayout.from_json(site.to_json()) == site
    with pytest.raises(DataError, match=r"gave \(8, 11\) bfloat16 for rows 16..23") as info:
        site.check(torch.zeros(8, 11, dtype=torch.bfloat16), 8, 16)
    assert info.value.rows == range(16, 24)


def test_array_names_are_short_when_unambiguous() -> None:
    names = array_names([Site("fc"), Site("", 0, "output", ".last_hidden_state"), Site("a"), Site("a", 1)])
    assert list(names.values()) == ["fc", "#0:output.last_hidden_state", "a#0:output", "a#1:output"]
    with pytest.raises(SpecError, match="zarr names"):
        array_names([Site("__secret")])


def test_differences_name_each_changed_key() -> None:
    stored = {"model": {"class": "A", "fingerprint": "1"}, "dtype": None, "sites": {"fc": "x"}}
    wanted = {"model": {"class": "A", "fingerprint": "2"}, "dtype": "float16", "sites": {}}
    assert differences(stored, wanted) == [
        "dtype: stored None, now 'float16'",
        "model.fingerprint: stored '1', now '2'",
        "sites.fc: stored 'x', now absent",
    ]
    assert differences({"layers": ("a",)}, {"layers": ["a"]}) == []  # JSON keeps tuples as lists


def test_fingerprint_sees_weights_not_identity() -> None:
    torch.manual_seed(0)
    a = nn.Linear(5000, 3)
    torch.manual_seed(0)
    b = nn.Linear(5000, 3)
    assert fingerprint(a) == fingerprint(b)
    with torch.no_grad():
        b.weight[0, 0] += 1  # sampled: the first value is always one of those read
    assert fingerprint(a) != fingerprint(b)
    big = nn.Module()
    big.register_buffer("codes", torch.zeros(38_597_376, dtype=torch.uint8))  # float32 steps would round past its end
    assert len(fingerprint(big)) == 32
    meta = nn.Linear(3, 3, device="meta")
    assert model_identity(meta, None)["parameters"] == 12  # structure only, nothing read


def test_split_batch_and_tensor_rows() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    assert split_batch([x, torch.zeros(6)])[0][0] is x
    with pytest.raises(SpecError, match="inputs=lambda batch"):
        split_batch(3)
    rows = TensorRows(np.arange(12).reshape(6, 2))
    assert rows.__getitems__([4, 1]).tolist() == [[8, 9], [2, 3]]
    with pytest.raises(SpecError, match="different numbers of rows"):
        TensorRows({"a": torch.zeros(3), "b": torch.zeros(4)})
    source = make_source(x, batch_size=4, num_workers=None, indices=None, inputs=None)
    assert [b.rows for b in source.batches([(0, 6)])] == [4, 2]  # type: ignore[union-attr]


def test_random_rows_depend_only_on_their_index() -> None:
    rows = RandomRows(100, (4,), seed=3)
    assert torch.equal(rows.__getitems__([7, 8])[0], rows.__getitems__([1, 7])[1])
    assert not torch.equal(rows.__getitems__([7])[0], RandomRows(100, (4,), seed=4).__getitems__([7])[0])
    tokens = RandomRows(5, (6,), seed=0, key="input_ids", vocab_size=10).__getitems__([0, 1])["input_ids"]
    assert tokens.dtype == torch.int64
    assert int(tokens.max()) < 10


def test_resident_watch_trims_only_on_drift() -> None:
    from hookscope._shared.malloc import ResidentWatch, resident_bytes

    if resident_bytes() is None or not _has_malloc_trim():
        pytest.skip("needs /proc and glibc's malloc_trim")
    watch = ResidentWatch(margin=1.5, settle=2)
    assert [watch.check(), watch.check(), watch.check()] == [False, False, False]  # settled, no drift
    watch.baseline = 1  # as if resident memory had grown far past the level it settled at
    assert watch.check()
    assert watch.trims == 1
    assert not watch.check()  # what the trim could not give back is the new level: no trim every batch after


def _has_malloc_trim() -> bool:
    from hookscope._shared.malloc import release_free_memory

    return release_free_memory()


def test_every_dtype_numpy_lacks_round_trips_as_bits() -> None:
    from hookscope._shared.bits import NUMPY_LACKS, bits_to_tensor, tensor_to_numpy

    assert {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz} <= set(NUMPY_LACKS)
    for dtype in NUMPY_LACKS:
        if dtype.itemsize != 1 or "float4" in str(dtype):
            continue
        bits = torch.randint(0, 256, (4, 3), dtype=torch.uint8).view(dtype)
        assert numpy_dtype(dtype) == np.uint8
        assert torch.equal(bits_to_tensor(tensor_to_numpy(bits), dtype).view(torch.uint8), bits.view(torch.uint8))


def test_row_order_written_three_ways_is_the_same_order() -> None:
    from hookscope._extract.config import _order

    assert _order(None, 5) is None
    assert _order(range(5), 5) is None
    assert _order([0, 1, 2, 3, 4], 5) is None
    assert _order([4, 3], 5) is not None
    assert _order([4, 3], 5) != _order([3, 4], 5)
