"""Which part of a tensor an edit touches: channels, neurons, positions, heads, or a mask.

Every built-in edit takes these keywords; they combine (``positions=[3], neurons=[7]`` is the
7th neuron at position 3). The part becomes a boolean mask that broadcasts against the value:

=================  ==========================================================================
``channels``       dim 1 (``N, C, ...``: conv feature maps, ``(batch, features)``)
``neurons``        the last dim (hidden units of a Linear, the model dimension of a transformer)
``positions``      dim 1 of a ``(batch, sequence, ...)`` value: token positions
``heads``          with ``num_heads``: the last dim read as ``num_heads`` blocks of
                   ``dim // num_heads``; alone, at an attention sub-site (``:attn.z``,
                   ``:attn.pattern``, ... all ``(batch, heads, ...)``): dim 1
``mask``           a boolean tensor that broadcasts against the value
=================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hookscope._edit.context import EditContext
from hookscope.errors import EditError, SpecError

__all__ = ["Part"]

_MAX_MASKS = 64  # masks kept per part (one per shape and device); the mask= tensor is read when first used


def _indices(name: str, values: int | Iterable[int] | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    chosen = (values,) if isinstance(values, int) else tuple(values)
    if not chosen or not all(isinstance(v, int) and not isinstance(v, bool) for v in chosen):
        raise SpecError(f"{name}={values!r}: expected an index or a non-empty list of indices, e.g. {name}=[0, 3]")
    return chosen


@dataclass(frozen=True, eq=False)
class Part:
    """The selected part of a value (every keyword None: the whole value)."""

    channels: tuple[int, ...] | None = None
    neurons: tuple[int, ...] | None = None
    positions: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    num_heads: int | None = None
    mask: torch.Tensor | None = None
    _masks: dict[tuple[tuple[int, ...], str], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    _indices: dict[tuple[tuple[int, ...], str], tuple[int, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(
        cls,
        *,
        channels: int | Iterable[int] | None = None,
        neurons: int | Iterable[int] | None = None,
        positions: int | Iterable[int] | None = None,
        heads: int | Iterable[int] | None = None,
        num_heads: int | None = None,
        mask: torch.Tensor | None = None,
    ) -> Part:
        """Check the keywords and build the part."""
        if num_heads is not None and heads is None:
            raise SpecError("num_heads= needs heads= (which heads to edit)")
        if num_heads is not None and (not isinstance(num_heads, int) or num_heads < 1):
            raise SpecError(f"num_heads={num_heads!r}: expected a positive whole number")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
            raise SpecError("mask= takes a boolean tensor that broadcasts against the edited value")
        return cls(
            _indices("channels", channels),
            _indices("neurons", neurons),
            _indices("positions", positions),
            _indices("heads", heads),
            num_heads,
            mask,
        )

    @property
    def whole(self) -> bool:
        """True when no part was named: the edit applies to the whole value."""
        return all(v is None for v in (self.channels, self.neurons, self.positions, self.heads, self.mask))

    def along_one_dim(self, value: torch.Tensor, ctx: EditContext) -> tuple[int, torch.Tensor] | None:
        """``(dim, indices)`` when the part is a plain index along one dim (``channels=``,
        ``neurons=``, ``positions=`` or ``heads=`` alone), for ``index_fill``; else None."""
        named = [name for name in ("channels", "neurons", "positions", "heads") if getattr(self, name) is not None]
        if len(named) != 1 or self.mask is not None:
            return None
        mask = self.mask_for(value, ctx)  # checks the indices, and names the site if they are wrong
        if mask is None:
            return None
        key = (tuple(value.shape), str(value.device))
        known = self._indices.get(key)
        if known is None:
            along_dim_1 = named[0] in ("channels", "positions") or (named[0] == "heads" and self.num_heads is None)
            dim = 1 if along_dim_1 else value.dim() - 1
            known = (dim, mask.reshape(-1).nonzero().reshape(-1))
            if len(self._indices) >= _MAX_MASKS:
                self._indices.clear()
            self._indices[key] = known
        return known

    def mask_for(self, value: torch.Tensor, ctx: EditContext) -> torch.Tensor | None:
        """A boolean mask that broadcasts against ``value`` (None for the whole value)."""
        if self.whole:
            return None
        if self.heads is not None and self.num_heads is None and not ctx.op.startswith("attn."):
            raise EditError(
                f"{ctx.site}: heads={list(self.heads)} without num_heads= names dim 1 of a value held per head, "
                "an attention sub-site such as 'h.0.attn:attn.z'; here give num_heads= too (the last dim "
                "read as num_heads blocks), e.g. heads=[1], num_heads=12"
            )
        if self.num_heads is not None and ctx.op.startswith("attn."):
            raise EditError(
                f"{ctx.site}: num_heads={self.num_heads} reads the last dim as heads, but an attention sub-site "
                f"holds its heads on dim 1 already (shape {tuple(value.shape)}); drop num_heads=: "
                f"heads={list(self.heads or ())} alone names them"
            )
        key = (tuple(value.shape), str(value.device))
        known = self._masks.get(key)
        if known is None:
            known = self._build(value, ctx.site)  # the site's name is formatted only here, once per shape
            if len(self._masks) >= _MAX_MASKS:  # a generation loop grows the sequence every step
                self._masks.clear()
            self._masks[key] = known  # built once per shape and device: no host work on later calls
        return known

    def _build(self, value: torch.Tensor, site: str) -> torch.Tensor:
        ndim = value.dim()
        result = torch.ones((1,) * ndim, dtype=torch.bool, device=value.device)
        if self.channels is not None:
            result = result & self._along(value, 1, self.channels, "channels", site)
        if self.positions is not None:
            if ndim < 3:
                raise EditError(
                    f"{site}: positions= needs a (batch, sequence, ...) value; this one has shape {tuple(value.shape)}"
                )
            result = result & self._along(value, 1, self.positions, "positions", site)
        if self.neurons is not None:
            result = result & self._along(value, ndim - 1, self.neurons, "neurons", site)
        if self.heads is not None and self.num_heads is not None:
            width = value.shape[-1]
            if width % self.num_heads:
                raise EditError(
                    f"{site}: the last dim has {width} values, not a multiple of num_heads={self.num_heads}"
                )
            size = width // self.num_heads
            if any(not -self.num_heads <= head < self.num_heads for head in self.heads):
                raise EditError(f"{site}: heads={list(self.heads)} outside the {self.num_heads} heads")
            units = [(head % self.num_heads) * size + i for head in self.heads for i in range(size)]
            result = result & self._along(value, ndim - 1, tuple(units), "heads", site)
        if self.heads is not None and self.num_heads is None:  # at an attention sub-site: (batch, heads, ...)
            result = result & self._along(value, 1, self.heads, "heads", site)
        if self.mask is not None:
            mask = self.mask.to(value.device)
            try:
                fits = torch.broadcast_shapes(mask.shape, value.shape) == value.shape  # type: ignore[no-untyped-call]
            except RuntimeError:
                fits = False
            if not fits:
                raise EditError(
                    f"{site}: mask of shape {tuple(mask.shape)} does not broadcast to the value's {tuple(value.shape)}"
                )
            result = result & mask
        return result

    @staticmethod
    def _along(value: torch.Tensor, dim: int, indices: tuple[int, ...], name: str, site: str) -> torch.Tensor:
        if value.dim() < 2 or dim < 0:
            raise EditError(
                f"{site}: {name}= needs a value with a batch dim and more; it has shape {tuple(value.shape)}"
            )
        size = value.shape[dim]
        bad = [i for i in indices if not -size <= i < size]
        if bad:
            raise EditError(f"{site}: {name}={bad} outside the {size} along dim {dim} of shape {tuple(value.shape)}")
        shape = [1] * value.dim()
        shape[dim] = size
        selected = torch.zeros(size, dtype=torch.bool)
        selected[list(indices)] = True
        return selected.view(shape).to(value.device)
