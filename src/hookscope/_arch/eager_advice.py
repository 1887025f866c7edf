"""Where an eager attention module's heads can be read, for the model at hand.

Attention sub-sites read a ``scaled_dot_product_attention`` call; an eager module makes none. Its
softmax is the pattern per head (``:op[softmax#0]``), and the product after it is the output
per head where that product keeps the heads apart (GPT-2, Llama: ``(batch, heads, queries, head
size)``). BLOOM's is a ``bmm`` over batch x heads, so it names no ``attn.z``; what always holds
the heads' output is the input of the module's output projection, merged in its last dim, which
``patch_sweep(heads=True, num_heads=)`` and ``hs.edits.zero(heads=, num_heads=)`` split. Advice
that names a site the model has not, or ``attn_implementation='sdpa'`` where transformers refuses
it, sends the user in a circle: the errors name these instead.
"""

from __future__ import annotations

import torch
from torch import nn

from hookscope._core.names import escape_name

__all__ = ["merged_heads", "output_projection", "refuses_sdpa"]

#: Names transformers' attention modules give the linear layer after the heads are merged.
_PROJECTIONS = ("o_proj", "out_proj", "c_proj", "dense", "o", "out_lin", "wo", "out", "proj")


def refuses_sdpa(model: nn.Module) -> bool:
    """Whether transformers refuses ``attn_implementation='sdpa'`` for ``model`` (Gemma 2, BLOOM)."""
    return getattr(model, "_supports_sdpa", None) is False


def output_projection(attention: nn.Module) -> str | None:
    """The child of ``attention`` that projects its merged heads back (``o_proj``, ``dense``), or None."""
    children = dict(attention.named_children())
    for name in _PROJECTIONS:
        weight = getattr(children.get(name), "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return name
    return None


def merged_heads(model: nn.Module, name: str, attention: nn.Module) -> str:
    """Where the heads' output of attention module ``name`` is, merged, and how to split it."""
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    count = f"num_heads={heads}" if isinstance(heads, int) else "num_heads="
    projection = output_projection(attention)
    where = (
        f"'{escape_name(name)}.{projection}:input[0]'"
        if projection is not None
        else f"the input of {name!r}'s output projection"
    )
    return (
        f"the heads' output, merged in the last dim, is {where} (by head: patch_sweep(heads=True, {count}) and "
        f"hs.edits.zero(heads=, {count}) split it)"
    )
