"""Per-layer reductions for data-set extraction.

A store keeps one row per input, so a reduction must keep dimension 0 (the batch). On top of
the capture's named reductions (``"mean:1"``, ``"max:1"``, ``"first:1"``, ...) extraction knows
two names for sequences: ``"cls"`` (position 0, written ``first:1``) and ``"last"`` (the last
position, ``last:1``).

Padding is left out by the capture itself: a named reduction over dimension 1 uses only the
real positions of the batch's mask (``token_mask`` of :class:`~hookscope.CaptureOptions`, the
extraction's ``mask``; see ``hookscope._shared.reduce``), so a stored row is what ``hs.capture``
keeps of the same padded batch.
"""

from __future__ import annotations

import functools
import hashlib
import re

from hookscope._shared.reduce import Reduction, parse_reduction
from hookscope.errors import SpecError

__all__ = ["ALIASES", "describe_reduction", "extraction_reduction"]

#: Names extraction adds to the capture's reductions.
ALIASES = {"cls": "first:1", "last": "last:1", "first": "first:1"}


def describe_reduction(spec: str | Reduction | None) -> str | None:
    """The text a store records for a reduction: its spec, or a function's name and a hash of its code.

    The hash tells two lambdas (or two edits of one function) apart, so a resumed run with
    another reduction function is refused like one with another named reduction.

    >>> describe_reduction("cls"), describe_reduction(None)
    ('first:1', None)
    >>> describe_reduction(lambda v: v.mean(1)) != describe_reduction(lambda v: v.amax(1))
    True
    """
    if spec is None or isinstance(spec, str):
        return ALIASES.get(spec, spec) if isinstance(spec, str) else None
    sparse = getattr(spec, "sparse_latents", None)  # SparseTopk: its k and encoder tell it apart
    if sparse is not None:  # object addresses differ between runs: left out
        encoder = re.sub(r" at 0x[0-9a-fA-F]+", "", str(describe_reduction(getattr(spec, "encode", None))))
        return f"sparse_topk(k={sparse[0]}, encode={encoder})"
    if isinstance(spec, functools.partial):
        return f"partial({describe_reduction(spec.func)}, args={spec.args!r}, keywords={spec.keywords!r})"
    module = getattr(spec, "__module__", "") or ""
    name = getattr(spec, "__qualname__", type(spec).__qualname__)
    method = vars(type(spec)).get("__call__")  # a callable object: the code of its class's __call__
    code = getattr(spec, "__code__", None) or getattr(method, "__code__", None)
    digest = ""
    if code is not None:
        parts = (code.co_code, repr(code.co_consts).encode(), repr(code.co_names).encode())
        digest = " " + hashlib.blake2b(b"|".join(parts), digest_size=6).hexdigest()
    return f"{module}.{name}{digest}" if module else f"{name}{digest}"


def extraction_reduction(spec: str | Reduction | None) -> Reduction | None:
    """The function a capture applies, for ``spec``: a named one (aliases read) leaves padding out
    when called with the batch's mask, as the capture calls it.

    >>> import torch
    >>> x = torch.tensor([[[1.0], [3.0], [100.0]]])        # one row, 3 positions, the last a pad
    >>> extraction_reduction("mean:1")(x).tolist()
    [[34.666...]]
    >>> real = torch.tensor([[True, True, False]])
    >>> extraction_reduction("mean:1")(x, real).tolist(), extraction_reduction("last")(x, real).tolist()
    ([[2.0]], [[3.0]])
    """
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str):
        raise SpecError(f"reduce={spec!r} is not usable; expected None, a function tensor -> tensor, or e.g. 'mean:1'")
    text = ALIASES.get(spec, spec)
    name, _, dims_text = text.partition(":")
    plain = parse_reduction(text)  # checks the name and the dimensions, with the capture's messages
    if not dims_text:
        raise SpecError(
            f"reduce={spec!r} reduces every dimension, the batch too; a store keeps one row per input: "
            f"name the dimensions, e.g. '{name}:1'"
        )
    dims = tuple(int(part) for part in dims_text.split(","))
    if 0 in dims:
        raise SpecError(
            f"reduce={spec!r} reduces dimension 0, the batch; a store keeps one row per input: "
            "reduce other dimensions, e.g. 'mean:1'"
        )
    return plain
