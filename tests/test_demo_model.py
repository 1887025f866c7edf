"""The trained demo model: the shape generator, the shipped weights, and the script that makes them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hookscope.demo.models import WEIGHTS_FILE, ShapesCNN, load_shapes_cnn
from hookscope.demo.shapes import CLASSES, make_shapes
from hookscope.demo.train import EPOCHS, accuracy, main, train
from hookscope.errors import SpecError

# Training uses seed 0 for its images and seed 1 for its test images; this one is neither.
HOLDOUT_SEED = 12345


def shipped_metadata() -> dict[str, str]:
    with resources.as_file(resources.files("hookscope.demo").joinpath(WEIGHTS_FILE)) as path:
        return read_metadata(path)


def read_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as file:
        metadata: dict[str, str] = file.metadata()
    return metadata


def test_shapes_have_the_documented_shape_dtype_and_scale() -> None:
    images, labels = make_shapes(100, seed=0, size=24)
    assert images.shape == (100, 3, 24, 24)
    assert images.dtype == torch.float32
    assert labels.shape == (100,)
    assert labels.dtype == torch.int64
    assert images.isfinite().all()
    assert abs(images.mean().item()) < 0.5
    assert 0.5 < images.std().item() < 2


@pytest.mark.parametrize("count", [0, 1, 7, 1001])
def test_labels_are_balanced(count: int) -> None:
    counts = make_shapes(count, seed=3)[1].bincount(minlength=len(CLASSES))
    assert len(counts) == len(CLASSES)
    assert counts.sum().item() == count
    assert counts.max().item() - counts.min().item() <= 1


def test_same_seed_same_images_and_global_rng_untouched() -> None:
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    first = make_shapes(64, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    second = make_shapes(64, seed=5)
    other = make_shapes(64, seed=6)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize(("count", "size"), [(-1, 32), (4, 3)])
def test_bad_arguments_are_refused(count: int, size: int) -> None:
    with pytest.raises(SpecError, match="must be"):
        make_shapes(count, seed=0, size=size)


def test_model_layers_and_class_attributes() -> None:
    model = ShapesCNN()
    names = [name for name, _ in model.named_children()]
    assert names == ["conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "conv3", "relu3", "pool", "fc"]
    assert ShapesCNN.class_names == CLASSES
    assert model(torch.randn(*ShapesCNN.example_input_shape)).shape == (1, len(CLASSES))


def test_shipped_weights_load_in_eval_mode_and_are_small() -> None:
    model = load_shapes_cnn()
    assert not model.training
    assert all(not module.training for module in model.modules())
    assert len(resources.files("hookscope.demo").joinpath(WEIGHTS_FILE).read_bytes()) < 1_000_000


def test_shipped_weights_classify_new_images() -> None:
    images, labels = make_shapes(2000, seed=HOLDOUT_SEED)
    result = accuracy(load_shapes_cnn(), images, labels)
    metadata = shipped_metadata()
    assert result > 0.9
    assert result >= float(metadata["test_accuracy"]) - 0.02
    assert metadata["seed"] == "0"
    assert metadata["epochs"] == str(EPOCHS)


def test_accuracy_restores_the_training_flag() -> None:
    model = ShapesCNN().train()
    images, labels = make_shapes(8, seed=0)
    assert 0 <= accuracy(model, images, labels) <= 1
    assert model.training


@pytest.mark.slow
def test_main_writes_a_loadable_file_atomically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "weights" / "model.safetensors"
    assert main(["--out", str(out), "--epochs", "1", "--seed", "4"]) == 0
    assert [path.name for path in out.parent.iterdir()] == [out.name]
    metadata = read_metadata(out)
    assert metadata["seed"] == "4"
    assert metadata["epochs"] == "1"
    assert 0 <= float(metadata["test_accuracy"]) <= 1
    ShapesCNN().load_state_dict(load_file(out))
    printed = capsys.readouterr().out
    assert "epoch 1/1" in printed
    assert f"wrote {out}" in printed


def test_main_refuses_zero_epochs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x.safetensors"), "--epochs", "0"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_default_training_is_accurate_and_leaves_the_rng_alone() -> None:
    lines: list[str] = []
    torch.manual_seed(11)
    before = torch.random.get_rng_state()
    model, result = train(write=lines.append)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert result > 0.9
    assert not model.training
    assert len(lines) == EPOCHS + 1
