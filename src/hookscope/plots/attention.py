"""Attention patterns as heatmaps: queries down, keys across, one panel per head."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hookscope.errors import SpecError
from hookscope.plots.figure import grid, literal, new_figure

__all__ = ["attention"]

_MAX_TOKEN_LABELS = 64  # past this, every k-th token is named under an axis


def attention(
    pattern: torch.Tensor | np.ndarray,
    *,
    tokens: Sequence[str] | None = None,
    heads: int | Sequence[int] | None = None,
    sample: int = 0,
    title: str | None = None,
    cmap: str = "viridis",
) -> Any:
    """Heatmaps of an attention pattern: for each head, how much each query (row) attends to
    each key (column), on one colour scale from 0 to the largest weight shown.

    ``pattern`` is ``(queries, keys)``, ``(heads, queries, keys)`` or ``(batch, heads, queries,
    keys)`` (``sample`` picks the item of the batch), as an op site's attention pattern or an
    eager model's ``attn_weights`` hold it. ``tokens`` labels the axes (the keys' tokens; the
    queries', the last ``queries`` of them, so a generated step's one query reads right);
    ``heads`` picks a head or a list of them (default: every head). Masked keys (weight 0) stay
    dark, so a causal pattern shows its triangle.

    Example::

        out = eager_gpt2(ids, output_attentions=True)
        hs.plots.attention(out.attentions[0], tokens=tokenizer.convert_ids_to_tokens(ids[0]), heads=3)
    """
    values = _heads(pattern, sample)
    chosen = _chosen_heads(heads, values.shape[0])
    shown = values[chosen]
    queries, keys = shown.shape[1:]
    if tokens is not None and len(tokens) < keys:
        raise SpecError(f"tokens has {len(tokens)} labels for {keys} keys; expected one per key (at least {keys})")
    finite = shown[np.isfinite(shown)]
    high = float(finite.max()) if finite.size else 1.0
    columns = math.ceil(math.sqrt(len(chosen)))
    rows = math.ceil(len(chosen) / columns)
    side = min(max(2.2, 0.14 * keys + 1.0), 7.0)
    fig = new_figure(side * columns + 1.2, side * rows + 0.6)
    axes = grid(fig, len(chosen), columns)
    image = None
    for ax, head, plane in zip(axes, chosen, shown, strict=True):
        image = ax.imshow(plane, cmap=cmap, vmin=0.0, vmax=high if high > 0 else 1.0, interpolation="nearest")
        ax.set_title(f"head {head}", fontsize=8)
        _label(ax, tokens, queries, keys)
    fig.colorbar(image, ax=axes, shrink=0.8)
    what = f"{len(chosen)} of {values.shape[0]} heads" if len(chosen) < values.shape[0] else f"{len(chosen)} heads"
    # Two lines: one head's figure is narrow, and a one-line title would be cut at its edges.
    fig.suptitle(
        (literal(title) + ": " if title else "") + f"attention, {what}\nrows: queries, columns: keys", fontsize=9
    )
    return fig


def _heads(pattern: torch.Tensor | np.ndarray, sample: int) -> np.ndarray:
    """The pattern as a float array ``(heads, queries, keys)``."""
    values = pattern.detach().float().cpu().numpy() if isinstance(pattern, torch.Tensor) else np.asarray(pattern)
    if values.ndim == 4:
        if not 0 <= sample < values.shape[0]:
            raise SpecError(
                f"sample={sample} is outside the batch of {values.shape[0]}; expected 0..{values.shape[0] - 1}"
            )
        values = values[sample]
    elif values.ndim == 2:
        values = values[None]
    elif values.ndim != 3:
        raise SpecError(
            f"pattern has shape {tuple(values.shape)}; expected (queries, keys), (heads, queries, keys) or "
            "(batch, heads, queries, keys)"
        )
    return values.astype(np.float32, copy=False)


def _chosen_heads(heads: int | Sequence[int] | None, count: int) -> list[int]:
    if heads is None:
        return list(range(count))
    given: list[Any] = [heads] if isinstance(heads, numbers.Integral) else list(heads)  # type: ignore[arg-type]
    wanted = [-1 if isinstance(h, bool) or not isinstance(h, numbers.Integral) else int(h) for h in given]
    bad = [h for h in wanted if not 0 <= h < count]
    if bad or not wanted:
        raise SpecError(f"heads={heads!r}; expected head indices from 0 to {count - 1} (the pattern has {count} heads)")
    return wanted


def _label(ax: Any, tokens: Sequence[str] | None, queries: int, keys: int) -> None:
    if tokens is None:
        ax.tick_params(labelsize=6)
        return
    names = [literal(str(token)) for token in tokens[len(tokens) - keys :]]
    stride = max(1, math.ceil(keys / _MAX_TOKEN_LABELS))
    ax.set_xticks(range(0, keys, stride), names[::stride], rotation=90, fontsize=6)
    if queries > keys:  # queries from another sequence (cross-attention): the tokens name the keys only
        ax.tick_params(axis="y", labelsize=6)
        return
    rows = names[keys - queries :]
    ax.set_yticks(range(0, queries, stride), rows[::stride], fontsize=6)
