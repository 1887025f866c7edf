"""Utilities in public submodules; their old names on ``hs`` warn once and still work."""

from __future__ import annotations

import importlib
import pickle
import warnings

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
    assert len(hs.__all__) <= 100


def test_moved_objects_pickle_under_their_new_names(tmp_path: pytest.TempPathFactory) -> None:
    stats = tensors.tensor_stats(torch.arange(4.0))
    assert pickle.loads(pickle.dumps(stats)) == stats
    assert pickle.loads(pickle.dumps(tensors.tensor_stats)) is tensors.tensor_stats
    assert pickle.loads(pickle.dumps(sinks.CsvSink)) is sinks.CsvSink
    assert pickle.loads(pickle.dumps(io.save_tensors)) is io.save_tensors


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'save_tensor'"):
        hs.save_tensor  # noqa: B018
