"""``CaptureOptions``: what a capture keeps and how, declared and checked in one place.

``hs.capture``, ``hs.run_with_capture``, ``hookscope capture`` and ``hs.extract`` (which keeps
its layers through captures) all build one of these, so an option means the same everywhere
and a bad value is refused before any hook is attached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hookscope._core.sites import Calls, Keep, call_filter, canonical_calls, keep_word, parse_keep
from hookscope._shared.dtypes import Overflow, floating_dtype, overflow_choice, parse_device
from hookscope._shared.options import Options
from hookscope._shared.reduce import Reduction, parse_reduction
from hookscope._shared.units import parse_bytes
from hookscope.errors import SpecError

__all__ = ["CaptureOptions", "CopyMode", "Passes"]

CopyMode = Literal["auto"] | bool
Passes = Literal["latest", "all"]


@dataclass(frozen=True)
class CaptureOptions(Options):
    """What a capture keeps of each selected module, and how.

    >>> opts = CaptureOptions(keep="both", dtype="bf16", calls="first")
    >>> opts.sides, opts.torch_dtype
    (('input', 'output'), torch.bfloat16)
    >>> CaptureOptions(calls="last", stop=True)
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: stop=True cannot keep calls='last': ...
    """

    feature = "capture"

    keep: Keep = "output"
    """``"output"`` (default), ``"input"`` (keyword inputs included, paths ``[0]``, ``['scale']``) or
    ``"both"``.
    """
    detach: bool = True
    """``True`` keeps values off the graph; ``False`` keeps the tensor the model made, in its graph
    (``torch.autograd.grad(loss, cache["fc"])`` works at every size), and the model goes on with a
    copy of it, so a later in-place write cannot change the kept one.
    """
    device: str | torch.device | None = None
    """Where kept values go (``"cpu"``: from CUDA through pinned memory, one sync per forward);
    default: where they were made.
    """
    dtype: torch.dtype | str | None = None
    """Cast floating values (``torch.float16``, ``"bf16"``)."""
    reduce: str | Reduction | None = None
    """Reduce on the device first: a reduction and its dimensions (``"mean:1"``, ``"last:1"``,
    ``"sum:2,3"``) or, from Python, a function.
    """
    calls: Calls = "all"
    """Which calls of a reused module: ``"all"``, ``"first"``, ``"last"``, an index or a list of
    indices.
    """
    stop: bool = False
    """End the forward once every selected module has been captured."""
    max_bytes: int | str | None = None
    """A budget in bytes (``1073741824``, ``"1GiB"``, ``"512MiB"``); outgrowing it is an error naming the
    largest sites.
    """
    copy: CopyMode = "auto"
    """``"auto"`` copies a kept value only before an in-place op would change it, ``True`` copies every
    value at once, ``False`` never copies and refuses to read a value changed after capture by an
    in-place op (its version counter tells; a write through ``.data``, ``untyped_storage()``, numpy
    or DLPack does not, and goes unseen: use ``"auto"`` for models that write that way).
    """
    passes: Passes = "latest"
    """``"latest"`` (each forward replaces the cache) or ``"all"`` (every pass's cache is kept,
    ``capture.passes``).
    """
    overflow: Overflow = "warn"
    """What a cast that turns finite values into +-inf does (float16 stops at 65504): ``"warn"``
    (default, a :class:`~hookscope.CastOverflowWarning` per pass naming the sites and counts),
    ``"error"`` (a ``CaptureError`` at the pass's end) or ``"ignore"``.
    """
    grads: bool = False
    """Also keep, per call, the gradient of whatever is differentiated later (a ``loss.backward()``, or
    ``run_with_capture(..., backward=metric)``) with respect to each kept value, as
    ``cache.grad[site]``, at every size; a value changed in place after it was kept still gets the
    gradient of the value as kept. Not with ``reduce``.
    """
    token_mask: str | None = "auto"
    """Which keyword input of the model's call marks its real tokens, for the named reductions over
    dimension 1 (``"mean:1"``, ``"last:1"``, ...), which then leave padding out as ``hs.extract``
    does: ``"auto"`` (default) reads ``attention_mask`` when the call has a 2-D one; a name reads
    that keyword, which every call must have; None never masks. On a vision-language model,
    ``"image"`` uses the positions holding image tokens only, ``"text"`` the other real tokens
    (:mod:`hookscope._arch.positions`). An attention kernel's values
    (``:attn.*`` sub-sites, ``op[scaled_dot_product_attention]``) are never masked: their
    dimension 1 is the heads.
    """

    def __post_init__(self) -> None:
        for flag in ("detach", "stop", "grads"):
            if not isinstance(getattr(self, flag), bool):
                raise SpecError(f"{flag}={getattr(self, flag)!r} is a capture option and takes True or False")
        if self.copy not in ("auto", True, False) or (isinstance(self.copy, int) and not isinstance(self.copy, bool)):
            raise SpecError(f"copy={self.copy!r} is not one of 'auto' (default), True, False")
        if self.passes not in ("latest", "all"):
            raise SpecError(f"passes={self.passes!r} is not 'latest' (each forward replaces the cache) or 'all'")
        if self.stop and self.calls == "last":
            raise SpecError(
                "stop=True cannot keep calls='last': the last call is known only when the forward ends; "
                "use calls='first', a call index, or stop=False"
            )
        if self.grads and self.reduce is not None:
            raise SpecError(
                f"grads=True cannot keep gradients of reduced values (reduce={self.reduce!r}): the model never "
                "used the reduced value; capture without reduce, and reduce the values and gradients afterwards"
            )
        if not (self.token_mask is None or (isinstance(self.token_mask, str) and self.token_mask)):
            raise SpecError(
                f"token_mask={self.token_mask!r} is not 'auto' (default), None, or the name of the model's keyword "
                "input that marks real tokens"
            )
        overflow_choice(self.overflow)
        parse_reduction(self.reduce)  # refused now, not in the first hook
        canonical: dict[str, Any] = {  # one spelling each, so equal options compare, hash and store alike
            "keep": keep_word(self.keep),
            "calls": canonical_calls(self.calls, also=("last",)),
            "dtype": floating_dtype(self.dtype),
            "device": parse_device(self.device),
            "max_bytes": None if self.max_bytes is None else parse_bytes(self.max_bytes),
        }
        for name, value in canonical.items():
            object.__setattr__(self, name, value)

    # Read once, when a capture attaches, for its hooks.

    @property
    def sides(self) -> tuple[str, ...]:
        """``("output",)``, ``("input",)`` or ``("input", "output")``."""
        return parse_keep(self.keep)

    @property
    def wants(self) -> Callable[[int], bool]:
        """Which call indices to keep (``"last"`` keeps every one until the pass ends)."""
        return call_filter(self.calls, also=("last",))

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The dtype to cast floating values to, or None."""
        return self.dtype if isinstance(self.dtype, torch.dtype) else None

    @property
    def torch_device(self) -> torch.device | None:
        """The device to move values to, or None."""
        return self.device if isinstance(self.device, torch.device) else None

    @property
    def budget(self) -> int | None:
        """``max_bytes`` in bytes, or None for no budget."""
        return self.max_bytes if isinstance(self.max_bytes, int) else None

    @property
    def mask_key(self) -> str | None:
        """The keyword input that holds the mask of real tokens, or None for no masking."""
        return "attention_mask" if self.token_mask == "auto" else self.token_mask

    @property
    def reduction(self) -> Reduction | None:
        """The reduction as a function, or None."""
        return parse_reduction(self.reduce)
