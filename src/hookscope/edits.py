"""Built-in edits for :func:`hookscope.edit`: ablate, patch, steer, scale, clamp, add noise, replace.

Each returns an edit, a callable ``edit(value, ctx) -> value``, and takes the same optional
keywords: the part to touch (``channels=``, ``neurons=``, ``positions=``, ``heads=`` with
``num_heads=`` or, at an attention sub-site, alone; ``mask=``; see :mod:`hookscope._edit.part`)
and ``path=``, which tensor of a structured value to edit: written in full (``"output[0]"`` of a transformers block,
``"input['mask']"``) or relative to the value edited (``"[0]"``, ``"['mask']"``); by default the
first tensor. A path on the other side than the edit's ``on=`` is refused when the edit is attached.
Every edit is out of place: the module's own tensor is never written, so autograd stays intact
and an edit in a training step gets gradients.

>>> import torch, hookscope as hs
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
>>> with hs.edit(model, {"0": hs.edits.zero(neurons=[0, 1])}):
...     out = model(torch.ones(2, 3))
>>> out[:, :2].abs().sum().item()
0.0
"""

from __future__ import annotations

import difflib
import numbers
import zlib
from typing import Any

import torch

from hookscope._core.sites import Site
from hookscope._edit.context import EditContext, checked_path
from hookscope._edit.part import Part
from hookscope._edit.splice import SparseTopk, Splice, topk_latents
from hookscope._shared.names import public_dir
from hookscope.errors import EditError, SiteNotFoundError, SpecError

__all__ = [
    "Edit",
    "SparseTopk",
    "Splice",
    "add",
    "clamp",
    "mean",
    "noise",
    "patch",
    "replace",
    "scale",
    "splice",
    "topk_latents",
    "zero",
]


class Edit:
    """A built-in edit: what it does, to which part, of which tensor (``path``)."""

    def __init__(self, *, path: str | None = None, part: Part) -> None:
        checked_path(path)
        self.path = path
        self.part = part

    def __call__(self, value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
        return self.apply(value, self.part.mask_for(value, ctx), ctx)

    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        """The edited value; ``mask`` (None: everything) is the part to change."""
        raise NotImplementedError

    def _where(self, mask: torch.Tensor | None, new: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if mask is not None:
            return torch.where(mask, new, value)
        # A fresh tensor of the value's own shape: never a broadcast view or someone else's tensor
        # (the user's replacement, a cache), which an in-place op further on would write into.
        return new.expand_as(value).clone()

    def settings(self) -> dict[str, Any]:
        """What the edit does, for its repr (the part and path are added)."""
        return {}

    def __repr__(self) -> str:
        named = {k: v for k, v in vars(self.part).items() if v is not None and not k.startswith("_")}
        parts = [f"{k}={v!r}" for k, v in self.settings().items()]
        parts += [f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in named.items()]
        parts += [f"path={self.path!r}"] if self.path else []
        return f"hs.edits.{type(self).__name__.lower()}({', '.join(parts)})"


class Zero(Edit):
    """Zero ablation."""

    def __call__(self, value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
        along = self.part.along_one_dim(value, ctx)
        if along is not None:  # a few indices along one dim: index_fill is several times faster than a mask
            dim, indices = along
            return value.index_fill(dim, indices, 0)
        return super().__call__(value, ctx)

    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        return torch.zeros_like(value) if mask is None else value.masked_fill(mask, 0)


class Scale(Edit):
    def __init__(self, factor: float, **options: Any) -> None:
        _check_number("scale", "factor", factor, tensor_ok=True)
        super().__init__(**options)
        self.factor = factor

    def settings(self) -> dict[str, Any]:
        return {"factor": self.factor}

    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        return self._where(mask, value * self.factor, value)


class Clamp(Edit):
    def __init__(self, low: float | None, high: float | None, **options: Any) -> None:
        if low is None and high is None:
            raise SpecError("clamp() needs min= or max= (or both)")
        for name, bound in (("min", low), ("max", high)):
            if bound is not None:
                _check_number("clamp", name, bound)
        super().__init__(**options)
        self.low, self.high = low, high

    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in (("min", self.low), ("max", self.high)) if v is not None}

    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        return self._where(mask, value.clamp(self.low, self.high), value)


class Add(Edit):
    def __init__(self, vector: torch.Tensor, factor: float, **options: Any) -> None:
        if not isinstance(vector, torch.Tensor):
            raise SpecError(f"add() takes a tensor (a steering vector), not a {type(vector).__name__}")
        _check_number("add", "scale", factor, tensor_ok=True)
        super().__init__(**options)
        self.vector, self.factor = vector, factor

    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        delta = self.vector.to(device=value.device, dtype=value.dtype) * self.factor
        _broadcasts(delta, value, ctx, "the vector")
        return value + (delta if mask is None else delta * mask)


class Noise(Edit):
    def __init__(self, std: float, seed: int, **options: Any) -> None:
        _check_number("noise", "std", std)
        _check_number("noise", "seed", seed, integral=True)
        if std < 0:
            raise SpecError(f"noise(std={std}) is negative; expected a standard deviation >= 0")
        super().__init__(**options)
        self.std, self.seed = std, seed

    def settings(self) -> dict[str, Any]:
        return {"std": self.std, "seed": self.seed}

    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        # One generator per site and call, seeded from (seed, site): the same edit gives the same
        # noise in every run, and two sites with the same seed get different noise.
        generator = torch.Generator(device=value.device)
        generator.manual_seed(zlib.crc32(f"{self.seed}:{ctx.name}:{ctx.call}:{ctx.label}".encode()))
        drawn = torch.randn(value.shape, generator=generator, device=value.device, dtype=value.dtype)
        return value + (drawn * self.std if mask is None else drawn * self.std * mask)


class Replace(Edit):
    def __init__(self, tensor: torch.Tensor, **options: Any) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise SpecError(f"replace() takes a tensor, not a {type(tensor).__name__}")
        super().__init__(**options)
        self.tensor = tensor

    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        new = self.tensor.to(device=value.device, dtype=value.dtype)
        _broadcasts(new, value, ctx, "the replacement")
        return self._where(mask, new.expand_as(value), value)


class FromCache(Edit):
    """Values captured in another run (``hs.capture``/``hs.run_with_capture``), looked up by site."""

    def __init__(self, cache: Any, **options: Any) -> None:
        if not hasattr(cache, "resolve"):
            raise SpecError(
                f"expected a Cache from hs.run_with_capture or hs.capture(...).cache, not {type(cache).__name__}"
            )
        super().__init__(**options)
        self.cache = cache

    def source(self, ctx: EditContext) -> torch.Tensor:
        site = Site(ctx.name, ctx.call, ctx.side, ctx.path, op=ctx.op)
        try:
            cached: torch.Tensor = self.cache[site]
        except SiteNotFoundError as error:
            raise EditError(f"{ctx.site}: the cache holds no value for {site} ({error})") from None
        return cached.detach()  # the other run's graph is not this run's business

    def _reduced(self) -> str:
        reduce = getattr(self.cache, "meta", {}).get("reduce")
        return f" (the capture was taken with reduce={reduce!r}: capture without it)" if reduce else ""


class Mean(FromCache):
    def __init__(self, cache: Any, **options: Any) -> None:
        super().__init__(cache, **options)
        self._averages: dict[tuple[Any, ...], torch.Tensor] = {}

    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        key = (ctx.name, ctx.call, ctx.side, ctx.path, tuple(value.shape[1:]), value.device, value.dtype)
        average = self._averages.get(key)
        if average is None:  # looked up, checked and averaged once per site and shape, not at every call
            cached = self.source(ctx)
            if cached.dim() != value.dim() or cached.shape[1:] != value.shape[1:]:
                raise EditError(
                    f"{ctx.site}: the cached values have shape {tuple(cached.shape)}, this run {tuple(value.shape)}; "
                    f"a mean over the batch needs the same shape past dim 0{self._reduced()}"
                )
            average = cached.float().mean(0, keepdim=True).to(device=value.device, dtype=value.dtype)
            self._averages[key] = average
        return self._where(mask, average.expand_as(value), value)


class Patch(FromCache):
    def apply(self, value: torch.Tensor, mask: torch.Tensor | None, ctx: EditContext) -> torch.Tensor:
        cached = self.source(ctx).to(device=value.device, dtype=value.dtype)
        if cached.shape != value.shape:
            raise EditError(
                f"{ctx.site}: the cached value has shape {tuple(cached.shape)}, this run {tuple(value.shape)}; "
                f"patch between runs of the same input shape{self._reduced()}"
            )
        return self._where(mask, cached, value)


def _check_number(edit: str, name: str, value: object, *, tensor_ok: bool = False, integral: bool = False) -> None:
    """Refuse, when the edit is made, an argument the edit could not compute with when it runs."""
    if isinstance(value, numbers.Integral if integral else numbers.Real):
        return
    if tensor_ok and isinstance(value, torch.Tensor):
        return  # broadcast against the value, e.g. one factor per channel
    expected = "an int" if integral else "a number or a tensor" if tensor_ok else "a number"
    raise SpecError(f"{edit}({name}={value!r}): expected {expected}, got {type(value).__name__}")


def _broadcasts(new: torch.Tensor, value: torch.Tensor, ctx: EditContext, what: str) -> None:
    try:
        shape = torch.broadcast_shapes(new.shape, value.shape)  # type: ignore[no-untyped-call]
    except RuntimeError:
        shape = None
    if shape != value.shape:
        raise EditError(f"{ctx.site}: {what} of shape {tuple(new.shape)} does not broadcast to {tuple(value.shape)}")


_PART_KEYWORDS = ("channels", "neurons", "positions", "heads", "num_heads", "mask")


def _options(path: str | None, part: dict[str, Any]) -> dict[str, Any]:
    unknown = [key for key in part if key not in _PART_KEYWORDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], _PART_KEYWORDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise SpecError(
            f"unknown keyword {unknown[0]!r} for this edit; the part is named with "
            f"{', '.join(_PART_KEYWORDS)}, the tensor with path={hint}"
        )
    return {"path": path, "part": Part.of(**part)}


def zero(*, path: str | None = None, **part: Any) -> Edit:
    """Zero ablation of the value (or of its ``channels=``, ``neurons=``, ``positions=``, ... part)."""
    return Zero(**_options(path, part))


def scale(factor: float, *, path: str | None = None, **part: Any) -> Edit:
    """Multiply by ``factor``."""
    return Scale(factor, **_options(path, part))


def clamp(min: float | None = None, max: float | None = None, *, path: str | None = None, **part: Any) -> Edit:  # noqa: A002
    """Clamp to ``[min, max]`` (either may be left out)."""
    return Clamp(min, max, **_options(path, part))


def add(vector: torch.Tensor, scale: float = 1.0, *, path: str | None = None, **part: Any) -> Edit:
    """Add ``scale * vector`` (steering); the vector broadcasts against the value (e.g. shape ``(d_model,)``)."""
    return Add(vector, scale, **_options(path, part))


def noise(std: float, seed: int = 0, *, path: str | None = None, **part: Any) -> Edit:
    """Add Gaussian noise of standard deviation ``std``, drawn from a generator seeded with ``seed``."""
    return Noise(std, seed, **_options(path, part))


def replace(tensor: torch.Tensor, *, path: str | None = None, **part: Any) -> Edit:
    """Replace with ``tensor`` (broadcast against the value)."""
    return Replace(tensor, **_options(path, part))


def mean(cache: Any, *, path: str | None = None, **part: Any) -> Edit:
    """Mean ablation: the value captured at the same site in ``cache``, averaged over the batch (dim 0)."""
    return Mean(cache, **_options(path, part))


def patch(cache: Any, *, path: str | None = None, **part: Any) -> Edit:
    """Activation patching: the value captured at the same site and call in another run (``cache``)."""
    return Patch(cache, **_options(path, part))


def splice(sae: Any, *, keep_error: bool = False, path: str | None = None) -> Splice:
    """Replace the value by its SAE reconstruction, ``sae.decode(sae.encode(x))``, keeping the latents.

    ``sae`` is any object with ``encode`` and ``decode`` (an ``nn.Module`` of your own, a SAELens
    ``SAE``); it is neither moved nor cast: a value of another dtype or device is cast to the
    SAE's (its first floating parameter's) and the reconstruction cast back.

    Args:
        sae: the sparse autoencoder; anything without callable ``encode``/``decode`` is a
            :class:`~hookscope.errors.SpecError`.
        keep_error: add the reconstruction error back as a constant, ``recon + (x - recon).detach()``:
            the value downstream is ``x`` (up to float rounding), and the gradient still reaches the
            latents (as if the error were fixed) and, through the SAE, what comes before the site.
        path: which tensor of a structured value, as for every edit (``"output[0]"``).

    The returned :class:`~hookscope._edit.splice.Splice` keeps the latents of the latest pass in
    ``splice.latents`` (``{site: latents}``, detached; ``.last``), passes them through
    ``splice.hook_point`` (an ``nn.Identity``: a forward hook there sees them with their graph and
    may replace them), and makes ``hs.extract`` reductions with ``splice.topk(k)``. A decode of
    another shape than the site's is an :class:`~hookscope.errors.EditError` naming the site.

    >>> import torch, hookscope as hs
    >>> class SAE(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.enc, self.dec = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
    ...     def encode(self, x):
    ...         return torch.relu(self.enc(x))
    ...     def decode(self, z):
    ...         return self.dec(z)
    >>> model, sae = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()), SAE()
    >>> spliced = hs.edits.splice(sae, keep_error=True)
    >>> x = torch.ones(2, 3)
    >>> with hs.edit(model, {"0": spliced}):
    ...     out = model(x)
    >>> torch.allclose(out, model(x)), list(spliced.latents), spliced.latents.last.shape
    (True, ['0#0:output'], torch.Size([2, 8]))
    """
    return Splice(sae, keep_error=keep_error, path=path)


def __dir__() -> list[str]:
    """``__all__``, the dunders and public submodules, not the imports: what tab completion offers."""
    return public_dir(__name__)
