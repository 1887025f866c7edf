"""The mask of real tokens a capture reduces by: read off the model's call, held for the pass.

A named reduction over dimension 1 (``reduce="mean:1"``) of a padded batch would average pad
positions in. The model's call says which positions are real (its ``attention_mask``), so the
capture reads that keyword in a pre-hook of the root module and hands it to the keeper, whose
reductions then use the real positions only, as ``hs.extract`` does (``_shared/reduce.py``).
The keeper forgets it when the call ends, so a module called on its own later is not masked by
an earlier call's mask.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hookscope._arch.positions import POSITION_WORDS, positions_mask
from hookscope._capture.keeper import Keeper
from hookscope._capture.options import CaptureOptions
from hookscope._core.attach import HookSpec
from hookscope._shared.reduce import mask_of
from hookscope.errors import SpecError

__all__ = ["token_mask_specs"]


def token_mask_specs(model: nn.Module, keeper: Keeper, options: CaptureOptions) -> list[HookSpec]:
    """The hooks on ``model`` that keep ``keeper.token_mask`` current; none without a reduction or a mask key."""
    key = options.mask_key
    if options.reduce is None or key is None:
        return []
    required = options.token_mask != "auto"

    config = getattr(model, "config", None)

    def read(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if key in POSITION_WORDS:  # a vision-language model's image or text positions
            keeper.token_mask = positions_mask(config, key, args, kwargs)
            return
        found = mask_of(kwargs, key)
        if found is None and required:
            present = ", ".join(repr(name) for name in kwargs) or "none"
            raise SpecError(
                f"token_mask={key!r}: the model was called without a 2-D tensor {key!r} (keyword inputs: "
                f"{present}); name the keyword that holds the padding mask, or token_mask=None"
            )
        keeper.token_mask = found

    def forget(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        keeper.token_mask = None

    return [
        HookSpec("", model, "forward_pre", read, with_kwargs=True, prepend=True, fitted=True),
        HookSpec("", model, "forward", forget, with_kwargs=True, always_call=True, fitted=True),
    ]
