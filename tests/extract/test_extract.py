"""``hs.extract`` and ``hs.open_store`` on real models: rows equal the forward, every data form,
padding-aware reductions, dtypes, resuming, refusals, and a store any zarr reader opens."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hookscope as hs
from hookscope._core.live_hooks import attached
from tests.models import LinearInplaceReLU, MixedOutputs, SharedTwice, SmallCNN, tiny_gpt2, track


def run(model: nn.Module, data: Any, layers: Any, out: Path | Any, **options: Any) -> hs.Store:
    return hs.extract(model, data, out, layers=layers, progress=False, **options)


def store_files(path: Path) -> dict[str, bytes]:
    """Every file of a store, by relative path: two stores are bit-identical when these are equal."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def no_writer_thread() -> bool:
    return not any(t.name.startswith(("hookscope-extract-writer", "hookscope-chunk")) for t in threading.enumerate())


class Pairs(Dataset[tuple[torch.Tensor, int]]):
    """A map-style data set of (image, label) pairs, as most data sets are."""

    def __init__(self, rows: int) -> None:
        self.images = torch.randn(rows, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], index % 10


# -- rows are what the model computes -------------------------------------------------------------


def test_rows_equal_the_forward_of_each_batch(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    images = torch.randn(50, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    store = run(model, images, ["conv1", "fc"], tmp_path / "f.zarr", batch_size=16)
    assert store.complete
    assert len(store) == 50
    assert store.sites == ["conv1", "fc"]
    with torch.no_grad(), hs.capture(model, "conv1", "fc") as cap:
        for start in range(0, 50, 16):
            model(images[start : start + 16])
            assert np.array_equal(store["conv1"][start : start + 16], cap["conv1"].numpy())
            assert np.array_equal(store["fc"][start : start + 16], cap["fc"].numpy())
    assert store["conv1"].shape == (50, 16, 30, 30)
    assert not attached(model)
    assert no_writer_thread()


def test_in_place_op_after_the_layer_does_not_change_its_rows(tmp_path: Path) -> None:
    model = LinearInplaceReLU().eval()
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    store = run(model, x, "fc", tmp_path / "f.zarr", batch_size=8)
    expected = model.fc(x).detach().numpy()
    assert (store["fc"][:] < 0).any()  # the ReLU after it ran in place; the stored rows kept their negatives
    assert np.allclose(store["fc"][:], expected, atol=1e-6)


def test_every_call_of_a_reused_module_is_its_own_array(tmp_path: Path) -> None:
    model = SharedTwice().eval()
    x = torch.randn(12, 4)
    store = run(model, x, ["shared", "head"], tmp_path / "f.zarr", batch_size=4)
    assert store.sites == ["shared#0:output", "shared#1:output", "head"]
    first = model.shared(x)
    assert np.allclose(store["shared#0:output"][:], first.detach().numpy(), atol=1e-6)
    assert np.allclose(store["shared#1:output"][:], model.shared(torch.relu(first)).detach().numpy(), atol=1e-6)
    with pytest.raises(hs.SiteNotFoundError, match="several sites"):
        store["shared"]


def test_structured_outputs_store_each_tensor(tmp_path: Path) -> None:
    model = MixedOutputs()
    x = torch.randn(6, 3)
    store = run(model, x, ["tuple_out", "dict_out", "dataclass_out"], tmp_path / "f.zarr", batch_size=3)
    assert store.sites == ["tuple_out", "dict_out#0:output['a']", "dict_out#0:output['b'][0]", "dataclass_out"]
    assert np.allclose(store["tuple_out"][:], (x * 2).numpy())
    assert np.allclose(store["dict_out#0:output['b'][0]"][:], (x * 2 - 1).numpy())
    assert np.allclose(store["dataclass_out"][:], ((x * 2 + 1) * 3).numpy())


@pytest.mark.transformers
def test_gpt2_token_reductions_use_only_real_tokens(tmp_path: Path) -> None:
    model = tiny_gpt2()
    lengths = torch.tensor([10, 7, 3, 10, 1, 5])
    mask = (torch.arange(10) < lengths[:, None]).long()
    ids = torch.randint(1, 64, (6, 10), generator=torch.Generator().manual_seed(0)) * mask
    data = {"input_ids": ids, "attention_mask": mask}
    store = run(
        model, data, ["h.0", "h.1", "ln_f"], tmp_path / "f.zarr", batch_size=6, reduce={"ln_f": "last", "h.*": "mean:1"}
    )
    _, cache = hs.run_with_capture(model, input_ids=ids, attention_mask=mask, layers=["h.0", "ln_f"])
    for row, length in enumerate(lengths.tolist()):
        assert np.allclose(store["h.0"][row], cache["h.0"][row, :length].mean(0).numpy(), atol=1e-5)
        assert np.allclose(store["ln_f"][row], cache["ln_f"][row, length - 1].numpy(), atol=1e-6)
    assert store["h.1"].shape == (6, 32)
    assert store.meta["config"]["reduce"] == {"h.0": "mean:1", "h.1": "mean:1", "ln_f": "last:1"}
    unmasked = run(model, data, "h.0", tmp_path / "g.zarr", batch_size=6, reduce="mean:1", mask=None)
    assert np.allclose(unmasked["h.0"][1], cache["h.0"][1].mean(0).numpy(), atol=1e-5)  # pads averaged in


def test_bfloat16_is_stored_as_bits_and_read_back_exactly(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    images = torch.randn(20, 3, 32, 32)
    store = run(model, images, "fc", tmp_path / "f.zarr", batch_size=8, dtype="bfloat16")
    expected = model(images).detach().to(torch.bfloat16)
    raw = zarr.open_group(tmp_path / "f.zarr", mode="r")["fc"]
    assert raw.dtype == np.uint16
    assert raw.attrs["hookscope"]["dtype"] == "bfloat16"
    assert store.torch("fc").dtype == torch.bfloat16
    assert torch.equal(store.torch("fc"), expected)
    assert store["fc"].dtype == np.float32
    assert np.array_equal(store["fc"][:5], expected[:5].float().numpy())


def test_float16_storage_and_inputs(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    images = torch.randn(8, 3, 32, 32)
    store = run(model, images, ["conv1", "fc"], tmp_path / "f.zarr", batch_size=4, dtype=torch.float16, keep="both")
    assert "conv1#0:input[0]" in store.sites
    assert np.array_equal(store["conv1#0:input[0]"][:], images.half().numpy())
    assert store["fc#0:output"].dtype == np.float16


def test_float16_overflow_is_said_once_per_run_with_the_count(tmp_path: Path) -> None:
    """Rows whose values pass float16's 65504: one warning for the whole run, naming the site
    and the count numpy's own cast gives; overflow='error' refuses them and leaves no hook."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    rows = torch.randn(64, 4) * 4e4
    with torch.no_grad():
        values = model(rows).numpy()
    with np.errstate(over="ignore"):
        expected = int((np.isinf(values.astype(np.float16)) & np.isfinite(values)).sum())
    assert expected > 0
    with pytest.warns(hs.CastOverflowWarning, match=rf"extract: .* at 0#0:output \({expected:,}\)") as caught:
        store = run(model, rows, "0", tmp_path / "warn.zarr", batch_size=8, dtype="fp16")
    assert len([w for w in caught if issubclass(w.category, hs.CastOverflowWarning)]) == 1
    assert int(np.isinf(store["0#0:output"][:]).sum()) == expected
    with pytest.raises(hs.CaptureError, match="dtype=float16 turned"):
        run(model, rows, "0", tmp_path / "error.zarr", batch_size=8, dtype="fp16", overflow="error")
    assert not attached(model)


def test_a_reduce_key_may_name_a_leaf(tmp_path: Path) -> None:
    model = MixedOutputs().eval()
    rows = torch.randn(4, 2)
    store = run(
        model,
        rows,
        ["tuple_out:output[0]"],
        tmp_path / "leaf.zarr",
        batch_size=2,
        reduce={"tuple_out:output[0]": "mean:1"},
    )
    with torch.no_grad():
        reference = model.tuple_out(rows)[0].mean(dim=1)
    np.testing.assert_allclose(store["tuple_out"][:], reference.numpy(), rtol=1e-6)


# -- every form of data ----------------------------------------------------------------------------


def test_stream_of_unknown_length_grows_the_arrays(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    chunks = [torch.randn(7, 4), torch.randn(7, 4), torch.randn(5, 4)]

    def batches() -> Iterator[torch.Tensor]:
        yield from chunks

    store = run(model, batches(), "0", tmp_path / "f.zarr", chunk_rows=14)
    assert len(store) == 19
    assert store["0"].shape == (19, 3)
    assert store.meta["rows"] == 19
    assert store.meta["config"]["rows"] is None
    assert np.allclose(store["0"][:], model(torch.cat(chunks)).detach().numpy(), atol=1e-6)
    assert store.done_chunks() == {0, 1}


def test_a_stream_that_failed_part_way_resumes(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    chunks = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(5)]

    def batches(fail_at: int | None) -> Iterator[torch.Tensor]:
        for index, chunk in enumerate(chunks):
            if index == fail_at:
                raise RuntimeError("the stream broke")
            yield chunk

    whole = run(model, batches(None), "0", tmp_path / "whole.zarr", chunk_rows=12)
    with pytest.raises(RuntimeError, match="stream broke"):
        run(model, batches(3), "0", tmp_path / "f.zarr", chunk_rows=12)
    partial = hs.open_store(tmp_path / "f.zarr", partial=True)
    assert partial.done_chunks() == {0}
    assert partial["0"].shape == (12, 3)
    ran: list[int] = []
    with hs.hooks(model, {"": lambda module, args, output: ran.append(len(args[0]))}):
        resumed = run(model, batches(None), "0", tmp_path / "f.zarr", chunk_rows=12)
    assert ran == [6, 6, 6, 6]  # the probe, then the batches after the done chunk: rows 12..29
    assert resumed.complete
    assert len(resumed) == 30
    assert whole.meta["chunks"] == 3
    assert store_files(tmp_path / "f.zarr") == store_files(tmp_path / "whole.zarr")


def test_a_store_cut_short_while_being_made_is_made_again(tmp_path: Path) -> None:
    zarr.create_group(store=str(tmp_path / "f.zarr"), attributes={"hookscope": {"format": 1, "state": "creating"}})
    with pytest.raises(hs.StoreError, match="cut short while it was being made"):
        hs.open_store(tmp_path / "f.zarr")
    store = run(nn.Sequential(nn.Linear(4, 3)), torch.randn(8, 4), "0", tmp_path / "f.zarr")
    assert store.complete
    assert len(store) == 8


def test_list_of_batches_and_dataloader_with_labels(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    pairs = Pairs(10)
    listed = [(pairs.images[:6], torch.zeros(6)), (pairs.images[6:], torch.zeros(4))]
    a = run(model, listed, "fc", tmp_path / "a.zarr")
    b = run(model, DataLoader(pairs, batch_size=6), "fc", tmp_path / "b.zarr")
    c = run(model, pairs, "fc", tmp_path / "c.zarr", batch_size=6)
    assert np.array_equal(a["fc"][:], b["fc"][:])
    assert np.array_equal(b["fc"][:], c["fc"][:])
    assert len(a) == len(b) == 10
    dropped = run(model, DataLoader(pairs, batch_size=4, drop_last=True), "fc", tmp_path / "d.zarr")
    assert len(dropped) == 8


def test_indices_pick_rows_in_their_order(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    pairs = Pairs(20)
    picks = [17, 3, 3, 9, 0]
    store = run(model, pairs, "fc", tmp_path / "f.zarr", batch_size=2, indices=picks)
    expected = model(pairs.images[picks]).detach().numpy()
    assert np.allclose(store["fc"][:], expected, atol=1e-6)


@pytest.mark.parametrize("picks", [[1.9, 2.7], np.array([1.5, 2.0]), torch.tensor([1.0, 2.0]), [True, False]])
def test_indices_that_are_not_integers_are_refused(tmp_path: Path, picks: Any) -> None:
    model, x = nn.Sequential(nn.Linear(4, 2)), torch.randn(6, 4)
    with pytest.raises(hs.SpecError, match="must be integers"):
        run(model, x, "0", tmp_path / "f.zarr", indices=picks)
    assert not (tmp_path / "f.zarr").exists()


def test_integer_indices_of_numpy_and_torch_pick_their_rows(tmp_path: Path) -> None:
    model, x = nn.Sequential(nn.Linear(4, 2)).eval(), torch.randn(6, 4)
    for name, picks in (("n", np.array([4, 1], dtype=np.int32)), ("t", torch.tensor([4, 1])), ("s", [np.int64(4), 1])):
        store = run(model, x, "0", tmp_path / f"{name}.zarr", indices=picks)
        assert np.allclose(store["0"][:], model(x[[4, 1]]).detach().numpy(), atol=1e-6)


@pytest.mark.transformers
def test_keyword_columns_and_a_custom_inputs_function(tmp_path: Path) -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(2))
    by_key = run(model, {"input_ids": ids}, "ln_f", tmp_path / "a.zarr", batch_size=4, reduce="last")
    custom = run(
        model, [{"tokens": ids}], "ln_f", tmp_path / "b.zarr", reduce="last", inputs=lambda b: ((b["tokens"],), {})
    )
    assert by_key["ln_f"].shape == (8, 32)
    assert np.allclose(by_key["ln_f"][:], custom["ln_f"][:], atol=1e-5)  # batches of 4 and one of 8: same rows


def test_shuffling_or_sharded_loaders_are_refused(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    with pytest.raises(hs.SpecError, match="shuffles"):
        run(model, DataLoader(Pairs(8), batch_size=4, shuffle=True), "fc", tmp_path / "f.zarr")
    with pytest.raises(hs.SpecError, match="batch_size=8 differs"):
        run(model, DataLoader(Pairs(8), batch_size=4), "fc", tmp_path / "f.zarr", batch_size=8)
    sharded = DistributedSampler(Pairs(8), num_replicas=2, rank=0, shuffle=False)
    with pytest.raises(hs.SpecError, match="extract shards the rows between processes itself"):
        run(model, DataLoader(Pairs(8), batch_size=4, sampler=sharded), "fc", tmp_path / "f.zarr")
    assert not (tmp_path / "f.zarr").exists()


def test_data_of_no_known_form(tmp_path: Path) -> None:
    with pytest.raises(hs.SpecError, match="data of type int"):
        run(SmallCNN(), 5, "fc", tmp_path / "f.zarr")
    with pytest.raises(hs.SpecError, match="batch of type str"):
        run(SmallCNN(), ["not a batch"], "fc", tmp_path / "f.zarr")


class _CountsAndFeatures(nn.Module):
    """A float site and an integer one (the argmax), so both kinds of unwritten rows are seen."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, y.argmax(-1)


def test_rows_a_partial_store_never_wrote_read_as_nan_not_zeros(tmp_path: Path) -> None:
    model = _CountsAndFeatures()
    rows = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))

    def batches() -> Iterator[torch.Tensor]:
        yield rows[:4]
        yield rows[4:8]
        raise RuntimeError("the stream broke")  # rows 8..11 are never written

    with pytest.raises(RuntimeError, match="stream broke"):
        hs.extract(model, batches(), tmp_path / "f.zarr", layers="", progress=False, chunk_rows=4)
    partial = hs.open_store(tmp_path / "f.zarr", partial=True)
    assert partial.done_chunks() == {0, 1}
    floats, counts = (partial[name] for name in partial.sites)
    with torch.no_grad():
        want = model.fc(rows[:8]).numpy()
    assert np.allclose(floats[:8], want, atol=1e-6)  # written rows read as written
    grown = zarr.open_group(str(tmp_path / "f.zarr"), mode="r")[floats.name].shape[0]
    if grown > 8:  # a stream's arrays grow as chunks come: rows beyond the done chunks, if any, read as NaN
        assert np.isnan(floats[8:]).all()
    assert np.array_equal(counts[:8], want.argmax(-1))
    assert np.allclose(floats.torch(slice(0, 8)).numpy(), want, atol=1e-6)


def test_rows_of_an_unfinished_chunk_read_as_nan_or_are_refused(tmp_path: Path) -> None:
    model = _CountsAndFeatures()
    data = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    hs.extract(model, data, tmp_path / "f.zarr", layers="", progress=False, chunk_rows=4, batch_size=4)
    group = zarr.open_group(str(tmp_path / "f.zarr"), mode="r+")
    group["_hookscope/done"][1] = 0  # chunk 1 (rows 4..7) not recorded as done, as after a killed run
    key = next(name for name in group.attrs if "hookscope" in name)
    group.attrs[key] = {**dict(group.attrs[key]), "state": "writing"}
    partial = hs.open_store(tmp_path / "f.zarr", partial=True)
    assert partial.done_chunks() == {0, 2}
    floats, counts = (partial[name] for name in partial.sites)
    with torch.no_grad():
        want = model.fc(data).numpy()
    read = floats[:]
    assert np.isnan(read[4:8]).all()  # not the values, and not zeros: never written as far as the store knows
    assert np.allclose(read[:4], want[:4], atol=1e-6)
    assert np.allclose(read[8:], want[8:], atol=1e-6)
    assert np.isnan(floats[5]).all()
    assert torch.isnan(floats.torch(slice(2, 6))[2:]).all()
    assert np.array_equal(counts[8:], want[8:].argmax(-1))
    with pytest.raises(hs.StoreError, match=r"row 4 of .* was never written .* have no NaN"):
        counts[2:6]


def test_a_store_of_one_site_reads_well(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 256))
    store = hs.extract(model, torch.randn(1000, 4), tmp_path / "f.zarr", layers="0", progress=False)
    text = repr(store)
    assert "1,000 rows, 1 site, complete" in text  # not "1 sites"
    assert "1000 KiB" in text  # 1000 x 256 float32 rows, not "1e+03 KiB"
    assert "e+" not in text


# -- bad input: clear errors, no hooks, nothing half-written ----------------------------------------


def test_a_layer_not_in_the_model_names_the_closest(tmp_path: Path) -> None:
    model = SmallCNN()
    with pytest.raises(hs.SelectionError, match="did you mean 'conv1'"):
        run(model, torch.randn(4, 3, 32, 32), "conv_1", tmp_path / "f.zarr")
    assert not (tmp_path / "f.zarr").exists()
    assert not attached(model)


@pytest.mark.transformers
def test_batches_of_inconsistent_shapes_name_the_site(tmp_path: Path) -> None:
    model = tiny_gpt2()
    batches = [torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 5))]
    message = r"site 'h.0#0:output' gave \(2, 5, 32\) float32 for rows 4..5.*mean:1"
    with pytest.raises(hs.DataError, match=message) as info:
        run(model, batches, "h.0", tmp_path / "f.zarr", chunk_rows=2)
    assert info.value.rows == range(4, 6)
    assert not attached(model)
    assert no_writer_thread()
    with pytest.raises(hs.StoreError, match="incomplete: 2 of 3 chunks written"):
        hs.open_store(tmp_path / "f.zarr")
    partial = hs.open_store(tmp_path / "f.zarr", partial=True)
    assert partial.done_chunks() == {0, 1}
    assert not partial.complete


def test_reductions_must_keep_the_batch(tmp_path: Path) -> None:
    x = torch.randn(4, 4)
    for spec in ("mean", "mean:0"):
        with pytest.raises(hs.SpecError, match="batch"):
            run(nn.Sequential(nn.Linear(4, 2)), x, "0", tmp_path / "f.zarr", reduce=spec)
    with pytest.raises(hs.SpecError, match="first dimension must be the batch"):
        run(nn.Sequential(nn.Linear(4, 2)), x, "0", tmp_path / "f.zarr", reduce=lambda t: t.sum(0))
    with pytest.raises(hs.SpecError, match="none of the layers"):
        run(nn.Sequential(nn.Linear(4, 2), nn.ReLU()), x, "0", tmp_path / "f.zarr", reduce={"1": "mean:1"})


def test_out_that_is_not_a_store_is_never_replaced(tmp_path: Path) -> None:
    model, x = nn.Sequential(nn.Linear(4, 2)), torch.randn(4, 4)
    (tmp_path / "file").write_text("x")
    with pytest.raises(hs.StoreError, match="is a file"):
        run(model, x, "0", tmp_path / "file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("keep me")
    with pytest.raises(hs.StoreError, match="holds files and is not a zarr store"):
        run(model, x, "0", tmp_path / "dir", overwrite=True)
    assert (tmp_path / "dir" / "notes.txt").read_text() == "keep me"
    with pytest.raises(hs.StoreError, match="cannot be written"):
        run(model, x, "0", tmp_path / "file" / "f.zarr")  # its parent is a file
    zarr.create_group(store=str(tmp_path / "other.zarr"))
    with pytest.raises(hs.StoreError, match="hookscope did not make"):
        run(model, x, "0", tmp_path / "other.zarr")
    assert run(model, x, "0", tmp_path / "other.zarr", overwrite=True).complete


def test_overwrite_never_deletes_what_hookscope_did_not_write(tmp_path: Path) -> None:
    model, x = nn.Sequential(nn.Linear(4, 2)), torch.randn(8, 4)
    out = tmp_path / "f.zarr"
    run(model, x, "0", out)
    (out / "notes.txt").write_text("keep me")
    zarr.open_group(out, mode="r+").create_array("probe", shape=(3,), dtype="float32")[:] = [1, 2, 3]
    before = store_files(out)
    with pytest.raises(hs.StoreError, match=r"also holds notes.txt, probe, which hookscope did not write"):
        run(model, x, "0", out, overwrite=True)
    assert store_files(out) == before
    (out / "notes.txt").unlink()
    zarr.open_group(out, mode="r+").__delitem__("probe")
    assert run(nn.Sequential(nn.Linear(4, 3)), x, "0", out, overwrite=True)["0"].shape == (8, 3)

    theirs = tmp_path / "theirs.zarr"
    zarr.create_group(store=str(theirs)).create_array("weights", shape=(2,), dtype="int64")[:] = [5, 6]
    with pytest.raises(hs.StoreError, match=r"a zarr group hookscope did not make but also holds weights"):
        run(model, x, "0", theirs, overwrite=True)
    assert zarr.open_group(theirs, mode="r")["weights"][:].tolist() == [5, 6]


# -- resuming and refusing ------------------------------------------------------------------------


class FailsOnce(Dataset[torch.Tensor]):
    """Rows of a tensor; fetching ``fail_at`` raises until ``armed`` is turned off."""

    def __init__(self, rows: torch.Tensor, fail_at: int) -> None:
        self.rows, self.fail_at, self.armed = rows, fail_at, True

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.armed and index == self.fail_at:
            raise RuntimeError("the data went away")
        return self.rows[index]


def test_a_run_that_failed_part_way_resumes_to_the_same_bits(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    images = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    whole = run(model, images, ["conv1", "fc"], tmp_path / "whole.zarr", batch_size=8, chunk_rows=16)
    data = FailsOnce(images, fail_at=41)
    with pytest.raises(RuntimeError, match="went away"):
        run(model, data, ["conv1", "fc"], tmp_path / "f.zarr", batch_size=8, chunk_rows=16)
    assert hs.open_store(tmp_path / "f.zarr", partial=True).done_chunks() == {0, 1}
    data.armed = False
    resumed = run(model, data, ["conv1", "fc"], tmp_path / "f.zarr", batch_size=8, chunk_rows=16)
    assert resumed.complete
    assert store_files(tmp_path / "f.zarr") == store_files(tmp_path / "whole.zarr")
    assert whole.meta["chunks"] == 4


@pytest.mark.slow
def test_a_different_configuration_is_refused_with_every_difference(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    images = torch.randn(16, 3, 32, 32)
    run(model, images, ["fc"], tmp_path / "f.zarr", batch_size=8)
    before = store_files(tmp_path / "f.zarr")
    other = SmallCNN().eval()  # other random weights
    with pytest.raises(hs.StoreError) as refused:
        run(other, images[:12], ["fc"], tmp_path / "f.zarr", batch_size=4, dtype="fp16")
    message = str(refused.value)
    for difference in (
        "model.fingerprint: stored",
        "dtype: stored None, now 'float16'",
        "rows: stored 16, now 12",
        "batch_size: stored 8, now 4",
    ):
        assert difference in message
    with pytest.raises(hs.StoreError, match=r"data.first_row: stored '\w+', now '\w+'"):
        run(model, torch.randn(16, 3, 32, 32), ["fc"], tmp_path / "f.zarr", batch_size=8)  # other rows, same count
    with pytest.raises(hs.StoreError, match="eval_mode: stored True, now False"):
        run(model, images, ["fc"], tmp_path / "f.zarr", batch_size=8, eval_mode=False)
    assert store_files(tmp_path / "f.zarr") == before
    with pytest.raises(hs.StoreError, match="already holds a feature store"):
        run(model, images, ["fc"], tmp_path / "f.zarr", batch_size=8, resume=False)
    replaced = run(other, images[:12], ["fc"], tmp_path / "f.zarr", batch_size=8, overwrite=True)
    assert len(replaced) == 12


def test_reduction_functions_rows_and_batch_sizes_are_compared(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    images = torch.randn(16, 3, 32, 32)
    run(model, images, "conv1", tmp_path / "f.zarr", batch_size=8, reduce=lambda v: v.mean((2, 3)))
    with pytest.raises(hs.StoreError, match="reduce.conv1: stored"):
        run(model, images, "conv1", tmp_path / "f.zarr", batch_size=8, reduce=lambda v: v.amax((2, 3)))
    with pytest.raises(hs.StoreError) as refused:
        run(model, images, "conv1", tmp_path / "f.zarr", batch_size=4, reduce=lambda v: v.mean((2, 3)))
    assert "batch_size: stored 8, now 4" in str(refused.value)
    assert "data.first_row" not in str(refused.value)  # the same rows: no data difference is claimed
    same = run(
        model, images, "conv1", tmp_path / "f.zarr", batch_size=8, reduce=lambda v: v.mean((2, 3)), indices=range(16)
    )
    assert same.complete  # the data's own order, written as indices, is the same order


def test_bad_options_are_named_before_anything_runs(tmp_path: Path) -> None:
    model, x = nn.Sequential(nn.Linear(4, 2)), torch.randn(8, 4)
    with pytest.raises(hs.SpecError, match="compression_level=99 is not a zstd level"):
        run(model, x, "0", tmp_path / "f.zarr", compression_level=99)
    with pytest.raises(hs.SpecError, match="device='gpu' is not a torch device"):
        run(model, x, "0", tmp_path / "f.zarr", device="gpu")
    with pytest.raises(hs.SpecError, match="must be integers"):
        run(model, x, "0", tmp_path / "f.zarr", indices=["a"])
    with pytest.raises(hs.SpecError, match="each worker yield the whole IterableDataset"):
        run(model, Stream(x), "0", tmp_path / "f.zarr", num_workers=2)
    assert not (tmp_path / "f.zarr").exists()


class Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.rows)


def test_a_resumed_stream_that_ends_early_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    rows = torch.randn(32, 4)

    def batches(stop: int, fail: bool) -> Iterator[torch.Tensor]:
        for start in range(0, stop, 4):
            if fail and start == 28:
                raise RuntimeError("cut")
            yield rows[start : start + 4]

    with pytest.raises(RuntimeError, match="cut"):
        run(model, batches(32, fail=True), "0", tmp_path / "f.zarr", chunk_rows=8)
    with pytest.raises(hs.DataError, match="the data ended at row 12, but the store holds 24 rows") as info:
        run(model, batches(12, fail=False), "0", tmp_path / "f.zarr", chunk_rows=8)
    assert info.value.rows == range(12, 24)
    assert len(run(model, Stream(rows), "0", tmp_path / "s.zarr", batch_size=4)) == 32


def test_a_complete_store_is_not_computed_again(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    images = torch.randn(32, 3, 32, 32)
    run(model, images, "fc", tmp_path / "f.zarr", batch_size=8)
    before = store_files(tmp_path / "f.zarr")
    forwards = []
    with hs.hooks(model, {"": lambda module, args, output: forwards.append(1)}):
        again = run(model, images, "fc", tmp_path / "f.zarr", batch_size=8)
    assert again.complete
    assert forwards == []  # the configuration is compared without running the model
    assert store_files(tmp_path / "f.zarr") == before


class FullDisk(zarr.storage.WrapperStore[Any]):
    """A store that fails like a full disk after ``room`` data chunks have been written."""

    def __init__(self, store: Any, room: int) -> None:
        super().__init__(store)
        self.room = room

    async def set(self, key: str, value: Any) -> None:
        if "/c/" in key and not key.startswith("_"):  # the sites' chunks, not the manifest's or the row index's
            if self.room == 0:
                raise OSError(28, "No space left on device")
            self.room -= 1
        await super().set(key, value)


def test_disk_full_part_way_keeps_a_truthful_manifest_and_resumes(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    images = torch.randn(48, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    run(model, images, ["conv1", "fc"], tmp_path / "whole.zarr", batch_size=8, chunk_rows=8)
    full = FullDisk(zarr.storage.LocalStore(tmp_path / "f.zarr"), room=5)  # chunks 0, 1 whole; 2 half
    with pytest.raises(hs.StoreWriteError, match=r"No space left on device; 2 of 6 chunks are recorded as done"):
        run(model, images, ["conv1", "fc"], full, batch_size=8, chunk_rows=8)
    assert not attached(model)
    assert no_writer_thread()
    assert hs.open_store(tmp_path / "f.zarr", partial=True).done_chunks() == {0, 1}
    resumed = run(model, images, ["conv1", "fc"], tmp_path / "f.zarr", batch_size=8, chunk_rows=8)
    assert resumed.complete
    assert store_files(tmp_path / "f.zarr") == store_files(tmp_path / "whole.zarr")


@pytest.mark.transformers
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_through_pinned_copies_equal_the_forward(tmp_path: Path) -> None:
    model = tiny_gpt2().cuda()
    ids = torch.randint(0, 64, (40, 8), generator=torch.Generator().manual_seed(0))
    store = run(model, ids, ["h.0", "ln_f"], tmp_path / "f.zarr", batch_size=8, chunk_rows=16, dtype="bf16")
    with torch.no_grad():
        expected = model(ids.cuda()).last_hidden_state.to(torch.bfloat16).cpu()
    assert torch.equal(store.torch("ln_f"), expected)
    assert store["h.0"].shape == (40, 8, 32)


def test_train_mode_is_restored_and_dropout_is_off(tmp_path: Path) -> None:
    model = track(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))).train()
    x = torch.ones(16, 4)
    store = run(model, x, "1", tmp_path / "f.zarr", batch_size=8)
    assert model.training
    assert model[1].training
    assert np.allclose(store["1"][:], model.eval()(x).detach().numpy())


# -- reading the store ----------------------------------------------------------------------------


def test_plain_zarr_reads_the_store(tmp_path: Path) -> None:
    model = SmallCNN().eval()
    run(model, torch.randn(10, 3, 32, 32), ["conv1", "fc"], tmp_path / "f.zarr", batch_size=5)
    group = zarr.open_group(tmp_path / "f.zarr", mode="r")
    assert sorted(group.array_keys()) == ["conv1", "fc"]
    fc = group["fc"]
    assert fc.shape == (10, 10)
    assert fc.chunks == (10, 10)
    assert fc.metadata.dimension_names == ("row", "fc.1")
    meta = group.attrs["hookscope"]
    assert meta["state"] == "complete"
    assert meta["rows"] == 10
    assert meta["versions"]["zarr"] == zarr.__version__
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["config"]["model"]["class"].endswith("SmallCNN")
    assert meta["command"]
    assert fc.compressors[0].to_dict()["name"] == "zstd"


def test_store_lookup_repr_and_html(tmp_path: Path) -> None:
    store = run(SmallCNN().eval(), torch.randn(4, 3, 32, 32), ["conv1", "fc"], tmp_path / "f.zarr")
    assert store["fc#0:output"].site == "fc#0:output"
    assert "fc" in store
    with pytest.raises(hs.SiteNotFoundError, match="did you mean 'fc'"):
        store["fcc"]
    text = repr(store)
    assert "4 rows, 2 sites, complete" in text
    assert "(N, 16, 30, 30)" in text
    assert "<table>" in store._repr_html_()
    assert np.asarray(store["fc"]).shape == (4, 10)


def test_to_hf_dataset(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    store = run(SmallCNN().eval(), torch.randn(6, 3, 32, 32), ["pool", "fc"], tmp_path / "f.zarr", dtype="bfloat16")
    dataset = store.to_hf_dataset(cache_dir=str(tmp_path / "hf-cache"))
    assert len(dataset) == 6
    assert dataset.column_names == ["pool", "fc", "row_index"]  # what each row is (tokens too, where kept)
    assert np.allclose(np.asarray(dataset[2]["fc"]), store["fc"][2])
    assert np.asarray(dataset[0]["pool"]).shape == (16, 1, 1)


def test_open_store_refuses_what_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(hs.StoreError, match="holds nothing"):
        hs.open_store(tmp_path / "missing.zarr")


PROGRESS_LINE = re.compile(
    r"^extract → f\.zarr: (?P<rows>[\d,]+)/(?P<total>[\d,]+) rows \((?P<percent>\d+)%\), [\d,]+ rows/s, "
    r"(?:ETA \d+:\d\d:\d\d|done in \d+:\d\d:\d\d), (?P<bytes>[\d.]+ (?:B|KiB|MiB)) written$"
)


def test_progress_asked_for_off_a_terminal_writes_plain_lines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOKSCOPE_PROGRESS_INTERVAL", "0")  # a line after every batch
    model = track(nn.Sequential(nn.Linear(4, 3)))
    rows = torch.randn(10, 4)
    store = hs.extract(model, rows, tmp_path / "f.zarr", layers="0", batch_size=4, progress=True)
    err = capsys.readouterr().err
    assert "\x1b" not in err  # no colours, no cursor movement: a log file stays readable
    lines = err.splitlines()
    found = [PROGRESS_LINE.match(line) for line in lines]
    assert all(found), lines
    assert [(m["rows"], m["total"], m["percent"]) for m in found if m] == [
        ("4", "10", "40"),
        ("8", "10", "80"),
        ("10", "10", "100"),
        ("10", "10", "100"),  # the last line, once the writer is done
    ]
    assert lines[-1].split(", ")[2].startswith("done in")
    assert np.allclose(store["0"][:], model(rows).detach().numpy(), atol=1e-6)


def test_progress_lines_are_spaced_and_silent_unless_asked_for(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HOOKSCOPE_PROGRESS_INTERVAL", raising=False)
    model = track(nn.Sequential(nn.Linear(4, 3)))
    hs.extract(model, torch.randn(10, 4), tmp_path / "f.zarr", layers="0", batch_size=2, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1  # 10 s between lines: a run this short has only its last one
    assert lines[0].startswith("extract → f.zarr: 10/10 rows (100%)")
    hs.extract(model, torch.randn(10, 4), tmp_path / "g.zarr", layers="0", batch_size=2)  # progress=None: no terminal
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("HOOKSCOPE_PROGRESS_INTERVAL", "soon")
    with pytest.raises(hs.SpecError, match=r"HOOKSCOPE_PROGRESS_INTERVAL='soon' is not a number of seconds"):
        hs.extract(model, torch.randn(10, 4), tmp_path / "h.zarr", layers="0", batch_size=2, progress=True)
