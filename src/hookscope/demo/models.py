"""Small models that ship with hookscope, so the demo and the docs need nothing downloaded."""

from __future__ import annotations

from importlib import resources
from typing import ClassVar

import torch
from torch import nn

from hookscope.demo.shapes import CLASSES, make_shapes
from hookscope.errors import SpecError

__all__ = ["ShapesCNN", "SmallCNN", "load_shapes_cnn"]

WEIGHTS_FILE = "shapes_cnn.safetensors"


class SmallCNN(nn.Module):
    """The classic first model to hook: ``conv1 = Conv2d(3, 16, 3)``, ReLU, pooling, a classifier.

    Takes ``(N, 3, H, W)`` images (the demo uses ``torch.randn(1, 3, 32, 32)``) and returns
    ``(N, num_classes)`` logits.

    >>> SmallCNN()(torch.randn(1, 3, 32, 32)).shape
    torch.Size([1, 10])
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.pool(self.relu(self.conv1(x)))
        logits: torch.Tensor = self.fc(torch.flatten(features, 1))
        return logits


class ShapesCNN(nn.Module):
    """Three conv blocks and a linear head, small enough to train in seconds on the shape images.

    Random weights show noise in their feature maps; trained ones (:func:`load_shapes_cnn`) show edges,
    corners and stripes, which is what the demo and the report are meant to let one see. Each stage is a
    named attribute (``conv1`` ... ``fc``), so the layer names read well in tables and reports.

    >>> ShapesCNN()(torch.randn(*ShapesCNN.example_input_shape)).shape
    torch.Size([1, 4])
    """

    example_input_shape: ClassVar[tuple[int, int, int, int]] = (1, 3, 32, 32)
    class_names: ClassVar[tuple[str, ...]] = CLASSES

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(16, 32, 3, padding=1)
        self.relu3 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, len(CLASSES))

    def sample_input(self, shape: tuple[int, ...], *, seed: int = 0) -> torch.Tensor:
        """Generated shape images of ``shape`` ``(N, 3, S, S)``: what the command line feeds this model
        instead of noise, so its feature maps and predictions mean something.

        >>> ShapesCNN().sample_input((2, 3, 32, 32)).shape
        torch.Size([2, 3, 32, 32])
        """
        if len(shape) != 4 or shape[1] != 3 or shape[2] != shape[3]:
            raise SpecError(f"input shape {shape}: ShapesCNN takes square RGB images, e.g. 4x3x32x32")
        images, _ = make_shapes(shape[0], seed=seed, size=shape[2])
        return images

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = self.pool(self.relu3(self.conv3(x)))
        logits: torch.Tensor = self.fc(torch.flatten(x, 1))
        return logits


def load_shapes_cnn() -> ShapesCNN:
    """The :class:`ShapesCNN` with the weights shipped in the package, in eval mode.

    The weights come from ``python -m hookscope.demo.train`` (seed 0) and classify 99.25% of 2,000 freshly
    generated :func:`~hookscope.demo.shapes.make_shapes` images (seed 1) correctly; the file's metadata
    records the seed, the epochs and that accuracy. safetensors is imported here, not at module import, to keep
    ``import hookscope`` light.

    >>> from hookscope.demo.shapes import make_shapes
    >>> images, labels = make_shapes(200, seed=12345)
    >>> (load_shapes_cnn()(images).argmax(1) == labels).float().mean().item() > 0.9
    True
    """
    from safetensors.torch import load

    model = ShapesCNN()
    model.load_state_dict(load(resources.files("hookscope.demo").joinpath(WEIGHTS_FILE).read_bytes()))
    return model.eval()
