"""Attention sub-sites in a capture: the values one ``scaled_dot_product_attention`` call is asked for.

A selector ``"h.0.attn:attn.pattern"`` watches the module's kernel calls through the op
watcher (:mod:`~hookscope._arch.op_selectors`); at each call this module turns the call's
arguments and output into the values selected, in one layout whatever the call's
(:class:`~hookscope._arch.attention.HeadLayout`: transformers repeats or packs grouped heads
on its masked path):

- ``q``: the kernel's query, ``(batch, heads, queries, head size)``;
- ``k``, ``v``: the key and value with the model's key/value heads (fewer than ``q``'s under
  grouped-query attention, with or without a mask), ``(batch, key/value heads, keys, head size)``;
- ``z``: the kernel's output, per head, before the model merges the heads and projects them,
  ``(batch, heads, queries, head size)``;
- ``scores`` (pre-softmax, masked as the kernel masks, ``-inf`` where masked) and ``pattern``
  (the probabilities, before dropout): computed from the arguments by
  :mod:`~hookscope._arch.attention`, only when selected, ``(batch, heads, queries, keys)``.

Gradients (``capture(grads=True)``): a recomputed pattern is no part of the model's graph, so
the gradient with respect to it would not exist; it is defined as the one the eager
implementation gives its ``attn_weights``. To get it, the call is *spliced*: its output is
computed again from the recomputed pattern (``pattern @ value``) and the model goes on with
that, equal to the kernel's within rounding, so the backward runs through the pattern and the
scores. A value whose documented layout is a new view of the kernel's tensor (a packed q or z,
repeated k and v) is spliced the same way, its view put back into the call. Under dropout
(``dropout_p > 0``) the kernel's random mask cannot be recomputed: those values get no
gradient, with that reason.

Cost: ``scores`` and ``pattern`` are the quadratic values the fused kernel never holds: each is
``batch x heads x queries x keys`` values per call (O(seq^2) memory per head), plus one matrix
product; computed without autograd's graph unless the capture keeps it (``detach=False``) or
splices it (``grads=True``: then also the product with the value).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hookscope._arch.attention import (
    HeadCounts,
    HeadLayout,
    SdpaCall,
    attend,
    head_layout,
    pattern_of_scores,
    run_kernel,
    sdpa_call,
)
from hookscope._core.op_sites import ATTN_KINDS

__all__ = ["AttentionRead", "attention_values", "read_attention"]

_ARGUMENTS = {"q": "query", "k": "key", "v": "value"}
_RECOMPUTED = ("scores", "pattern")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class AttentionRead:
    """What one kernel call gives a capture: ``values``, ``(kind, value, fresh)`` in
    :data:`ATTN_KINDS` order (``fresh``: made here, nobody else holds it); ``output``, what the
    model goes on with instead of the kernel's output (a splice), or None; ``no_grad``, per kind,
    why a value asked for with ``grads`` gets no gradient."""

    values: list[tuple[str, torch.Tensor, bool]]
    output: torch.Tensor | None = None
    no_grad: dict[str, str] = field(default_factory=dict)


def attention_values(
    kinds: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    *,
    detach: bool,
    counts: HeadCounts | None = None,
    room: Callable[[str, tuple[int, ...], torch.dtype], None] | None = None,
) -> list[tuple[str, torch.Tensor, bool]]:
    """``(kind, value, fresh)`` for each kind asked for (:func:`read_attention` without gradients).

    >>> q = k = v = torch.ones(1, 1, 2, 4)
    >>> out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> [(kind, fresh) for kind, _, fresh in attention_values(["pattern", "q"], (q, k, v), {"is_causal": True}, out,
    ...  detach=True)]
    [('q', False), ('pattern', True)]
    """
    return read_attention(kinds, args, kwargs, output, detach=detach, counts=counts, room=room).values


def read_attention(
    kinds: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    *,
    detach: bool,
    counts: HeadCounts | None = None,
    grads: bool = False,
    room: Callable[[str, tuple[int, ...], torch.dtype], None] | None = None,
) -> AttentionRead:
    """The values ``kinds`` of one kernel call (``counts``: its module's heads,
    :func:`~hookscope._arch.attention.head_counts`). ``room(kind, shape, dtype)`` is told of
    ``scores`` and ``pattern`` before they are made (a capture's ``max_bytes`` refuses them
    there, before the quadratic memory is taken). ``grads``: splice the call where a value
    asked for would otherwise be off the model's graph (module docstring)."""
    call = sdpa_call(args, kwargs)
    layout = head_layout(call, counts)
    if room is not None and any(kind in kinds for kind in _RECOMPUTED):
        shape = (*call.query.shape[:-1], call.key.size(-2))
        for kind in _RECOMPUTED:
            if kind in kinds:
                room(kind, shape, call.query.dtype)
    off_graph = [kind for kind in kinds if kind in _RECOMPUTED or layout.moves(kind)]
    if grads and off_graph and torch.is_grad_enabled() and _in_graph(call):
        if call.dropout_p > 0:
            why = (
                f"this scaled_dot_product_attention call drops out attention (dropout_p={call.dropout_p}, "
                "training mode), and the kernel's random mask cannot be recomputed to put the value into the "
                "model's graph; run the model in eval mode (model.eval()) for this gradient"
            )
            with torch.no_grad():
                read = _read(kinds, call, layout, output)
            read.no_grad = dict.fromkeys(off_graph, why)
            return read
        return _spliced(kinds, call, layout, output)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach and not grads):
        return _read(kinds, call, layout, output)


def _in_graph(call: SdpaCall) -> bool:
    return call.query.requires_grad or call.key.requires_grad or call.value.requires_grad


def _read(kinds: Sequence[str], call: SdpaCall, layout: HeadLayout, output: torch.Tensor) -> AttentionRead:
    """The values as the call computed them, in the documented layout; the model's output stays."""
    values: list[tuple[str, torch.Tensor, bool]] = []
    scores: torch.Tensor | None = None
    for kind in ATTN_KINDS:
        if kind not in kinds:
            continue
        if kind in _ARGUMENTS:
            values.append((kind, layout.documented(kind, getattr(call, _ARGUMENTS[kind])), False))
        elif kind == "z":
            values.append((kind, layout.documented(kind, output), False))
        else:
            if kind == "pattern" and (scores is None or call.query.dtype in _LOW_PRECISION):
                value = call.pattern  # half precision: the softmax of float32 scores, not of rounded ones
            else:
                scores = call.scores if scores is None else scores
                value = scores if kind == "scores" else pattern_of_scores(scores)
            values.append((kind, layout.documented(kind, value), True))
    return AttentionRead(values)


def _spliced(kinds: Sequence[str], call: SdpaCall, layout: HeadLayout, output: torch.Tensor) -> AttentionRead:
    """The values with the call's output recomputed through them, so that a backward reaches each.

    The arguments asked for are taken in the documented layout and put back into the kernel's
    (identity, a reshape, or a repeat of the key/value heads); then the output is the recomputed
    pattern times the value, or the kernel run again on the rebuilt arguments; a packed z is
    the view the model goes on with. Values equal the kernel's within rounding."""
    documented = {kind: layout.documented(kind, getattr(call, _ARGUMENTS[kind])) for kind in _ARGUMENTS}
    query, key, value = (
        layout.kernel(kind, documented[kind]) if kind in kinds and layout.moves(kind) else getattr(call, name)
        for kind, name in _ARGUMENTS.items()
    )
    kernel_call = dataclasses.replace(call, query=query, key=key, value=value)
    found: dict[str, torch.Tensor] = {}
    if any(kind in kinds for kind in _RECOMPUTED):
        if "scores" in kinds or query.dtype not in _LOW_PRECISION:
            found["scores"] = layout.documented("scores", kernel_call.scores)
            pattern = pattern_of_scores(found["scores"], query.dtype)  # through the scores: their gradient
        else:  # half precision: the softmax of float32 scores, not of rounded ones
            pattern = layout.documented("pattern", kernel_call.pattern)
        found["pattern"] = pattern
        result = attend(layout.kernel("pattern", pattern), kernel_call.value).to(output.dtype)
    elif query is not call.query or key is not call.key or value is not call.value:  # a view put back: rerun
        result = run_kernel(kernel_call)
    else:
        result = output
    z = layout.documented("z", result)
    if "z" in kinds and layout.moves("z"):
        result = layout.kernel("z", z)  # the model goes on with the view that is kept
    values: list[tuple[str, torch.Tensor, bool]] = []
    for kind in ATTN_KINDS:
        if kind in kinds:
            if kind in _ARGUMENTS:
                values.append((kind, documented[kind], False))
            elif kind == "z":
                values.append((kind, z, False))
            else:
                values.append((kind, found[kind], True))
    return AttentionRead(values, output=None if result is output else result)
