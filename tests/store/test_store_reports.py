"""What a store says about itself: its listing, its export, a refused configuration, the progress
line and what a call wrote; checked against the inputs and raw forward hooks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from tests.models import track

pytest.importorskip("zarr")

VOCAB, SEQ = 40, 7


def run(model: nn.Module, data: Any, layers: Any, out: Any, **options: Any) -> hs.Store:
    return hs.extract(model, data, out, layers=layers, progress=False, **options)


class Encoder(nn.Module):
    """A sparse autoencoder's encoder half, whose repr spans lines."""

    def __init__(self, d: int = 3, latents: int = 10) -> None:
        super().__init__()
        self.enc = nn.Linear(d, latents)
        self.dec = nn.Linear(latents, d)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.enc(x))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.dec(z)


def test_a_sparse_site_is_listed_by_k_and_width_and_recorded_whole(tmp_path: Path) -> None:
    model = track(nn.Sequential(nn.Linear(4, 3)))
    rows = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    store = run(model, rows, "0", tmp_path / "s.zarr", reduce=hs.edits.splice(Encoder()).topk(2), batch_size=4)
    listing = repr(store)
    assert "sparse_topk(k=2, width=10)" in listing
    assert max(len(line) for line in listing.splitlines()[1:]) < 100, listing  # the title holds the path
    assert "\\n" not in listing
    assert "Linear(" not in listing
    recorded = store.meta["sites"][0]["reduce"]
    assert recorded.startswith("sparse_topk(k=2, encode=")
    assert "Linear(" in recorded  # the record keeps it all


def test_a_changed_configuration_lists_only_real_differences(tmp_path: Path) -> None:
    model = track(nn.Sequential(nn.Linear(4, 3), nn.ReLU()))
    rows = torch.randn(8, 4)
    out = tmp_path / "f.zarr"
    run(model, rows, "0", out, batch_size=4)
    with pytest.raises(hs.StoreError) as refused:
        run(model, rows, "1", out, batch_size=4)
    message = str(refused.value)
    differences = message.split("cannot be continued: ", 1)[1].split("; run with the stored", 1)[0]
    assert differences == "layers: stored ['0'], now ['1']"
    with pytest.raises(hs.StoreError) as refused:
        run(model, rows, "0", out, batch_size=4, reduce="mean:1")
    assert "reduce.0: stored None, now 'mean:1'" in str(refused.value)  # None beside a value is a difference


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 4)
        self.proj = nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(self.embed(input_ids))


@pytest.mark.slow
def test_to_hf_dataset_keeps_what_each_row_is(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    model = track(TokenModel())
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (10, SEQ), generator=generator)
    mask = (torch.arange(SEQ)[None, :] < torch.randint(2, SEQ + 1, (10,), generator=generator)[:, None]).long()
    picked = [7, 2, 9, 0, 4, 1]
    data = {"input_ids": ids, "attention_mask": mask}
    store = run(model, data, "proj", tmp_path / "t.zarr", batch_size=2, indices=picked)
    assert store.attention_mask is not None
    dataset = store.to_hf_dataset(cache_dir=str(tmp_path / "hf"))
    assert dataset.column_names == ["proj", "row_index", "tokens", "attention_mask"]
    assert isinstance(dataset.features["row_index"], datasets.Value)
    assert [row["row_index"] for row in dataset] == picked
    assert np.array_equal(np.asarray(dataset["tokens"]), ids[picked].numpy())
    assert np.array_equal(np.asarray(dataset["attention_mask"]), mask[picked].bool().numpy())
    kept: list[torch.Tensor] = []
    handle = model.proj.register_forward_hook(lambda _m, _a, out: kept.append(out.clone()))
    try:
        with torch.no_grad():
            for start in range(0, len(picked), 2):
                model(ids[picked[start : start + 2]])
    finally:
        handle.remove()
    assert np.array_equal(np.asarray(dataset["proj"], dtype=np.float32), torch.cat(kept).numpy())
    plain = store.to_hf_dataset(provenance=False, cache_dir=str(tmp_path / "hf2"))
    assert plain.column_names == ["proj"]


def test_the_progress_line_names_a_url_store_by_its_url(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOKSCOPE_PROGRESS_INTERVAL", "0")
    model = track(nn.Sequential(nn.Linear(4, 3)))
    hs.extract(model, torch.randn(8, 4), "memory://reports/feats.zarr", layers="0", batch_size=4, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines
    assert all(line.startswith("extract → memory://reports/feats.zarr: ") for line in lines), lines
    hs.extract(model, torch.randn(8, 4), tmp_path / "local.zarr", layers="0", batch_size=4, progress=True)
    assert capsys.readouterr().err.splitlines()[0].startswith("extract → local.zarr: ")  # a folder by its name


def test_a_store_says_how_many_rows_the_call_wrote(tmp_path: Path) -> None:
    model = track(nn.Sequential(nn.Linear(4, 3)))
    rows = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))
    out = tmp_path / "f.zarr"

    class StopsAt(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 8:
                raise RuntimeError("row 8 is unreadable")
            return rows[index]

    with pytest.raises(RuntimeError, match="row 8 is unreadable"):
        run(model, StopsAt(), "0", out, batch_size=4, chunk_rows=4)
    assert run(model, rows, "0", out, batch_size=4, chunk_rows=4).written_rows == 4  # chunks 0 and 1 were there
    assert run(model, rows, "0", out, batch_size=4, chunk_rows=4).written_rows == 0  # complete: only checked
    assert hs.open_store(out).written_rows is None
    assert run(model, rows, "0", tmp_path / "new.zarr", batch_size=4).written_rows == 12
