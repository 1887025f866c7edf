"""accelerate's offloaded models: weights on ``meta`` until accelerate's hook moves them in.

Hooks see every activation (accelerate swaps the weights in inside ``forward``), so capture and
trace give the plain model's values; what reads *weights* outside the forward reads them where
accelerate keeps them (:mod:`hookscope._core.compat.offload`), or refuses with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._core.compat.offload import named_real_tensors, real_value
from hookscope._extract.config import fingerprint
from hookscope.errors import UnsupportedModelError

accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:accelerate")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), block, nn.Linear(16, 4)).eval()


def gpt2(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


Offload = Callable[[nn.Module, Path], nn.Module]

RECIPES: dict[str, Offload] = {
    "cpu_offload": lambda model, _: accelerate.cpu_offload(model, execution_device=torch.device("cpu")),
    "disk_offload": lambda model, folder: accelerate.disk_offload(model, offload_dir=folder, execution_device="cpu"),
    # main_device as a device object: the "cpu" entries are offloaded too (a CPU-only machine has no other)
    "device_map": lambda model, folder: accelerate.dispatch_model(
        model,
        device_map={name: ("disk" if index % 2 else "cpu") for index, (name, _) in enumerate(model.named_children())},
        offload_dir=folder,
        main_device=torch.device("cpu"),
    ),
}


@pytest.fixture(params=sorted(RECIPES))
def recipe(request: pytest.FixtureRequest) -> Offload:
    return RECIPES[request.param]


def test_offloaded_weights_are_meta_outside_the_forward(recipe: Offload, tmp_path: Path) -> None:
    model = recipe(mlp(), tmp_path)
    assert all(parameter.is_meta for parameter in model.parameters())


@pytest.mark.slow
def test_capture_and_trace_equal_the_plain_model(recipe: Offload, tmp_path: Path) -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    plain = mlp()
    with hs.capture(plain, "*") as expected:
        plain(x)
    offloaded = recipe(mlp(), tmp_path)
    with hs.capture(offloaded, "*") as cap:
        offloaded(x)
    assert sorted(cap) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(cap[key], expected[key])
    plain_rows = {row.name: row.outputs[0].stats for row in hs.trace(plain, x).rows}
    for row in hs.trace(offloaded, x).rows:
        got, want = row.outputs[0].stats, plain_rows[row.name]
        assert got is not None
        assert want is not None
        assert got.mean == pytest.approx(want.mean, abs=1e-6)
        assert got.std == pytest.approx(want.std, rel=1e-5)
    assert hs.layers(offloaded).total_params == hs.layers(plain).total_params


def test_real_values_are_read_where_accelerate_keeps_them(recipe: Offload, tmp_path: Path) -> None:
    plain = dict(mlp().state_dict())
    offloaded = recipe(mlp(), tmp_path)
    found = dict(named_real_tensors(offloaded))
    assert sorted(found) == sorted(plain)
    for name, value in found.items():
        assert not value.is_meta
        torch.testing.assert_close(value, plain[name])


def test_the_fingerprint_tells_other_offloaded_weights_apart(recipe: Offload, tmp_path: Path) -> None:
    """A resumed extract compares fingerprints: meta weights hashed as nothing would make two
    different offloaded models look alike, and the second would resume the first's store."""
    first = fingerprint(recipe(mlp(seed=0), tmp_path / "a"))
    assert first == fingerprint(mlp(seed=0))
    assert first != fingerprint(recipe(mlp(seed=1), tmp_path / "b"))


def test_parameter_gradients_of_offloaded_weights_are_refused(tmp_path: Path) -> None:
    offloaded = RECIPES["cpu_offload"](mlp(), tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"meta device.*params=False"):
        hs.watch_grads(offloaded)
    x = torch.randn(3, 8, requires_grad=True)
    with hs.watch_grads(offloaded, params=False) as monitor:
        offloaded(x).sum().backward()
        step = monitor.step()
    assert step is not None
    assert {record.module for record in step.records} >= {"0", "2.0", "3"}


def test_a_meta_weight_nobody_holds_is_named() -> None:
    with torch.device("meta"):
        layer = nn.Linear(2, 2)
    with pytest.raises(UnsupportedModelError, match="'weight' is on the meta device"):
        real_value(layer, "weight", layer.weight)


@pytest.mark.slow
@pytest.mark.transformers
def test_gpt2_offloaded_captures_and_diffs_as_the_plain_model(tmp_path: Path) -> None:
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    plain = gpt2()
    with hs.capture(plain, ["transformer.h.*", "lm_head"]) as expected:
        plain(ids)
    offloaded = RECIPES["device_map"](gpt2(), tmp_path)
    with hs.capture(offloaded, ["transformer.h.*", "lm_head"]) as cap:
        offloaded(ids)
    for key in expected:
        torch.testing.assert_close(cap[key], expected[key])
    assert hs.diff(plain, offloaded, ids).within()
    assert hs.diff.dtypes(offloaded, ids, torch.bfloat16, autocast=True).rows  # autocast on the execution device
