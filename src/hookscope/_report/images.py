"""Figures as ``data:`` URIs, so the report's images live inside the one HTML file."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

__all__ = ["Image", "embed"]

DPI = 90  # sharp enough on screen; a 16-panel histogram figure stays near 100 KB


@dataclass(frozen=True)
class Image:
    """One embedded figure: its ``data:`` URI, alt text and caption (both escaped by the template)."""

    uri: str
    alt: str
    caption: str = ""


def embed(fig: Any, alt: str, caption: str = "") -> Image:
    """Render ``fig`` to PNG and wrap it as an :class:`Image`; the figure is released after."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    fig.clear()  # pyplot-free figures are freed with their last reference; clear drops the artists now
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return Image(f"data:image/png;base64,{encoded}", alt, caption)
