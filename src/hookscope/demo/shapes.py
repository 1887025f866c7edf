"""Procedural shape images, so the demo model can be trained and checked offline and in seconds.

Four classes (:data:`CLASSES`) drawn with random position, size, colours, rotation and noise. The
circle, square and triangle of one size have the same area, and every shape fits the same centre box,
so neither brightness nor position gives the class away: a model has to look at edges and corners,
which is what makes its feature maps worth showing.
"""

from __future__ import annotations

import math

import torch

from hookscope._shared.names import public_dir
from hookscope.errors import SpecError

__all__ = ["CLASSES", "make_shapes"]

CLASSES = ("circle", "square", "triangle", "stripes")

# Fixed, data-independent normalisation: a batch's statistics would make images depend on their batch.
_MEAN = 0.5
_STD = 0.25
# Side and inradius that give a square and an equilateral triangle the area of a circle of radius 1.
_SQUARE_HALF_SIDE = math.sqrt(math.pi) / 2
_TRIANGLE_INRADIUS = math.sqrt(math.pi / (3 * math.sqrt(3)))
# The triangle's circumradius (twice its inradius) is the widest reach of any shape from its centre.
_REACH = 2 * _TRIANGLE_INRADIUS


def make_shapes(count: int, *, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images ``(count, 3, size, size)`` float32 and their int64 labels, indices into :data:`CLASSES`.

    Labels are balanced (class counts differ by at most one) and shuffled. Pixels are normalised to
    ``(x - 0.5) / 0.25``, so images are roughly zero-mean with unit-ish scale. The same ``seed`` gives
    the same images on every run; the global RNG state is neither read nor changed.

    >>> images, labels = make_shapes(8, seed=0)
    >>> images.shape, images.dtype, labels.dtype
    (torch.Size([8, 3, 32, 32]), torch.float32, torch.int64)
    >>> labels.bincount().tolist()
    [2, 2, 2, 2]
    >>> torch.equal(images, make_shapes(8, seed=0)[0])
    True
    """
    if count < 0:
        raise SpecError(f"count={count}: the number of images must be >= 0")
    if size < 4:
        raise SpecError(f"size={size}: images must be at least 4 pixels wide, to hold a shape")
    gen = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen) * (high - low) + low

    labels = (torch.arange(count) % len(CLASSES))[torch.randperm(count, generator=gen)]

    # Pixel centres in [-1, 1], one pixel 2 / size wide.
    axis = (torch.arange(size, dtype=torch.float32) + 0.5) * (2 / size) - 1
    y, x = torch.meshgrid(axis, axis, indexing="ij")

    radius = uniform(0.3, 0.5, count, 1, 1)
    box = 1 - _REACH * radius  # every shape stays inside the image
    cx = uniform(-1, 1, count, 1, 1) * box
    cy = uniform(-1, 1, count, 1, 1) * box
    angle = uniform(0, 2 * math.pi, count, 1, 1)
    dx, dy = x - cx, y - cy
    cos, sin = torch.cos(angle), torch.sin(angle)
    u, v = cos * dx + sin * dy, cos * dy - sin * dx  # coordinates in the shape's rotated frame

    # Signed distance to the outline (negative inside), one formula per class, each on its own images.
    distance = torch.empty(count, size, size)
    circle, square, triangle, stripes = (labels == k for k in range(len(CLASSES)))
    distance[circle] = torch.sqrt(dx[circle] ** 2 + dy[circle] ** 2) - radius[circle]
    distance[square] = torch.maximum(u[square].abs(), v[square].abs()) - _SQUARE_HALF_SIDE * radius[square]
    # The triangle is where all three edge normals (at 0, 120 and 240 degrees) are within the inradius.
    normals = [(math.cos(k * 2 * math.pi / 3), math.sin(k * 2 * math.pi / 3)) for k in range(3)]
    tu, tv = u[triangle], v[triangle]
    reach = torch.stack([tu * nu + tv * nv for nu, nv in normals]).amax(0)
    distance[triangle] = reach - _TRIANGLE_INRADIUS * radius[triangle]
    # Stripes fill the image at the shape's angle, 4 to 10 pixels a period at size 32. The sine is
    # scaled so that its slope at a crossing is one, like a distance's.
    period = uniform(0.25, 0.6, count, 1, 1)[stripes]
    phase = uniform(0, 2 * math.pi, count, 1, 1)[stripes]
    distance[stripes] = torch.sin(2 * math.pi * u[stripes] / period + phase) * (period / (2 * math.pi))
    # Edges soft over about a pixel, as a camera would blur them, so no feature rests on aliasing.
    mask = torch.sigmoid(-distance * (2 * size)).unsqueeze(1)

    # The foreground is lighter than the background in every channel, or darker in every channel
    # (whichever leaves more room), by 0.3 to 0.6 a channel before clipping: the colours vary freely,
    # but an edge always has one polarity, as in photographs of objects.
    background = uniform(0, 1, count, 3, 1, 1)
    delta = uniform(0.3, 0.6, count, 3, 1, 1)
    sign = torch.where(background.mean(1, keepdim=True) > 0.5, -1.0, 1.0)
    foreground = (background + sign * delta).clamp(0, 1)
    images = background + (foreground - background) * mask
    images = images + torch.randn(images.shape, generator=gen) * uniform(0.02, 0.1, count, 1, 1, 1)
    return ((images - _MEAN) / _STD).float(), labels


def __dir__() -> list[str]:
    """``__all__``, the dunders and public submodules, not the imports: what tab completion offers."""
    return public_dir(__name__)
