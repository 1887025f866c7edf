"""Small models that ship with hookscope, so the demo and the docs need nothing downloaded."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmallCNN"]


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
