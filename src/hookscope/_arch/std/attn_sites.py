"""Attention's sub-sites in a canonical map: ``blocks.{i}.attn.q|k|v|scores|pattern|z``.

Why a module of its own: the sub-sites are read off the ops the attention module calls (its
``scaled_dot_product_attention``, or an eager softmax and the product after it), not off the
residual sums the resolver checks, and each one that cannot be named says what reads it instead.
"""

from __future__ import annotations

from hookscope._arch.std.observe import Seen
from hookscope._core.names import escape_name
from hookscope._core.op_sites import SDPA
from hookscope._core.std_names import StdSite

__all__ = ["ATTN_SUBS", "attention_subs"]

#: The attention sub-sites, as ``blocks.{i}.attn.{sub}`` (and ``cross_attn.{sub}``).
ATTN_SUBS = ("q", "k", "v", "scores", "pattern", "z")


def attention_subs(seen: Seen, sites: dict[str, StdSite], missing: dict[str, str], name: str, attn: str | None) -> None:
    """Name ``{name}.{sub}`` for every sub-site of the attention module ``attn`` in ``sites``,
    or say why not in ``missing``."""
    if attn is None:
        for sub in ATTN_SUBS:
            missing[f"{name}.{sub}"] = "no attention module"
        return
    ops = seen.ops_of(attn)
    eager_z = None if SDPA in ops else seen.eager_output(attn)
    for sub in ATTN_SUBS:
        full = f"{name}.{sub}"
        if SDPA in ops:
            text = f"{escape_name(attn)}:attn.{sub}"
            sites[full] = StdSite(full, text, text, None, "attn")
        elif sub == "pattern" and "softmax" in ops:
            text = f"{escape_name(attn)}:op[softmax#0]"  # eager attention: its softmax is the pattern
            sites[full] = StdSite(full, text, text, None, "op")
        elif sub == "z" and eager_z is not None:
            text = f"{escape_name(attn)}:op[{eager_z}]"  # eager attention: the product after its softmax
            sites[full] = StdSite(full, text, text, None, "op")
        else:
            missing[full] = _unnamed_sub(seen, sub, attn, "softmax" in ops, eager_z is not None)


def _unnamed_sub(seen: Seen, sub: str, attn: str, eager: bool, eager_z: bool) -> str:
    """Why attention sub-site ``sub`` has no name, and what reads it on this model instead."""
    sdpa = (
        "transformers refuses attn_implementation='sdpa' for this model"
        if seen.refuses_sdpa
        else "load the model with attn_implementation='sdpa' to name them all"
    )
    if not eager:
        return (
            f"the attention module does not call {SDPA} (fused or hand-written attention without a softmax op): "
            f"attention sub-sites read that call; {sdpa}"
        )
    if sub == "z":
        return (
            "this eager attention's product after its softmax does not keep the heads apart (a bmm over batch "
            f"x heads): {seen.merged_heads.get(attn, 'read the input of its output projection')}; {sdpa}"
        )
    named = "attn.pattern (its softmax)" + (" and attn.z (the product after it)" if eager_z else "")
    return f"eager attention calls no {SDPA}, which attention sub-sites read; of it only {named} are named; {sdpa}"
