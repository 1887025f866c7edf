"""Editing attention sub-sites: one ``scaled_dot_product_attention`` call, run on from edited values.

An edit of ``"h.0.attn:attn.pattern"`` changes the probabilities the fused kernel never holds, so
the call's output is computed again from them, and the model goes on with that output:

- ``q``, ``k``, ``v``: the edited argument replaces the one passed; the kernel runs again with it
  and the call's other arguments (mask, causality, scale, GQA) as passed;
- ``scores``: the pre-softmax scores (:mod:`~hookscope._core.attention`, ``-inf`` where masked)
  are edited, then their softmax over the keys is attended to the values;
- ``pattern``: the probabilities are edited, then ``pattern @ value`` (each value head repeated
  for its group of query heads under grouped-query attention) is the output;
- ``z``: the output itself, ``(batch, heads, queries, head size)``, before the heads are merged:
  ``hs.edits.zero(heads=3)`` ablates head 3 there.

Several kinds in one call are applied in that order (``q``/``k``/``v`` first, ``z`` last), so a
pattern edit sees the edited query and key. Dropout is random and not part of the pattern: a
call with ``dropout_p > 0`` (a model in training mode) is refused for ``scores`` and
``pattern`` edits. Cost: a ``scores`` or ``pattern`` edit makes the quadratic values the fused
kernel avoids, ``batch x heads x queries x keys`` per call, and one more matrix product.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.nn import functional

from hookscope._core.attention import SdpaCall, attend, pattern_of_scores, sdpa_call
from hookscope.errors import EditError

__all__ = ["edited_attention"]

_ARGUMENTS = ("q", "k", "v")


def edited_attention(
    kinds: Collection[str],
    apply: Callable[[str, torch.Tensor], torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: torch.Tensor,
    site: str,
) -> torch.Tensor:
    """What one kernel call returns with the sub-sites ``kinds`` edited: ``apply(kind, value)``
    gives each edited value; ``site`` (the module call's) names the call in errors.

    >>> q = k = v = torch.randn(1, 2, 3, 4)
    >>> out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> first_key = lambda kind, pattern: torch.zeros_like(pattern).index_fill(-1, torch.tensor([0]), 1.0)
    >>> edited = edited_attention(["pattern"], first_key, (q, k, v), {"is_causal": True}, out, "attn#0")
    >>> torch.allclose(edited, v[:, :, :1].expand_as(out))    # every query now reads key 0's value only
    True
    """
    call = sdpa_call(args, kwargs)
    edited_arguments = [kind for kind in _ARGUMENTS if kind in kinds]
    if edited_arguments:
        query, key, value = (
            apply(kind, tensor) if kind in edited_arguments else tensor
            for kind, tensor in (("q", call.query), ("k", call.key), ("v", call.value))
        )
        call = dataclasses.replace(call, query=query, key=key, value=value)
    result = output
    if "scores" in kinds or "pattern" in kinds:
        if call.dropout_p > 0:
            chosen = "scores" if "scores" in kinds else "pattern"
            raise EditError(
                f"{site}:attn.{chosen}: this scaled_dot_product_attention call drops out attention with "
                f"dropout_p={call.dropout_p}, which is random and not part of the {chosen}; an edited {chosen} would "
                "be attended without it; run the model in eval mode (model.eval()), or edit attn.z or attn.v instead"
            )
        if "scores" in kinds:
            pattern = pattern_of_scores(apply("scores", call.scores), call.query.dtype)
        else:
            pattern = call.pattern
        if "pattern" in kinds:
            pattern = apply("pattern", pattern)
        result = attend(pattern, call.value).to(output.dtype)
    elif edited_arguments:
        result = _run(call)
    if "z" in kinds:
        result = apply("z", result)
    return result


def _run(call: SdpaCall) -> torch.Tensor:
    """The kernel again, on the call's (edited) arguments."""
    optional: dict[str, Any] = {"enable_gqa": True} if call.enable_gqa else {}  # a keyword of torch 2.5 on
    return functional.scaled_dot_product_attention(
        call.query,
        call.key,
        call.value,
        attn_mask=call.attn_mask,
        dropout_p=call.dropout_p,
        is_causal=call.is_causal,
        scale=call.scale,
        **optional,
    )
