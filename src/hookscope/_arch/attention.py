"""What ``scaled_dot_product_attention`` computes inside, recomputed from its arguments.

Fused attention kernels (flash, memory-efficient, cuDNN; the default of transformers models,
``attn_implementation="sdpa"``) never hold the attention scores or probabilities: the pattern a
researcher looks at first exists only inside the kernel. It is a function of the call's
arguments, though, so it can be computed again from them, exactly as PyTorch documents the
kernel's math, when and only when it is asked for:

- ``scores`` = ``query @ key.T * scale`` plus the mask: ``is_causal`` masks the positions after
  each query's own (the upper triangle, aligned at the top left as the kernel does), a boolean
  ``attn_mask`` masks where it is False, a float ``attn_mask`` is added; masked positions are
  ``-inf``. With ``enable_gqa`` each key/value head serves ``query heads / key heads`` query heads
  in a row, as the kernel repeats them. ``scale`` defaults to ``1 / sqrt(head size)``.
- ``pattern`` = ``softmax(scores)`` over the keys; a query row whose keys are all masked gets zeros,
  as PyTorch's kernels give it (not NaN).
- ``attend(pattern, value)`` = ``pattern @ value``: the call's output, from a pattern that may
  have been edited.

Dropout (``dropout_p``) is random and is not part of the pattern: these are the probabilities
before it, which is what eager implementations return as ``attn_weights`` too.

Heads, whatever the call's shape: under grouped-query attention transformers' SDPA path passes
the kernel one of three layouts (``enable_gqa``; ``repeat_kv``, key/value heads repeated to the
query heads' count, on a masked call; ``pack_gqa``, a one-query step under a mask with each
key/value head's query heads laid along the query axis). :class:`HeadLayout` turns any of them
into one: q, scores, pattern and z ``(batch, heads, queries, ...)``, k and v ``(batch, key/value
heads, keys, head size)``, and back, from the module's head counts (:func:`head_counts`, read
once when hooks attach) and the call's shapes.

Where the eager implementation differs: a query row that may see no key at all (a left-padded
position, under a mask without a causal fallback) gets zeros here, as the kernel computed it
(its output row is zero too); transformers' eager softmax of a row of equal ``finfo.min`` scores
gives it a uniform row instead, ``1 / keys``. Every other row is the eager ``attn_weights``.

Cost: the scores and the pattern hold ``batch x heads x queries x keys`` values each, the
quadratic memory the fused kernels avoid (for 32 heads over 4,096 tokens, 2 GiB per layer in
float32), and one extra matrix product. Half-precision arguments are computed in float32 and
returned in their own dtype.

>>> from torch.nn.functional import scaled_dot_product_attention
>>> q, k, v = torch.randn(3, 1, 2, 4, 8).unbind(0)
>>> pattern = attention_pattern(q, k, is_causal=True)
>>> torch.allclose(attend(pattern, v), scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional

from hookscope.errors import SpecError

__all__ = [
    "HeadCounts",
    "HeadLayout",
    "SdpaCall",
    "attend",
    "attention_pattern",
    "attention_scores",
    "head_counts",
    "head_layout",
    "pattern_of_scores",
    "run_kernel",
    "sdpa_call",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaCall:
    """The arguments of one ``scaled_dot_product_attention`` call, by name, as the kernel reads them."""

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @property
    def scores(self) -> Tensor:
        """Pre-softmax scores, masked as the kernel masks (``-inf`` where masked)."""
        return attention_scores(self.query, self.key, **self._masking())

    @property
    def pattern(self) -> Tensor:
        """The attention probabilities (before dropout)."""
        return attention_pattern(self.query, self.key, **self._masking())

    def _masking(self) -> dict[str, Any]:
        """What decides which keys each query sees, and how scores are scaled."""
        return {
            "attn_mask": self.attn_mask,
            "is_causal": self.is_causal,
            "scale": self.scale,
            "enable_gqa": self.enable_gqa,
        }


_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> SdpaCall:
    """The :class:`SdpaCall` of a call ``F.scaled_dot_product_attention(*args, **kwargs)``, as an
    op watcher sees it (positional and keyword arguments in any mix).

    >>> q = torch.zeros(1, 1, 2, 4)
    >>> sdpa_call((q, q, q), {"is_causal": True}).is_causal
    True
    """
    if len(args) > len(_SDPA_PARAMETERS):
        raise SpecError(f"scaled_dot_product_attention got {len(args)} positional arguments; expected at most 8")
    named = dict(zip(_SDPA_PARAMETERS, args, strict=False))
    clash = sorted(set(named) & set(kwargs))
    if clash:
        raise SpecError(f"scaled_dot_product_attention got {clash[0]!r} twice")
    named.update((k, v) for k, v in kwargs.items() if k in _SDPA_PARAMETERS)
    missing = [name for name in ("query", "key", "value") if name not in named]
    if missing:
        raise SpecError(f"scaled_dot_product_attention call without {missing[0]!r}; expected query, key and value")
    return SdpaCall(**named)


def attention_scores(
    query: Tensor,
    key: Tensor,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``query @ key.T * scale`` with the call's mask applied (``-inf`` where masked), shaped
    ``(..., query heads, queries, keys)``.

    >>> q = k = torch.ones(1, 1, 2, 4)
    >>> attention_scores(q, k, is_causal=True)
    tensor([[[[2., -inf],
              [2., 2.]]]])
    """
    dtype = query.dtype
    q, k = _working(query), _working(key)
    if enable_gqa:
        k = _repeat_heads(k, q.size(-3), "key")
    elif q.dim() >= 3 and k.dim() >= 3 and q.size(-3) != k.size(-3):
        raise SpecError(
            f"query has {q.size(-3)} heads and key {k.size(-3)}; expected equal counts, or enable_gqa=True "
            "(grouped-query attention)"
        )
    factor = scale if scale is not None else 1 / math.sqrt(q.size(-1))
    scores = torch.matmul(q, k.transpose(-2, -1)) * factor
    queries, keys = scores.size(-2), scores.size(-1)
    if is_causal:
        allowed = torch.ones(queries, keys, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~allowed, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.to(scores.dtype)
    return scores.to(dtype) if dtype in _LOW_PRECISION else scores


def attention_pattern(
    query: Tensor,
    key: Tensor,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The attention probabilities of a ``scaled_dot_product_attention`` call: the softmax of
    :func:`attention_scores` over the keys; a row with every key masked is all zeros.

    >>> q = k = torch.ones(1, 1, 2, 4)
    >>> attention_pattern(q, k, is_causal=True)
    tensor([[[[1.0000, 0.0000],
              [0.5000, 0.5000]]]])
    """
    scores = attention_scores(
        _working(query), _working(key), attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return pattern_of_scores(scores, query.dtype)


def pattern_of_scores(scores: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The softmax of :func:`attention_scores` over the keys, a row with every key masked all
    zeros; computed in float32 for half-precision scores and returned in ``dtype`` (by default
    the scores' own).

    >>> pattern_of_scores(torch.tensor([[0.0, -math.inf], [-math.inf, -math.inf]]))
    tensor([[1., 0.],
            [0., 0.]])
    """
    dtype = scores.dtype if dtype is None else dtype
    scores = _working(scores)
    blind = torch.isneginf(scores).all(dim=-1, keepdim=True)  # a query that may see no key
    pattern = torch.softmax(scores.masked_fill(blind, 0.0), dim=-1).masked_fill(blind, 0.0)
    return pattern.to(dtype) if dtype in _LOW_PRECISION else pattern


def attend(pattern: Tensor, value: Tensor, *, enable_gqa: bool | None = None) -> Tensor:
    """``pattern @ value``: what the call returns for this pattern (an edited one, say).

    ``enable_gqa`` (default: when the pattern has more heads than ``value``) repeats each value
    head for its group of query heads, as the kernel does.
    """
    grouped = pattern.size(-3) != value.size(-3) if enable_gqa is None else enable_gqa
    v = _repeat_heads(_working(value), pattern.size(-3), "value") if grouped else _working(value)
    out = torch.matmul(_working(pattern), v)
    return out.to(value.dtype) if value.dtype in _LOW_PRECISION else out


def _working(tensor: Tensor) -> Tensor:
    """Half precision upcast for the arithmetic (the fused kernels accumulate in float32 too)."""
    return tensor.float() if tensor.dtype in _LOW_PRECISION else tensor


def _repeat_heads(tensor: Tensor, heads: int, what: str) -> Tensor:
    groups, remainder = divmod(heads, tensor.size(-3))
    if remainder:
        raise SpecError(
            f"{what} has {tensor.size(-3)} heads, which do not divide the query's {heads}; grouped-query "
            "attention needs a whole number of query heads per key/value head"
        )
    return tensor.repeat_interleave(groups, dim=-3)


def run_kernel(call: SdpaCall) -> Tensor:
    """``scaled_dot_product_attention`` again, on the call's (possibly edited) arguments."""
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


# -- heads: one layout whatever the kernel call's ---------------------------------------------------


@dataclass(frozen=True)
class HeadCounts:
    """An attention module's query and key/value head counts (grouped-query attention)."""

    heads: int
    kv_heads: int

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads


def head_counts(module: nn.Module) -> HeadCounts | None:
    """The head counts of a module whose code may repeat or pack heads before the kernel: a
    transformers attention module with ``num_key_value_groups`` > 1 (what its SDPA path reads to
    decide) and its query head count (``num_heads``, ``num_attention_heads``, or its config's).
    None for any other module: its calls are read as passed. Read once, when hooks attach.

    >>> attention = nn.Module()                   # as transformers' LlamaAttention holds them
    >>> attention.num_key_value_groups, attention.num_heads = 2, 4
    >>> head_counts(attention), head_counts(nn.Linear(2, 2))
    (HeadCounts(heads=4, kv_heads=2), None)
    """
    groups = getattr(module, "num_key_value_groups", None)
    if not isinstance(groups, int) or groups < 2:
        return None
    config = getattr(module, "config", None)
    for owner, attribute in ((module, "num_heads"), (module, "num_attention_heads"), (config, "num_attention_heads")):
        heads = getattr(owner, attribute, None)
        if isinstance(heads, int) and heads > 0 and heads % groups == 0:
            return HeadCounts(heads, heads // groups)
    return None


_QUERY_SIDE = frozenset({"q", "scores", "pattern", "z"})
_KEY_SIDE = frozenset({"k", "v"})


@dataclass(frozen=True)
class HeadLayout:
    """How one kernel call holds its heads, against the sub-sites' one layout: q, scores,
    pattern and z ``(batch, heads, queries, ...)``; k and v ``(batch, key/value heads, keys, size)``.

    ``packed``: transformers' ``pack_gqa`` (one query, a mask, grouped-query attention) passes
    q as ``(batch, kv heads, groups, size)``, query head ``h`` at ``(h // groups, h % groups)``,
    so the query-side values come back in that shape; ``repeated``: its ``repeat_kv`` passed k
    and v with each key/value head repeated ``repeated`` times in a row. 1: as passed.

    >>> q = torch.randn(1, 4, 1, 8)                          # 4 query heads, one query
    >>> packed = HeadLayout(packed=2).kernel("q", q)          # as pack_gqa passes it: 2 kv heads
    >>> packed.shape, torch.equal(HeadLayout(packed=2).documented("q", packed), q)
    (torch.Size([1, 2, 2, 8]), True)
    """

    packed: int = 1
    repeated: int = 1

    def documented(self, kind: str, tensor: Tensor) -> Tensor:
        """The kernel's value of ``kind`` in the documented layout (a view where one exists)."""
        if self.packed > 1 and kind in _QUERY_SIDE:
            return tensor.reshape(*tensor.shape[:-3], tensor.size(-3) * self.packed, 1, tensor.size(-1))
        if self.repeated > 1 and kind in _KEY_SIDE:
            return tensor[..., :: self.repeated, :, :]  # the first of each run of repeated heads
        return tensor

    def kernel(self, kind: str, tensor: Tensor) -> Tensor:
        """A value of ``kind`` in the documented layout, laid out as the kernel call takes it."""
        if self.packed > 1 and kind in _QUERY_SIDE:
            return tensor.reshape(*tensor.shape[:-3], tensor.size(-3) // self.packed, self.packed, tensor.size(-1))
        if self.repeated > 1 and kind in _KEY_SIDE:
            return tensor.repeat_interleave(self.repeated, dim=-3)
        return tensor

    def moves(self, kind: str) -> bool:
        """Whether ``kind``'s documented value is a new view, not the kernel's tensor itself."""
        return (self.packed > 1 and kind in _QUERY_SIDE) or (self.repeated > 1 and kind in _KEY_SIDE)


AS_PASSED = HeadLayout()


def head_layout(call: SdpaCall, counts: HeadCounts | None) -> HeadLayout:
    """The layout of one call of a module with ``counts`` (:func:`head_counts`), from its shapes
    alone: a call with ``enable_gqa``, or of a module without grouped heads, is read as passed.

    >>> counts = HeadCounts(heads=4, kv_heads=2)
    >>> q, kv = torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 5, 8)  # pack_gqa: one query per head
    >>> head_layout(SdpaCall(q, kv, kv), counts)
    HeadLayout(packed=2, repeated=1)
    >>> head_layout(SdpaCall(torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 5, 8), torch.zeros(1, 4, 5, 8)), counts)
    HeadLayout(packed=1, repeated=2)
    """
    query, key = call.query, call.key
    if counts is None or call.enable_gqa or counts.groups < 2 or query.dim() < 3 or key.dim() < 3:
        return AS_PASSED
    query_heads, key_heads = query.size(-3), key.size(-3)
    if query_heads == key_heads == counts.kv_heads and query.size(-2) == counts.groups:
        return HeadLayout(packed=counts.groups)
    if query_heads == key_heads == counts.heads:
        return HeadLayout(repeated=counts.groups)
    return AS_PASSED
