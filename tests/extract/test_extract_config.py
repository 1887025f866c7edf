"""``ExtractConfig`` holds a ``CaptureOptions``: keywords go into it, a versioned dict round-trips,
and the dicts and stores written before it still read and resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import zarr
from torch import nn

import hookscope as hs
from hookscope.errors import SpecError
from tests.models import SharedTwice

GOLDEN = Path(__file__).parents[1] / "golden" / "store_format2_partial.zarr"


def test_capture_keywords_go_into_the_capture_options_it_holds() -> None:
    config = hs.ExtractConfig(keep="input", calls=[2, 0], dtype="fp16", overflow="error", mask=None, batch_size=2)
    assert config.capture == hs.CaptureOptions(
        keep="input", calls=(0, 2), dtype=torch.float16, overflow="error", token_mask=None
    )
    assert (config.keep, config.calls, config.dtype, config.overflow, config.mask) == (
        "input",
        (0, 2),
        torch.float16,
        "error",
        None,
    )
    whole = hs.ExtractConfig(capture=hs.CaptureOptions(keep="input", calls=[0, 2], dtype="float16", overflow="error"))
    assert whole.capture == hs.ExtractConfig(keep="input", calls=(0, 2), dtype="fp16", overflow="error").capture
    assert hs.ExtractConfig(capture=whole.capture, keep="output").capture.keep == "output"  # a keyword wins


@pytest.mark.parametrize(
    ("capture", "name"),
    [
        ({"grads": True}, "grads"),
        ({"reduce": "mean:1"}, "reduce"),
        ({"stop": True}, "stop"),
        ({"detach": False}, "detach"),
    ],
)
def test_capture_options_an_extraction_does_not_take_are_refused(capture: dict[str, object], name: str) -> None:
    with pytest.raises(SpecError, match=rf"capture option {name}=.* is not one an extraction takes"):
        hs.ExtractConfig(capture=hs.CaptureOptions(**capture))  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"capture= takes a CaptureOptions"):
        hs.ExtractConfig(capture={"keep": "input"})  # type: ignore[arg-type]


def test_a_versioned_dict_round_trips_and_version_1_still_reads() -> None:
    config = hs.ExtractConfig(dtype="bf16", calls="first", reduce={"fc": "mean:1"}, batch_size=4, tokens=False)
    stored = json.loads(json.dumps(config.to_dict()))
    assert stored["version"] == 2
    assert stored["capture"]["dtype"] == "bfloat16"
    assert hs.ExtractConfig.from_dict(stored) == config
    # as ExtractConfig.to_dict() wrote it before it held a CaptureOptions: the capture's options flat
    version_1 = {
        "version": 1,
        "reduce": {"fc": "mean:1"},
        "dtype": "bfloat16",
        "device": None,
        "batch_size": 4,
        "num_workers": None,
        "chunk_rows": None,
        "keep": "output",
        "calls": "first",
        "mask": "auto",
        "inputs": None,
        "indices": None,
        "progress": None,
        "resume": True,
        "overwrite": False,
        "eval_mode": True,
        "compression_level": 3,
        "model_spec": None,
        "rank": None,
        "world_size": None,
        "command": None,
        "overflow": "warn",
        "storage_options": None,
        "tokens": False,
    }
    assert hs.ExtractConfig.from_dict(version_1) == config
    with pytest.raises(SpecError, match="ExtractConfig of version 99"):
        hs.ExtractConfig.from_dict({**stored, "version": 99})


def test_a_stores_recorded_configuration_reads_as_the_options_that_resume_it(tmp_path: Path) -> None:
    out = tmp_path / "old.zarr"
    shutil.copytree(GOLDEN, out)
    recorded = hs.open_store(out, partial=True).meta["config"]
    config = hs.ExtractConfig.from_dict(recorded)
    assert (config.batch_size, config.chunk_rows, config.mask, config.keep, config.calls) == (
        4,
        8,
        "auto",
        "output",
        "all",
    )
    assert config.model_spec == "torch.nn.modules.container.Sequential"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    rows = torch.randn(24, 4, generator=torch.Generator().manual_seed(9))
    store = hs.extract(model, rows, out, layers="0", options=config, progress=False, command="old run")
    assert store.complete
    assert store.written_rows == 16  # chunk 0 was the golden store's


def test_a_function_reduction_in_a_stores_record_is_named_not_guessed() -> None:
    record = {"model": {"spec": "m"}, "reduce": {"fc": "tests.my_reduce 0123abcd"}}
    with pytest.raises(SpecError, match=r"the store reduced 'fc' with .*a function that a record cannot hold"):
        hs.ExtractConfig.from_dict(record)


def test_calls_recorded_as_given_still_resume(tmp_path: Path) -> None:
    """A store made before the extraction held its capture's options recorded ``calls`` as given."""
    model = SharedTwice()
    rows = torch.randn(8, 4)
    out = tmp_path / "f.zarr"
    store = hs.extract(model, rows, out, layers="shared", calls=[1, 0], batch_size=4, progress=False)
    assert store.meta["config"]["calls"] == [0, 1]
    group = zarr.open_group(out, mode="r+")
    meta = dict(group.attrs["hookscope"])
    group.attrs["hookscope"] = {**meta, "config": {**meta["config"], "calls": [1, 0]}}  # as it was written then
    again = hs.extract(model, rows, out, layers="shared", calls=[1, 0], batch_size=4, progress=False)
    assert again.written_rows == 0
