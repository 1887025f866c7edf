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

__all__ = ["SHARED_BLOCK", "refuse_shared_role", "refuse_tied", "shared_block_error", "shared_stateless"]

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


def refuse_shared_role(
    block: nn.Module, block_name: str, paths: list[str], name_of: dict[int, str], family: str
) -> None:
    """Refuse a role module (``mlp``, ``attn``, ``ln_1``, ...) whose object also sits in another
    block (weights tied at the sublayer level): ``named_modules()`` lists it once, under the
    first block, so that block's canonical names would read every block's call of it.

    ``paths``: the table's role paths relative to the block (``"mlp"``, ``"attn|self_attn"``);
    ``name_of``: each module's name in the model, by object. Only role modules count: a module
    that no role names (a rotary embedding shared by every block) is read by no canonical name.
    """
    for path in paths:
        for alternative in path.split("|"):
            try:
                module = block.get_submodule(alternative)
            except AttributeError:
                continue
            own = name_of.get(id(module))
            if own is not None and not own.startswith(block_name + ".") and _holds_state(module):
                raise shared_block_error(
                    family, f"the module {own!r} is also block {block_name!r}'s {alternative!r}", own
                )


def shared_stateless(blocks: list[nn.Module], path: str) -> bool:
    """Whether the role at ``path`` is one module object without weights held by several blocks
    (GPT-1's activation): no layer's weights are shared, so the model is not refused, but the
    module's calls cannot be told apart by block, so the role has no canonical name."""
    found = [module for block in blocks if (module := _submodule(block, path)) is not None]
    return len({id(m) for m in found}) < len(found) and not any(_holds_state(m) for m in found)


def _submodule(block: nn.Module, path: str) -> nn.Module | None:
    for alternative in path.split("|"):
        try:
            return block.get_submodule(alternative)
        except AttributeError:
            continue
    return None


def _holds_state(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def shared_block_error(family: str, what: str, block: str) -> StdMapError:
    """The refusal of a block whose weights serve several layers (tied positions, ALBERT)."""
    return StdMapError(
        f"{what} (weights shared across layers, ALBERT-style): canonical names number blocks by module, and "
        f"cannot tell one module's calls apart; select the shared module itself and read each call: "
        f"hs.capture(model, {block!r}) keeps every call, cache['{block}#1'] is its second",
        family=family,
        check=SHARED_BLOCK,
    )
