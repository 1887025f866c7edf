"""What a store keeps beside the values: each row's data index, tokens and padding mask; running
statistics per site; sparse latents. Checked on real models against numpy float64 and raw hooks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from tests.models import tiny_gpt2

pytest.importorskip("zarr")

VOCAB, SEQ, ROWS = 64, 10, 22


def run(model: nn.Module, data: Any, layers: Any, out: Path | str, **options: Any) -> hs.Store:
    return hs.extract(model, data, out, layers=layers, progress=False, **options)


def padded_tokens(rows: int = ROWS, seq: int = SEQ, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded token rows of real lengths 3..seq, as a tokenizer with padding=True gives them."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=generator)
    lengths = torch.randint(3, seq + 1, (rows,), generator=generator)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def in_batches(model: nn.Module, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """``model`` over ``rows`` in the extraction's batches: the same kernels, so the same bits."""
    return torch.cat([model(rows[start : start + batch]) for start in range(0, len(rows), batch)])


def assert_resumed_rows(stored: np.ndarray, expected: np.ndarray) -> None:
    """Rows of the golden store's first chunk (8 rows) were computed on another machine, whose
    kernels round otherwise: equal to float32 rounding; the rows written here, bit for bit."""
    np.testing.assert_allclose(stored[:8], expected[:8], rtol=1e-6, atol=1e-7)
    assert np.array_equal(stored[8:], expected[8:])


def raw_outputs(model: nn.Module, name: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """The module's first output for every row, by a raw forward hook."""
    kept: list[torch.Tensor] = []
    handle = model.get_submodule(name).register_forward_hook(
        lambda m, a, out: kept.append((out[0] if isinstance(out, tuple) else out).detach().clone())
    )
    try:
        with torch.no_grad():
            model(**data)
    finally:
        handle.remove()
    return kept[0]


class FailsAt(torch.utils.data.Dataset[torch.Tensor]):
    """``rows``, but row ``index`` cannot be read: a run stops there, its earlier chunks recorded."""

    def __init__(self, rows: torch.Tensor, index: int) -> None:
        self.rows, self.index = rows, index

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.index:
            raise RuntimeError("unreadable row")
        return self.rows[index]


# -- provenance --------------------------------------------------------------------------------------


@pytest.mark.transformers
def test_tokens_mask_and_data_index_round_trip_with_the_rows(tmp_path: Path) -> None:
    model, data = tiny_gpt2(), padded_tokens()
    picked = list(range(ROWS - 1, -1, -2)) + list(range(0, ROWS, 2))  # every row once, out of order
    store = run(model, data, "h.0", tmp_path / "f.zarr", batch_size=4, chunk_rows=8, indices=picked)
    assert store.row_index[:].tolist() == picked
    assert store.tokens is not None
    assert store.attention_mask is not None
    assert store.tokens.dtype == np.int64
    assert store.attention_mask.dtype == np.bool_
    assert np.array_equal(store.tokens[:], data["input_ids"][picked].numpy())
    assert np.array_equal(store.attention_mask[:], data["attention_mask"][picked].bool().numpy())
    # a latent's row goes back to its text: row i is data row row_index[i]
    reference = raw_outputs(model, "h.0", {k: v[picked] for k, v in data.items()}).numpy()
    assert np.array_equal(store["h.0"][:], reference)
    assert sorted(store.sites) == ["h.0"]  # the provenance arrays are not sites


def test_a_tensor_of_token_ids_is_kept_and_float_inputs_keep_only_the_index(tmp_path: Path) -> None:
    embed = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 4))
    ids = torch.randint(0, VOCAB, (12, 5), generator=torch.Generator().manual_seed(1))
    store = run(embed, ids, "1", tmp_path / "ids.zarr", batch_size=4)
    assert store.tokens is not None
    assert np.array_equal(store.tokens[:], ids.numpy())
    assert store.attention_mask is None
    dense = run(nn.Sequential(nn.Linear(4, 3)), torch.randn(12, 4), "0", tmp_path / "x.zarr", batch_size=4)
    assert dense.tokens is None
    assert dense.attention_mask is None
    assert dense.row_index[:].tolist() == list(range(12))
    off = run(embed, ids, "1", tmp_path / "off.zarr", batch_size=4, tokens=False)
    assert off.tokens is None
    with pytest.raises(hs.SpecError, match="tokens=True, but the first batch has no token ids"):
        run(nn.Sequential(nn.Linear(4, 3)), torch.randn(12, 4), "0", tmp_path / "y.zarr", tokens=True)


def test_a_stream_numbers_its_rows_and_shorter_batches_are_padded(tmp_path: Path) -> None:
    embed = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 4))
    widths = [6, 6, 4]
    batches = [
        {"input": torch.randint(1, VOCAB, (3, width), generator=torch.Generator().manual_seed(i))}
        for i, width in enumerate(widths)
    ]

    def inputs(batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        return (batch["input"],), {}

    # reduced over the tokens, batches padded each to its own length run as ever: no tokens kept
    auto = run(embed, [batches[2], batches[0]], "1", tmp_path / "a.zarr", reduce="mean:1", inputs=inputs)
    assert auto.tokens is None
    assert auto.row_index[:].tolist() == list(range(6))
    store = run(embed, batches, "1", tmp_path / "s.zarr", reduce="mean:1", inputs=inputs, tokens=True)
    assert store.row_index[:].tolist() == list(range(9))
    assert store.tokens is not None
    kept = store.tokens[:]
    assert np.array_equal(kept[:6], torch.cat([b["input"] for b in batches[:2]]).numpy())
    assert np.array_equal(kept[6:, :4], batches[2]["input"].numpy())
    assert (kept[6:, 4:] == -1).all()
    longer = [batches[2], batches[0]]  # the first batch sets the width: a longer one cannot fit
    with pytest.raises(hs.DataError, match=r"have 6 positions .* keeps 4, the first batch's: pad every batch"):
        run(embed, longer, "1", tmp_path / "l.zarr", reduce="mean:1", inputs=inputs, tokens=True)


# -- running statistics ------------------------------------------------------------------------------


def numpy_stats(vectors: np.ndarray) -> dict[str, Any]:
    exact = vectors.astype(np.float64)
    norms = np.linalg.norm(exact, axis=1)
    return {
        "count": len(exact),
        "mean": exact.mean(),
        "std": exact.std(),
        "min": exact.min(),
        "max": exact.max(),
        "norm_mean": norms.mean(),
        "norm_rms": np.sqrt(np.square(norms).mean()),
        "feature_mean": exact.mean(axis=0),
        "feature_std": exact.std(axis=0),
    }


def assert_stats(found: hs.SiteStats, vectors: np.ndarray) -> None:
    expected = numpy_stats(vectors)
    assert found.count == expected["count"]
    for key in ("mean", "std", "min", "max", "norm_mean", "norm_rms"):
        assert getattr(found, key) == pytest.approx(expected[key], rel=1e-12, abs=1e-15), key
    np.testing.assert_allclose(found.feature_mean, expected["feature_mean"], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(found.feature_std, expected["feature_std"], rtol=1e-10, atol=1e-15)


@pytest.mark.transformers
def test_running_statistics_equal_numpy_over_the_stored_tokens_without_padding(tmp_path: Path) -> None:
    model, data = tiny_gpt2(), padded_tokens()
    store = run(model, data, ["h.0", "h.1"], tmp_path / "f.zarr", batch_size=4, chunk_rows=8, reduce={"h.1": "last"})
    mask = store.attention_mask
    assert mask is not None
    tokens = store["h.0"][:][mask[:]]  # (real tokens, d): padding left out
    assert tokens.shape[0] == int(data["attention_mask"].sum()) < ROWS * SEQ
    assert_stats(store.stats["h.0"], tokens)
    assert_stats(store.stats["h.1"], store["h.1"][:])  # (N, d) rows: every row is a vector
    # the scalars are in the attributes, readable without hookscope (zarr.json)
    attributes = json.loads((tmp_path / "f.zarr" / "zarr.json").read_text())["attributes"]["hookscope"]
    assert attributes["stats"]["h.0"]["count"] == tokens.shape[0]
    assert attributes["stats"]["h.0"]["norm_rms"] == pytest.approx(store.stats["h.0"].norm_rms, rel=1e-15)


def test_statistics_of_bfloat16_values_are_those_of_the_stored_values(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 5))
    rows = torch.randn(40, 6, generator=torch.Generator().manual_seed(2))
    store = run(model, rows, "0", tmp_path / "b.zarr", dtype="bfloat16", batch_size=8, chunk_rows=16)
    stored = store["0"][:]  # bfloat16 read back exactly as float32
    assert_stats(store.stats["0"], stored)
    again = run(model, rows, "0", tmp_path / "b.zarr", dtype="bfloat16", batch_size=8, chunk_rows=16)
    assert again.stats["0"].to_json() == store.stats["0"].to_json()  # complete: read back, not computed again


def test_statistics_of_a_partial_store_cover_its_done_chunks(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    rows = torch.randn(32, 4, generator=torch.Generator().manual_seed(6))

    with pytest.raises(RuntimeError, match="unreadable row"):
        run(model, FailsAt(rows, 20), "0", tmp_path / "p.zarr", batch_size=4, chunk_rows=8)
    store = hs.open_store(tmp_path / "p.zarr", partial=True)
    done = sorted(store.done_chunks())
    assert done == [0, 1]
    assert_stats(store.stats["0"], store["0"][:16])


# -- sparse latents ----------------------------------------------------------------------------------


class SAE(nn.Module):
    def __init__(self, d: int = 32, latents: int = 96) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.enc, self.dec = nn.Linear(d, latents), nn.Linear(latents, d)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.enc(x))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.dec(z)


@pytest.mark.transformers
def test_sparse_latents_are_stored_compactly_and_read_back_dense_or_sparse(tmp_path: Path) -> None:
    model, sae, k = tiny_gpt2(), SAE(), 5
    data = padded_tokens(rows=8)
    store = run(model, data, "h.1", tmp_path / "z.zarr", reduce=hs.edits.splice(sae).topk(k), batch_size=4)
    array = store["h.1"]
    assert array.layout.sparse == {"k": k, "width": 96}
    assert array.shape == (8, SEQ, 2 * k)  # 2k floats a token, not 96
    with torch.no_grad():
        latents = sae.encode(raw_outputs(model, "h.1", data))
    values, indices = latents.topk(k, dim=-1)
    expected = torch.zeros_like(latents).scatter(-1, indices, values)
    assert torch.equal(array.dense(), expected)
    assert torch.equal(array.dense(slice(2, 5)), expected[2:5])
    coo = array.sparse(slice(0, 3))
    assert coo.is_sparse
    assert coo.shape == (3, SEQ, 96)
    assert coo._nnz() == 3 * SEQ * k
    assert torch.equal(coo.to_dense(), expected[:3])
    assert "h.1" not in store.stats  # packed indices are not values to average


def test_sparse_topk_from_any_encoder_and_its_refusals(tmp_path: Path) -> None:
    encoder = nn.Linear(3, 10)
    model = nn.Sequential(nn.Linear(4, 3))
    rows = torch.randn(12, 4, generator=torch.Generator().manual_seed(8))
    reduce = hs.edits.SparseTopk(lambda x: encoder(x), k=2)
    store = run(model, rows, "0", tmp_path / "s.zarr", reduce=reduce, batch_size=4)
    with torch.no_grad():
        latents = in_batches(nn.Sequential(model, encoder), rows, 4)
    values, indices = latents.topk(2, dim=-1)
    assert torch.equal(store["0"].dense(), torch.zeros_like(latents).scatter(-1, indices, values))
    with pytest.raises(hs.SpecError, match=r"sparse latents \(k=2\) are stored as float32 .* without dtype="):
        run(model, rows, "0", tmp_path / "h.zarr", reduce=reduce, dtype="float16")
    plain = run(model, rows, "0", tmp_path / "p.zarr")
    with pytest.raises(hs.StoreError, match="holds dense values, not sparse latents"):
        plain["0"].dense()
    with pytest.raises(hs.SpecError, match="k=0"):
        hs.edits.SparseTopk(encoder, k=0)


# -- stores made before provenance; strict JSON; partial sparse stores -----------------------------------


def test_a_store_made_before_provenance_is_resumed_and_keeps_none(tmp_path: Path) -> None:
    """``tests/golden/store_format2_partial.zarr``: 24 rows of ``Linear(4, 3)``, chunks of 8, written by
    hookscope before provenance and statistics (commit 1ce18a4) and stopped after chunk 0."""
    import shutil

    out = tmp_path / "old.zarr"
    shutil.copytree(Path(__file__).parents[1] / "golden" / "store_format2_partial.zarr", out)
    before = hs.open_store(out, partial=True)
    assert before.done_chunks() == {0}
    assert "tokens" not in before.meta["config"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    rows = torch.randn(24, 4, generator=torch.Generator().manual_seed(9))
    store = run(model, rows, "0", out, batch_size=4, chunk_rows=8, command="old run")
    assert store.complete
    with torch.no_grad():
        assert_resumed_rows(store["0"][:], in_batches(model, rows, 4).numpy())
    assert store.tokens is None
    assert store.stats == {}  # its first chunk was written without statistics: none are made up
    with pytest.raises(hs.StoreError, match="keeps no row index: it was made by an older hookscope"):
        _ = store.row_index


def test_non_finite_statistics_are_strict_json(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    rows = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [3.0, 4.0], [5.0, 6.0]])
    store = run(model, rows, "0", tmp_path / "n.zarr", batch_size=2)
    text = (tmp_path / "n.zarr" / "zarr.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in zarr.json"))
    assert store.meta["stats"]["0"]["mean"] == "NaN"
    assert np.isnan(store.stats["0"].mean)
    first = torch.tensor([[float("inf"), 1.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # inf in a chunk's first row
    infinite = run(nn.Sequential(nn.Identity()), first, "0", tmp_path / "i.zarr", batch_size=2)
    assert infinite.stats["0"].feature_mean[0] == np.inf  # its own feature: inf, not NaN
    assert infinite.stats["0"].feature_mean[1] == pytest.approx(13 / 4)  # the others untouched


def test_sparse_rows_never_written_are_refused_not_unpacked(tmp_path: Path) -> None:
    encoder = nn.Linear(3, 10)
    model = nn.Sequential(nn.Linear(4, 3))
    rows = torch.randn(16, 4, generator=torch.Generator().manual_seed(8))

    with pytest.raises(RuntimeError, match="unreadable row"):
        run(
            model,
            FailsAt(rows, 8),
            "0",
            tmp_path / "p.zarr",
            reduce=hs.edits.SparseTopk(encoder, 2),
            batch_size=4,
            chunk_rows=4,
        )
    store = hs.open_store(tmp_path / "p.zarr", partial=True)
    assert store["0"].dense(slice(0, 4)).shape == (4, 10)
    with pytest.raises(hs.StoreIndexError, match="include rows never written"):
        store["0"].dense()
    with pytest.raises(hs.StoreIndexError, match="include rows never written"):
        store["0"].sparse(slice(6, 10))


def test_a_sparse_site_is_resumed_only_with_the_same_encoder_width(tmp_path: Path) -> None:
    class PlainSAE:  # not an nn.Module: described by its class, never by its address
        def __init__(self, width: int) -> None:
            self.weight = torch.randn(3, width, generator=torch.Generator().manual_seed(width))

        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

        def decode(self, z: torch.Tensor) -> torch.Tensor:
            return z @ self.weight.T

    model = nn.Sequential(nn.Linear(4, 3))
    rows = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    out = tmp_path / "z.zarr"
    with pytest.raises(RuntimeError, match="unreadable row"):  # a run stopped after its first chunk
        run(model, FailsAt(rows, 4), "0", out, reduce=hs.edits.splice(PlainSAE(10)).topk(2), batch_size=4)
    with pytest.raises(hs.StoreError, match=r"sparse=\{'k': 2, 'width': 10\}.*'width': 50"):
        run(model, rows, "0", out, reduce=hs.edits.splice(PlainSAE(50)).topk(2), batch_size=4)
    resumed = run(model, rows, "0", out, reduce=hs.edits.splice(PlainSAE(10)).topk(2), batch_size=4)
    assert resumed.complete  # another object, the same description: no address in it


# -- per-token sites keep the mask; precision; repairs; the loader's checks ------------------------------


@pytest.mark.transformers
def test_sparse_latents_per_token_keep_tokens_and_mask_and_the_loader_skips_padding(tmp_path: Path) -> None:
    model, sae, data = tiny_gpt2(), SAE(), padded_tokens(rows=8)
    store = run(model, data, "h.1", tmp_path / "z.zarr", reduce=hs.edits.splice(sae).topk(4), batch_size=4)
    assert store.tokens is not None
    assert store.attention_mask is not None
    real = int(data["attention_mask"].sum())
    assert sum(len(batch) for batch in store.loader("h.1", 16, tokens=True)) == real


@pytest.mark.transformers
def test_tokens_false_keeps_no_ids_but_the_mask_that_statistics_need(tmp_path: Path) -> None:
    model, data = tiny_gpt2(), padded_tokens()
    store = run(model, data, "h.0", tmp_path / "f.zarr", batch_size=4, tokens=False)
    assert store.tokens is None
    assert store.attention_mask is not None
    assert store.stats["h.0"].count == int(data["attention_mask"].sum())


def test_statistics_stay_exact_for_features_far_from_zero(tmp_path: Path) -> None:
    """Residual streams have a few features in the hundreds or thousands with a small spread."""
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.mul_(0.01)
        model.bias.copy_(torch.tensor([3000.0, -450.0, 800.0, 0.0]))
    rows = torch.randn(4096, 4, generator=torch.Generator().manual_seed(3))
    store = run(nn.Sequential(model), rows, "0", tmp_path / "f.zarr", batch_size=256, chunk_rows=512)
    assert_stats(store.stats["0"], store["0"][:])


def test_a_completed_old_store_is_repaired_without_provenance(tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "old.zarr"
    shutil.copytree(Path(__file__).parents[1] / "golden" / "store_format2_partial.zarr", out)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    rows = torch.randn(24, 4, generator=torch.Generator().manual_seed(9))
    run(model, rows, "0", out, batch_size=4, chunk_rows=8, command="old run")
    (out / "0" / "c" / "1" / "0").write_bytes(b"not a chunk")
    with pytest.warns(hs.StoreRepairWarning, match="1 stored chunk"):
        repaired = run(model, rows, "0", out, batch_size=4, chunk_rows=8, command="old run")
    with torch.no_grad():
        assert_resumed_rows(repaired["0"][:], in_batches(model, rows, 4).numpy())
    assert repaired.tokens is None


def test_recorded_commands_carry_no_credentials(tmp_path: Path) -> None:
    command = "python run.py --out s3://AKIA:se/cret@bucket/f.zarr --storage-option secret=hunter2"
    store = run(nn.Sequential(nn.Linear(4, 3)), torch.randn(8, 4), "0", tmp_path / "f.zarr", command=command)
    assert "hunter2" not in store.meta["command"]
    assert "se/cret" not in store.meta["command"]
    assert "s3://***@bucket/f.zarr" in store.meta["command"]


def test_sparse_values_that_are_nan_are_values(tmp_path: Path) -> None:
    rows = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    rows[3] = float("nan")
    encoder = nn.Linear(4, 6)
    store = run(nn.Sequential(nn.Identity()), rows, "0", tmp_path / "n.zarr", reduce=hs.edits.SparseTopk(encoder, 2))
    dense = store["0"].dense()
    assert dense.shape == (8, 6)
    assert torch.isnan(dense[3]).any()
    assert not torch.isnan(dense[[0, 1, 2, 4, 5, 6, 7]]).any()


@pytest.mark.transformers
def test_the_loader_reads_only_done_chunks_and_lists_files_each_time(tmp_path: Path) -> None:
    import zarr

    model, data = tiny_gpt2(), padded_tokens(rows=16)
    out = tmp_path / "f.zarr"
    run(model, data, "h.0", out, batch_size=4, chunk_rows=4)
    group = zarr.open_group(out, mode="r+")
    group["_hookscope/done"][2] = 0  # as a check of a damaged chunk leaves it: not done, to write again
    meta = dict(group.attrs["hookscope"])
    group.attrs["hookscope"] = {**meta, "state": "writing"}
    (out / "_rows" / "attention_mask" / "c" / "2" / "0").write_bytes(b"damaged")
    store = hs.open_store(out, partial=True)
    mask = data["attention_mask"].bool()
    expected = int(mask[:8].sum() + mask[12:].sum())
    assert sum(len(batch) for batch in store.loader("h.0", 16, tokens=True)) == expected
    (out / "h.0" / "c" / "3" / "0" / "0").unlink()
    with pytest.raises(hs.StoreError, match="chunk 3 of 'h.0' is damaged: its file is gone"):
        store.loader("h.0", 16, tokens=True)  # the same Store: listed again, not remembered
    (out / "_rows" / "attention_mask" / "c" / "1" / "0").write_bytes(b"damaged too")
    with pytest.raises(
        hs.StoreError, match=r"chunk 1 \(rows 4..7\) of '_rows/attention_mask' is damaged: it cannot be read"
    ):
        hs.open_store(out, partial=True).loader("h.0", 16, tokens=True)


def test_a_mask_kept_for_a_site_of_the_same_width_says_how_to_go_without() -> None:
    class Queries(nn.Module):  # four learned queries: (batch, 4, 3) whatever the input's length
        def __init__(self) -> None:
            super().__init__()
            self.queries = nn.Parameter(torch.randn(4, 3))
            self.out = nn.Identity()

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.out(self.queries.expand(len(input_ids), 4, 3) * attention_mask.sum(1)[:, None, None])

    batches = [
        {"input_ids": torch.ones(2, width, dtype=torch.long), "attention_mask": torch.ones(2, width, dtype=torch.long)}
        for width in (4, 6)
    ]
    with pytest.raises(hs.DataError, match=r"the mask is kept because a site's dimension 1 .* mask=None keeps no mask"):
        hs.extract(Queries(), batches, zarr_memory(), layers="out", progress=False, tokens=False)


def zarr_memory() -> Any:
    import zarr

    return zarr.storage.MemoryStore()


def test_a_site_with_a_chunk_lacking_its_statistics_has_none(tmp_path: Path) -> None:
    import zarr

    out = tmp_path / "f.zarr"
    run(nn.Sequential(nn.Linear(4, 3)), torch.randn(16, 4), "0", out, batch_size=4, chunk_rows=4)
    zarr.open_group(out, mode="r+")["_hookscope/stats/0"][2] = np.nan  # as a writer that kept none leaves it
    assert hs.open_store(out).stats == {}  # not the statistics of the other chunks, passed off as the site's
