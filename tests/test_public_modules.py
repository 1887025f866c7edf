"""Utilities in public submodules; their old names on ``hs`` warn once and still work."""

from __future__ import annotations

import importlib
import pickle
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import hookscope as hs
from hookscope import io, sinks, tensors

MOVED = {
    "io": ["check_output_path", "load_tensors", "save_tensors", "tensor_file_format"],
    "sinks": ["CsvSink", "JsonLinesSink", "MLflowSink", "TensorBoardSink", "WandbSink"],
    "tensors": ["dtype_name", "flatten_tensors", "map_tensors", "parse_dtype", "tensor_stats"],
}
PAIRS = [(module, name) for module, names in MOVED.items() for name in names]


@pytest.mark.parametrize(("module", "name"), PAIRS)
def test_a_moved_name_warns_once_naming_its_home_and_is_the_same_object(module: str, name: str) -> None:
    hs._warned.discard(name)  # another test may have read it first
    home = importlib.import_module(f"hookscope.{module}")
    with pytest.warns(FutureWarning, match=rf"hs\.{name} is now hookscope\.{module}\.{name}"):
        old = getattr(hs, name)
    assert old is getattr(home, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second read is silent
        assert getattr(hs, name) is old


@pytest.mark.parametrize(("module", "name"), PAIRS)
def test_moved_names_left_the_root_and_belong_to_their_module(module: str, name: str) -> None:
    assert name not in hs.__all__
    assert name not in dir(hs)
    home = importlib.import_module(f"hookscope.{module}")
    assert home.__all__ == sorted(home.__all__)
    assert name in home.__all__
    assert name in dir(home)
    assert getattr(home, name).__module__ == f"hookscope.{module}"


def test_the_root_offers_the_new_modules_and_far_fewer_names() -> None:
    assert {"io", "sinks", "tensors"} <= set(dir(hs))
    assert len(hs.__all__) <= 102  # 100 after the house issue, + verify and VerifyReport


def test_moved_objects_pickle_under_their_new_names(tmp_path: pytest.TempPathFactory) -> None:
    stats = tensors.tensor_stats(torch.arange(4.0))
    assert pickle.loads(pickle.dumps(stats)) == stats
    assert pickle.loads(pickle.dumps(tensors.tensor_stats)) is tensors.tensor_stats
    assert pickle.loads(pickle.dumps(sinks.CsvSink)) is sinks.CsvSink
    assert pickle.loads(pickle.dumps(io.save_tensors)) is io.save_tensors


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'save_tensor'"):
        hs.save_tensor  # noqa: B018


# -- one selection keyword: layers= -------------------------------------------------------------


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).eval()


def test_extract_takes_out_positionally_and_layers_by_keyword(tmp_path: Any) -> None:
    model, rows = small_model(), torch.randn(6, 4)
    new = hs.extract(model, rows, tmp_path / "new.zarr", layers="0", progress=False)
    with pytest.warns(FutureWarning, match=r"hs\.extract: give the layers as layers="):
        old = hs.extract(model, rows, "0", tmp_path / "old.zarr", progress=False)
    with pytest.warns(FutureWarning, match=r"hs\.extract"):
        mixed = hs.extract(model, rows, "0", out=tmp_path / "mixed.zarr", progress=False)
    reference = model[0](rows).detach().numpy()
    for store in (new, old, mixed):
        np.testing.assert_array_equal(store["0"][:], reference)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "needs layers= and out"),
        (("f.zarr",), {}, "needs layers="),
        (("0", "f.zarr"), {"out": "g.zarr"}, "out twice"),
        (("f.zarr",), {"layers": "0", "out": "g.zarr"}, "out twice"),
        (("0", "f.zarr"), {"layers": "0"}, "positionally and as layers="),
        (("0", "f.zarr", "x"), {}, "5 positional arguments"),
    ],
)
def test_extract_refuses_layers_and_out_given_twice_or_not_at_all(
    tmp_path: Any, args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(hs.SpecError, match=message):
            hs.extract(small_model(), torch.randn(2, 4), *args, progress=False, **kwargs)


def train_step(model: torch.nn.Module, watcher: Any) -> None:
    model.train()
    model(torch.randn(5, 4)).pow(2).sum().backward()
    watcher.step()


def test_monitor_and_watch_grads_take_layers_by_keyword_and_warn_on_positional() -> None:
    model = small_model()
    with pytest.warns(FutureWarning, match=r"hs\.monitor: give the layers as layers="), hs.monitor(model, "0") as old:
        train_step(model, old)
    model.zero_grad()
    with hs.monitor(model, layers="0") as new:
        train_step(model, new)
    assert old.steps[-1].scalars.keys() == new.steps[-1].scalars.keys()
    assert any("/0" in key for key in new.steps[-1].scalars)
    with pytest.raises(hs.SpecError, match="positionally and as layers="):
        hs.monitor(model, "0", layers="0")
    with pytest.warns(FutureWarning, match=r"hs\.watch_grads"), hs.watch_grads(model, "0", "1") as grads:
        train_step(model, grads)
    assert {record.module for record in grads.records[-1].records if record.what != "param"} == {"0", "1"}


def test_patch_sweep_and_attribution_patch_take_layers_and_warn_on_sites() -> None:
    model = small_model()
    clean, corrupted = torch.randn(2, 3, 4), torch.randn(2, 3, 4)

    def metric(out: torch.Tensor) -> torch.Tensor:
        return out[:, -1, 0]

    new = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, layers=["0"])
    with pytest.warns(FutureWarning, match="sites= is now layers="):
        old = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, sites=["0"])
    assert torch.equal(new.values, old.values)
    with pytest.warns(FutureWarning, match="sites= is now layers="):
        atp = hs.methods.attribution_patch(model, clean, corrupted, metric=metric, sites=["0"])
    assert atp.values.shape == new.values.shape
