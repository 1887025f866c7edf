"""store.loader(): shuffled training batches from a feature store, in bounded memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import hookscope as hs
from hookscope.errors import SpecError
from tests.models import tiny_gpt2, track

ROWS = 50


def make_store(path: Path, rows: int = ROWS, chunk_rows: int = 4, **options: Any) -> hs.Store:
    """Two sites of ``rows`` rows (chunks of ``chunk_rows``, the last one shorter)."""
    model = track(nn.Sequential(nn.Linear(4, 3), nn.Tanh()))
    data = torch.randn(rows, 4, generator=torch.Generator().manual_seed(0))
    return hs.extract(
        model, data, path, layers=["0", "1"], batch_size=2, chunk_rows=chunk_rows, progress=False, **options
    )


@pytest.fixture
def store(tmp_path: Path) -> hs.Store:
    return make_store(tmp_path / "f.zarr")


def rows_of(batches: Any) -> list[int]:
    return [row for batch in batches for row in batch["row"].tolist()]


def equal_batches(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    same = (x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=False))
    return len(a) == len(b) and all(same)


@pytest.mark.slow
def test_every_row_once_per_epoch_across_ranks_and_workers(store: hs.Store) -> None:
    values = {name: store[name][:] for name in store.sites}
    seen = []
    for rank in range(2):
        loader = store.loader(store.sites, 3, rank=rank, world_size=2, seed=3, buffer_chunks=2, with_rows=True)
        batches = list(DataLoader(loader, batch_size=None, num_workers=2))
        assert len(batches) == len(loader)
        for batch in batches:
            for name in store.sites:  # each item is its row's values, aligned across sites
                assert np.array_equal(batch[name].numpy(), values[name][batch["row"].numpy()])
        seen += rows_of(batches)
    assert sorted(seen) == list(range(ROWS))


def test_every_row_once_across_ranks_in_one_process(store: hs.Store) -> None:
    seen = []
    for rank in range(3):
        loader = store.loader("0", 4, rank=rank, world_size=3, with_rows=True, buffer_chunks=3)
        seen += rows_of(loader)
    assert sorted(seen) == list(range(ROWS))


def test_order_is_set_by_seed_and_epoch(store: hs.Store) -> None:
    def order(**options: Any) -> list[int]:
        return rows_of(store.loader("0", 5, with_rows=True, buffer_chunks=2, **options))

    first = order(seed=1)
    assert sorted(first) == list(range(ROWS))
    assert order(seed=1) == first
    assert order(seed=1, epoch=1) != first
    assert order(seed=2) != first
    loader = store.loader("0", 5, with_rows=True, buffer_chunks=2, seed=1)
    loader.set_epoch(1)
    assert rows_of(loader) == order(seed=1, epoch=1)
    assert order(shuffle=False) == list(range(ROWS))


@pytest.mark.slow
@pytest.mark.transformers
def test_token_rows_are_the_real_tokens_each_once(tmp_path: Path) -> None:
    model = tiny_gpt2()
    lengths = torch.tensor([10, 7, 3, 10, 1, 5, 2, 9, 8, 4, 6, 10])
    mask = (torch.arange(10) < lengths[:, None]).long()
    ids = torch.randint(1, 64, (12, 10), generator=torch.Generator().manual_seed(0)) * mask
    data = {"input_ids": ids, "attention_mask": mask}
    store = hs.extract(
        model, data, tmp_path / "f.zarr", layers=["h.0", "h.1"], batch_size=2, chunk_rows=4, reduce={"h.1": "mean:1"},
        progress=False,
    )  # fmt: skip
    assert store.attention_mask is not None
    site = store["h.0"].name
    assert store[site].shape == (12, 10, 32)
    real = store.attention_mask[:]
    expected = store[site][:].astype(np.float64)[real]  # (real tokens, 32)
    got, rows, positions = [], [], []
    for rank in range(2):
        loader = store.loader(site, 5, tokens=True, with_rows=True, rank=rank, world_size=2, buffer_chunks=2)
        batches = list(loader)
        assert len(batches) == len(loader)
        got += [batch[site] for batch in batches]
        rows += [batch["row"] for batch in batches]
        positions += [batch["position"] for batch in batches]
    values = torch.cat(got).double().numpy()
    assert values.shape == expected.shape == (int(lengths.sum()), 32)
    assert np.array_equal(values[np.lexsort(values.T[::-1])], expected[np.lexsort(expected.T[::-1])])
    row, position = torch.cat(rows).numpy(), torch.cat(positions).numpy()
    assert real[row, position].all()  # every item is a real token, traced to its row and position
    assert len(set(zip(row.tolist(), position.tolist(), strict=True))) == len(row)
    assert np.array_equal(values, store[site][:][row, position])
    padded = sum(len(b) for b in store.loader(site, 7, tokens=True, skip_padding=False))
    assert padded == 12 * 10
    with pytest.raises(SpecError, match=r"tokens=True.*no dimension 1"):
        store.loader(store["h.1"].name, 5, tokens=True)


def test_resume_mid_epoch_yields_the_tail(store: hs.Store) -> None:
    options: dict[str, Any] = {"seed": 4, "epoch": 2, "buffer_chunks": 2, "with_rows": True, "rank": 1, "world_size": 2}
    whole = list(store.loader(store.sites, 3, **options))
    for step in (0, 1, 3, 4, len(whole) - 1, len(whole)):
        resumed = store.loader(store.sites, 3, start_step=step, **options)
        assert len(resumed) == len(whole) - step
        assert equal_batches(list(resumed), whole[step:])


def test_resume_reads_only_the_windows_it_needs(store: hs.Store) -> None:
    loader = store.loader("0", 4, start_step=10, buffer_chunks=1, read_ahead=0)  # 13 chunks, a batch per chunk
    assert len(list(loader)) == 3
    assert loader.held_peak == 1


@pytest.mark.slow
def test_resume_with_two_workers_yields_the_tail(store: hs.Store) -> None:
    options: dict[str, Any] = {"seed": 5, "buffer_chunks": 2, "with_rows": True}
    whole = list(DataLoader(store.loader(store.sites, 3, **options), batch_size=None, num_workers=2))
    assert sorted(rows_of(whole)) == list(range(ROWS))
    for step in (1, 4, 7):
        resumed = DataLoader(store.loader(store.sites, 3, start_step=step, **options), batch_size=None, num_workers=2)
        assert equal_batches(list(resumed), whole[step:])


def test_set_epoch_keeps_a_resume_in_its_epoch_only(store: hs.Store) -> None:
    loader = store.loader("0", 5, epoch=3, start_step=2)
    loader.set_epoch(3)
    assert len(loader) == 8
    loader.set_epoch(4)
    assert len(loader) == 10


def test_dtype_device_and_stored_bfloat16(tmp_path: Path, store: hs.Store) -> None:
    batch = next(iter(store.loader(store.sites, 8, dtype=torch.float16, device="cpu", with_rows=True)))
    assert batch["0"].dtype == batch["1"].dtype == torch.float16
    assert batch["row"].dtype == torch.int64
    assert batch["0"].device.type == "cpu"
    halves = make_store(tmp_path / "b.zarr", dtype="bfloat16")
    loaded = torch.cat(list(halves.loader("0", 8, shuffle=False)))
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded, halves.torch("0"))


def test_batch_sizes_last_partial_and_drop_last(store: hs.Store) -> None:
    assert [len(b) for b in store.loader("0", 8)] == [8] * 6 + [2]
    assert [len(b) for b in store.loader("0", 8, drop_last=True)] == [8] * 6
    assert [len(b) for b in store.loader("0", 100)] == [50]
    per_rank = [[len(b) for b in store.loader("0", 4, drop_last=True, rank=r, world_size=3)] for r in range(3)]
    assert per_rank == [[4] * 4] * 3  # 16 of each rank's 16 rows: every rank takes the same steps
    # without drop_last ranks hold 16, 17 and 17 rows: their steps may differ by one
    assert [len(store.loader("0", 4, rank=r, world_size=3)) for r in range(3)] == [4, 5, 5]


def test_memory_is_bounded_by_the_window_and_the_read_ahead(store: hs.Store) -> None:
    loader = store.loader("0", 3, buffer_chunks=2, read_ahead=3)
    assert sum(len(b) for b in loader) == ROWS
    assert 2 <= loader.held_peak <= 2 + 3
    synchronous = store.loader("0", 3, buffer_chunks=4, read_ahead=0)
    assert sum(len(b) for b in synchronous) == ROWS
    assert synchronous.held_peak == 4


def test_a_partial_store_is_read_over_its_done_chunks(tmp_path: Path) -> None:
    model = track(nn.Linear(4, 3))
    rows = torch.randn(12, 4)

    def batches() -> Iterator[torch.Tensor]:
        yield rows[:4]
        yield rows[4:8]
        raise RuntimeError("the stream broke")

    with pytest.raises(RuntimeError, match="stream broke"):
        hs.extract(model, batches(), tmp_path / "f.zarr", layers="", progress=False, chunk_rows=4)
    partial = hs.open_store(tmp_path / "f.zarr", partial=True)
    loaded = list(partial.loader(partial.sites[0], 3, with_rows=True))
    assert sorted(rows_of(loaded)) == list(range(8))


@pytest.mark.parametrize(
    ("sites", "batch_size", "options", "message"),
    [
        ("nope", 4, {}, "no site 'nope'"),
        ([], 4, {}, "non-empty list"),
        (["0", "0"], 4, {}, "more than once"),
        ("0", 0, {}, "batch_size must be an int >= 1"),
        ("0", 2.5, {}, "batch_size must be an int"),
        ("0", 4, {"rank": 2, "world_size": 2}, "rank 2 is not below world_size 2"),
        ("0", 4, {"world_size": 0}, "world_size must be an int >= 1"),
        ("0", 4, {"buffer_chunks": 0}, "buffer_chunks must be"),
        ("0", 4, {"shufle": True}, "unknown option.*'shufle'"),
        ("0", 4, {"dtype": torch.int64}, "floating torch dtype"),
        ("0", 4, {"start_step": 99}, "past the end of epoch 0, which has 13"),
        ("0", 4, {"tokens": True}, "tokens=True"),
        ("0", 4, {"seed": -1}, "seed must be an int >= 0"),
    ],
)
def test_bad_arguments_say_what_and_how(
    store: hs.Store, sites: Any, batch_size: Any, options: Any, message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        store.loader(sites, batch_size, **options)
