"""Attention sub-sites in a capture: the values one ``scaled_dot_product_attention`` call is asked for.

A selector ``"h.0.attn:attn.pattern"`` watches the module's kernel calls through the op
watcher (:mod:`~hookscope._core.op_selectors`); at each call this module turns the call's
arguments and output into the values selected:

- ``q``, ``k``, ``v``: the kernel's arguments as passed (``k`` and ``v`` with the key/value
  heads the model passed: fewer than ``q``'s under grouped-query attention unless the model
  repeated them first), ``(batch, heads, tokens, head size)``;
- ``z``: the kernel's output, per head, before the model merges the heads and projects them,
  ``(batch, heads, queries, head size)``;
- ``scores`` (pre-softmax, masked as the kernel masks, ``-inf`` where masked) and ``pattern``
  (the probabilities, before dropout): computed from the arguments by
  :mod:`~hookscope._core.attention`, only when selected, ``(batch, heads, queries, keys)``.

Cost: ``scores`` and ``pattern`` are the quadratic values the fused kernel never holds: each is
``batch x heads x queries x keys`` values per call (O(seq^2) memory per head), plus one matrix
product; computed without autograd's graph unless the capture keeps it (``detach=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookscope._core.attention import pattern_of_scores, sdpa_call
from hookscope._core.op_sites import ATTN_KINDS

__all__ = ["attention_values"]

_ARGUMENTS = {"q": "query", "k": "key", "v": "value"}
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def attention_values(
    kinds: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    *,
    detach: bool,
    room: Callable[[str, tuple[int, ...], torch.dtype], None] | None = None,
) -> list[tuple[str, torch.Tensor, bool]]:
    """``(kind, value, fresh)`` for each kind asked for, in :data:`ATTN_KINDS` order; ``fresh``
    says the value was made here (nobody else holds it) rather than being the model's tensor.
    ``room(kind, shape, dtype)`` is told of ``scores`` and ``pattern`` before they are made (a
    capture's ``max_bytes`` refuses them there, before the quadratic memory is taken).

    >>> q = k = v = torch.ones(1, 1, 2, 4)
    >>> out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> [(kind, fresh) for kind, _, fresh in attention_values(["pattern", "q"], (q, k, v), {"is_causal": True}, out,
    ...  detach=True)]
    [('q', False), ('pattern', True)]
    """
    call = sdpa_call(args, kwargs)
    values: list[tuple[str, torch.Tensor, bool]] = []
    scores: torch.Tensor | None = None
    for kind in ATTN_KINDS:
        if kind not in kinds:
            continue
        if kind in _ARGUMENTS:
            values.append((kind, getattr(call, _ARGUMENTS[kind]), False))
        elif kind == "z":
            values.append((kind, output, False))
        else:
            if room is not None:
                shape = (*call.query.shape[:-1], call.key.size(-2))
                room(kind, shape, call.query.dtype)
            with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
                if kind == "pattern" and (scores is None or call.query.dtype in _LOW_PRECISION):
                    value = call.pattern  # half precision: the softmax of float32 scores, not of rounded ones
                else:
                    scores = call.scores if scores is None else scores
                    value = scores if kind == "scores" else pattern_of_scores(scores)
            values.append((kind, value, True))
    return values
