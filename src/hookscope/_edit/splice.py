"""SAE splicing: run a site's value through a sparse autoencoder and go on with the reconstruction.

:class:`Splice` is an edit (``edit(value, ctx) -> value``) that replaces the value ``x`` by
``sae.decode(sae.encode(x))``. The SAE is duck typed (any object with ``encode`` and ``decode``:
a plain ``nn.Module``, a SAELens ``SAE``); hookscope depends on no SAE library.

The latents of every spliced call are kept twice over, for two uses:

- to read: ``splice.latents``, a read-only mapping ``{site: latents}`` (detached) of the latest
  forward pass, keyed by the edited site as ``ctx.site`` writes it (``"h.1#0:output[0]"``);
- to hook: ``splice.hook_point``, an ``nn.Identity`` the latents pass through between
  ``encode`` and ``decode``, so a raw forward hook on it (or ``hs.edit(splice.hook_point, ...)``)
  sees the latents in the autograd graph and may replace them (ablate a feature).

:func:`topk_latents` keeps the ``k`` largest latents per vector, the sparse form to store;
:meth:`Splice.topk` makes the ``reduce=`` function that stores them with ``hs.extract``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hookscope._core.sites import Site
from hookscope._edit.context import EditContext, checked_path
from hookscope.errors import EditError, SiteNotFoundError, SpecError

__all__ = ["Latents", "SparseTopk", "Splice", "topk_latents"]


class Latents(Mapping[str, torch.Tensor]):
    """The latents of a splice's calls in the latest forward pass, by edited site; read-only.

    A key is the site as ``ctx.site`` writes it (``"h.1#0:output[0]"``); a site without its call
    index (``"h.1:output[0]"``) means call 0. ``last`` is the latest call's latents. A site seen
    again starts a new pass: the entries of the earlier pass are dropped then, so the mapping
    never mixes two batches.

    >>> latents = Latents()
    >>> latents._keep("h.1#0:output", torch.ones(2, 4))
    >>> list(latents), latents["h.1:output"].shape, latents.last.shape
    (['h.1#0:output'], torch.Size([2, 4]), torch.Size([2, 4]))
    """

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}
        self._last: str | None = None

    def _keep(self, site: str, latents: torch.Tensor) -> None:
        if site in self._values:  # the same site again: a new forward pass began
            self._values.clear()
        self._values[site] = latents
        self._last = site

    def __getitem__(self, key: str) -> torch.Tensor:
        found = self._values.get(key)
        if found is None and isinstance(key, str):
            try:
                found = self._values.get(str(Site.parse(key)))
            except SpecError:
                found = None
        if found is None:
            held = tuple(self._values)
            shown = ", ".join(held) if held else "none: no call was spliced yet"
            raise SiteNotFoundError(f"no latents for {key!r}; the sites spliced are {shown}", key=key, candidates=held)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def last(self) -> torch.Tensor:
        """The latents of the latest spliced call."""
        if self._last is None:
            raise SiteNotFoundError(
                "no latents yet: the splice has not run; run the model inside hs.edit(model, {site: splice})",
                key="last",
                candidates=(),
            )
        return self._values[self._last]

    def __repr__(self) -> str:
        shown = ", ".join(f"{site}: {tuple(value.shape)}" for site, value in self._values.items())
        return f"<Latents {{{shown}}}>"


class Splice:
    """The edit of :func:`hookscope.edits.splice`: ``x -> sae.decode(sae.encode(x))``.

    With ``keep_error`` the result is ``recon + (x - recon).detach()``: equal to ``x`` up to float
    rounding, so everything downstream runs as without the splice, while the gradient reaches the
    latents as if the site's value were the reconstruction and the error ``x - recon`` a constant
    (the "error node" of attribution patching). Without the ``detach`` the error would cancel
    the latents' contribution and their gradient would be exactly zero. The same rule has a
    consequence upstream: the gradient reaches the values and parameters before the site through
    the SAE (``encode``, ``decode``) only, not through the error term, so it is the gradient of the
    spliced model, not the clean model's.

    The SAE is neither moved nor cast: a value of another dtype or device than the SAE's first
    floating parameter (or its ``dtype``/``device`` attributes, for an SAE that is not a module)
    is cast to the SAE's for ``encode`` and ``decode``, and the reconstruction is cast back.
    """

    def __init__(self, sae: Any, *, keep_error: bool = False, path: str | None = None) -> None:
        missing = [name for name in ("encode", "decode") if not callable(getattr(sae, name, None))]
        if missing:
            raise SpecError(
                f"splice() takes a sparse autoencoder, and this {type(sae).__name__} has no callable "
                f"{' or '.join(missing)}; expected an object with encode(x) -> latents and decode(latents) -> x "
                "(an nn.Module of your own, a SAELens SAE): give it those two methods, or wrap it in one"
            )
        if not isinstance(keep_error, bool):
            raise SpecError(f"splice(keep_error={keep_error!r}): expected True or False")
        checked_path(path)
        self.sae = sae
        self.keep_error = keep_error
        self.path = path
        #: The latents pass through this module between ``encode`` and ``decode``: a forward hook
        #: on it sees them in the autograd graph, and what the hook returns is what is decoded.
        self.hook_point = nn.Identity()
        self.latents = Latents()

    def __call__(self, value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
        dtype, device = _place_of(self.sae)
        x = value.to(dtype=dtype or value.dtype, device=device or value.device)
        try:
            latents = self.hook_point(self.sae.encode(x))
            recon = self.sae.decode(latents)
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"raised by the SAE of hs.edits.splice at {ctx.site}")
            raise
        if not isinstance(recon, torch.Tensor) or recon.shape != value.shape:
            got = f"shape {tuple(recon.shape)}" if isinstance(recon, torch.Tensor) else f"a {type(recon).__name__}"
            raise EditError(
                f"{ctx.site}: sae.decode(sae.encode(x)) returned {got}, expected the site's shape "
                f"{tuple(value.shape)}; splice an SAE trained on this site (its d_in is the value's last dim)"
            )
        self.latents._keep(ctx.site, latents.detach())
        recon = recon.to(dtype=value.dtype, device=value.device)
        if self.keep_error:
            return recon + (value - recon).detach()
        return recon

    def topk(self, k: int) -> SparseTopk:
        """A ``reduce=`` function for ``hs.extract`` at the spliced site: the ``k`` largest latents of
        each vector (a :class:`SparseTopk`), packed in one float32 tensor ``(..., 2k)``:
        ``[..., :k]`` the values, ``[..., k:]`` the latent indices (exact as float32 for SAEs
        under 2**24 latents). The store records it as sparse: ``store[site].dense()`` and
        ``.sparse()`` read it back. ``hs.extract`` runs unedited, so these are the latents of the
        clean forward at that site, as the splice would compute them there.

        >>> import torch
        >>> sae = torch.nn.Module()
        >>> sae.encode, sae.decode = (lambda x: x * 10), (lambda z: z / 10)
        >>> Splice(sae).topk(1)(torch.tensor([[1.0, 3.0, 2.0]]))
        tensor([[30.,  1.]])
        """
        return SparseTopk(functools.partial(_encode_placed, self.sae), k)

    def __repr__(self) -> str:
        parts = [type(self.sae).__name__] + (["keep_error=True"] if self.keep_error else [])
        parts += [f"path={self.path!r}"] if self.path else []
        return f"hs.edits.splice({', '.join(parts)})"


def topk_latents(latents: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest latents along the last dim: ``(values, indices)``, each ``(..., k)``.

    The sparse form of SAE latents: a ``(batch, seq, d_sae)`` tensor becomes two
    ``(batch, seq, k)`` ones; ``torch.zeros(..., d_sae).scatter(-1, indices, values)`` gives the
    dense one back when ``k`` covers every non-zero latent.

    >>> values, indices = topk_latents(torch.tensor([[0.0, 5.0, 0.0, 2.0]]), 2)
    >>> values.tolist(), indices.tolist()
    ([[5.0, 2.0]], [[1, 3]])
    """
    _check_k(k)
    if not isinstance(latents, torch.Tensor) or latents.dim() == 0:
        raise SpecError(f"topk_latents() takes a tensor of latents (..., d_sae), got {_described(latents)}")
    if k > latents.shape[-1]:
        raise SpecError(f"topk_latents(k={k}) asks for more latents than the {latents.shape[-1]} there are")
    values, indices = latents.topk(k, dim=-1)
    return values, indices


class SparseTopk:
    """A ``reduce=`` for ``hs.extract`` that stores sparse latents: the ``k`` largest of
    ``encode(value)`` per vector, packed as one float32 tensor ``(..., 2k)`` (values, then indices).

    A store of ``d_sae`` latents per token would be ``d_sae / 2k`` times larger dense (24576 latents
    at k=64: 192 times). The store records the site as sparse (``k`` and the latents' width, learned
    at the first batch), and reads it back dense (``store[site].dense(rows)``, ``(rows, ..., width)``)
    or as a ``torch.sparse_coo_tensor`` (``store[site].sparse(rows)``). ``encode`` is any function
    ``(..., d) -> (..., width)``: an SAE's, a transcoder's, a probe's; ``splice.topk(k)`` makes one
    for a spliced SAE. Store it without ``dtype=``: a narrower float would round the indices.

    >>> reduce = SparseTopk(lambda x: x * 10, k=1)
    >>> reduce(torch.tensor([[1.0, 3.0, 2.0]])), reduce.sparse_latents
    (tensor([[30.,  1.]]), (1, 3))
    """

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], k: int) -> None:
        _check_k(k)
        if not callable(encode):
            raise SpecError(f"SparseTopk(encode={encode!r}): expected a function tensor -> latents")
        self.encode = encode
        self.k = k
        self.width: int | None = None  # the latents' width, known after the first call

    @property
    def sparse_latents(self) -> tuple[int, int | None]:
        """``(k, width)``: what a store records of this reduction (``width`` None before the first call)."""
        return self.k, self.width

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        latents = self.encode(value)
        if not isinstance(latents, torch.Tensor) or latents.dim() == 0:
            raise SpecError(f"SparseTopk: encode returned {_described(latents)}; expected latents (..., width)")
        self.width = int(latents.shape[-1])
        values, indices = topk_latents(latents, self.k)
        return torch.cat([values.float(), indices.float()], dim=-1).to(value.device)

    def __repr__(self) -> str:
        return f"SparseTopk(k={self.k})"


def _encode_placed(sae: Any, value: torch.Tensor) -> torch.Tensor:
    """``sae.encode(value)`` in the dtype and on the device the SAE computes in."""
    dtype, device = _place_of(sae)
    latents: torch.Tensor = sae.encode(value.to(dtype=dtype or value.dtype, device=device or value.device))
    return latents


def _place_of(sae: Any) -> tuple[torch.dtype | None, torch.device | None]:
    """The dtype and device the SAE computes in: its first floating parameter or buffer's, else
    its ``dtype``/``device`` attributes (None: the value's own)."""
    if isinstance(sae, nn.Module):
        for tensor in itertools.chain(sae.parameters(), sae.buffers()):
            if tensor.is_floating_point():
                return tensor.dtype, tensor.device
    dtype, device = getattr(sae, "dtype", None), getattr(sae, "device", None)
    return (
        dtype if isinstance(dtype, torch.dtype) else None,
        torch.device(device) if isinstance(device, (str, torch.device)) else None,
    )


def _check_k(k: object) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise SpecError(f"k={k!r}: expected a whole number of latents >= 1")


def _described(value: object) -> str:
    return f"a 0-d tensor {value!r}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
