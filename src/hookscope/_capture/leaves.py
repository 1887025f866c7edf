"""What a capture's hooks keep of a value: the leaves selected, and copies where the model goes on.

``leaf_filter`` keeps the leaves a leaf selector names (``"h.0:output[0]"``) and refuses one that
names nothing; ``copier`` hands the model copies of values kept in autograd's graph;
``writes_in_place`` tells which op argument holds an in-place op's result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hookscope._core.names import leaf_label
from hookscope.errors import CaptureError

__all__ = ["copier", "leaf_filter", "writes_in_place"]


def writes_in_place(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when the op may have written its result into an argument: ``add_``, ``out=``, and the
    functional ``F.relu(x, inplace=True)`` (or ``F.relu(x, True)``), named ``relu``; the argument
    it returns is then left out of the op's inputs (it holds the output)."""
    return (
        op.split("#")[0].endswith("_")
        or "out" in kwargs
        or kwargs.get("inplace") is True
        or any(arg is True for arg in args[1:])
    )


def leaf_filter(
    name: str, what: str, paths: list[tuple[str, bool]] | None
) -> Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]] | None:
    """Keep the leaves at ``paths`` (and below them); None (no filter) for every leaf. A strict
    path that is not there is an error naming the tensors that are, also where the whole value
    is kept too (``["h.0", "h.0:output[0]"]``): a leaf that names nothing is never let pass."""
    if paths is None:
        return None
    every = any(path == "" for path, _ in paths)
    wanted = tuple(path for path, _ in paths)
    required = tuple(path for path, strict in paths if strict and path)
    if every and not required:
        return None

    def chosen(leaves: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        kept = leaves if every else [leaf for leaf in leaves if any(_at_or_below(leaf[0], path) for path in wanted)]
        missing = [path for path in required if not any(_at_or_below(p, path) for p, _ in kept)]
        if missing:
            there = ", ".join(repr(f"{name}:{leaf_label(what, p)}") for p, _ in leaves[:8]) or "no tensor"
            raise CaptureError(
                f"{name!r} {what} has no tensor at {', '.join(repr(leaf_label(what, p)) for p in missing)}; "
                f"its tensors: {there}",
                site=f"{name}:{leaf_label(what, missing[0])}",
            )
        return kept

    return chosen


def _at_or_below(path: str, wanted: str) -> bool:
    """``"[0][1]"`` is at or below ``"[0]"``; ``"[10]"`` is not."""
    return path == wanted or (path.startswith(wanted) and path[len(wanted)] in "[.")


def copier(ids: set[int]) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """Replace the tensors named by ``ids`` with copies (one copy per tensor, so two places
    holding one tensor still hold one tensor), and leave the others."""
    copies: dict[int, torch.Tensor] = {}

    def copy(_path: str, tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in ids:
            return tensor
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.clone()
        return copies[id(tensor)]

    return copy
