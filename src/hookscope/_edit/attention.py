"""Editing attention sub-sites: one ``scaled_dot_product_attention`` call, run on from edited values.

An edit of ``"h.0.attn:attn.pattern"`` changes the probabilities the fused kernel never holds, so
the call's output is computed again from them, and the model goes on with that output:

- ``q``, ``k``, ``v``: the edited argument replaces the one passed; the kernel runs again with it
  and the call's other arguments (mask, causality, scale, GQA) as passed; ``k`` and ``v`` have
  the model's key/value heads, whether or not the model repeated them for the kernel;
- ``scores``: the pre-softmax scores (:mod:`~hookscope._arch.attention`, ``-inf`` where masked)
  are edited, then their softmax over the keys is attended to the values;
- ``pattern``: the probabilities are edited, then ``pattern @ value`` (each value head repeated
  for its group of query heads under grouped-query attention) is the output;
- ``z``: the output itself, ``(batch, heads, queries, head size)``, before the heads are merged:
  ``hs.edits.zero(heads=3)`` ablates head 3 there.

Each value is handed to the edit in the sub-sites' one layout and put back into the call's
(:class:`~hookscope._arch.attention.HeadLayout`: transformers packs a one-query step's grouped
query heads along the query axis, and repeats key/value heads, on its masked path), so
``zero(heads=1)`` is query head 1 in every call.

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

from hookscope._arch.attention import HeadCounts, attend, head_layout, pattern_of_scores, run_kernel, sdpa_call
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
    counts: HeadCounts | None = None,
) -> torch.Tensor:
    """What one kernel call returns with the sub-sites ``kinds`` edited: ``apply(kind, value)``
    gives each edited value; ``site`` (the module call's) names the call in errors; ``counts``
    (the module's heads, :func:`~hookscope._arch.attention.head_counts`) lays values out.

    >>> q = k = v = torch.randn(1, 2, 3, 4)
    >>> out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> first_key = lambda kind, pattern: torch.zeros_like(pattern).index_fill(-1, torch.tensor([0]), 1.0)
    >>> edited = edited_attention(["pattern"], first_key, (q, k, v), {"is_causal": True}, out, "attn#0")
    >>> torch.allclose(edited, v[:, :, :1].expand_as(out))    # every query now reads key 0's value only
    True
    """
    call = sdpa_call(args, kwargs)
    layout = head_layout(call, counts)

    def edited(kind: str, value: torch.Tensor) -> torch.Tensor:
        return layout.kernel(kind, apply(kind, layout.documented(kind, value)))

    edited_arguments = [kind for kind in _ARGUMENTS if kind in kinds]
    if edited_arguments:
        query, key, value = (
            edited(kind, tensor) if kind in edited_arguments else tensor
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
            pattern = pattern_of_scores(edited("scores", call.scores), call.query.dtype)
        else:
            pattern = call.pattern
        if "pattern" in kinds:
            pattern = edited("pattern", pattern)
        result = attend(pattern, call.value).to(output.dtype)
    elif edited_arguments:
        result = run_kernel(call)
    if "z" in kinds:
        result = edited("z", result)
    return result
