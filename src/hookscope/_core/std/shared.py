"""Blocks whose weights serve several layers (tied positions, ALBERT): refused, with the fix.

Canonical names number blocks by module and read a module's value; one module run as several
layers has several calls, which a canonical name cannot tell apart (``blocks.0.resid_post``
would read the shared module's last call, and the later positions would vanish from the map,
``named_modules()`` listing the module once). Every feature that takes ``"std:"`` names reads
the same map, so the map refuses such a model rather than map it wrongly.
"""

from __future__ import annotations

from torch import nn

from hookscope.errors import StdMapError

__all__ = ["SHARED_BLOCK", "refuse_tied", "shared_block_error"]

#: The ``check`` of the refusal: no table or detector reads such a model otherwise, so the
#: registry does not try the detector after it.
SHARED_BLOCK = "shared block"


def refuse_tied(by_name: dict[str, nn.Module], family: str, blocks_path: str) -> None:
    """Refuse a block list holding one block object at two positions (weights tied across
    layers): ``named_modules()`` lists it once, so its later positions would vanish from the
    map and ``blocks.{i}`` would read the shared module's last call."""
    container = by_name.get(blocks_path)
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return
    first: dict[int, int] = {}
    for position, child in enumerate(container):
        earlier = first.setdefault(id(child), position)
        if earlier != position:
            raise shared_block_error(
                family,
                f"the block list {blocks_path!r} holds one block object at positions {earlier} and {position}",
                f"{blocks_path}.{earlier}",
            )


def shared_block_error(family: str, what: str, block: str) -> StdMapError:
    """The refusal of a block whose weights serve several layers (tied positions, ALBERT)."""
    return StdMapError(
        f"{what} (weights shared across layers, ALBERT-style): canonical names number blocks by module, and "
        f"cannot tell one module's calls apart; select the block itself and read each call: "
        f"hs.capture(model, {block!r}) keeps every call, cache['{block}#1'] is its second",
        family=family,
        check=SHARED_BLOCK,
    )
