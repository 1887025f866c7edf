"""``ExtractConfig``: how an extraction runs and what its store records, declared and checked once.

``hs.extract`` and ``hookscope extract`` build one. Its :meth:`ExtractConfig.recorded` part is
what the store keeps and what a resumed run is compared against; what a capture keeps
(``keep``, ``calls``, ``dtype``) is checked by :class:`~hookscope.CaptureOptions` itself, so
an extraction accepts exactly what a capture does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hookscope._capture import CaptureOptions
from hookscope._core.sites import Calls, Keep
from hookscope._extract.data import Inputs
from hookscope._extract.pipeline import ReduceOption
from hookscope._extract.provenance import TokensOption
from hookscope._shared.credentials import redacted_command, redacted_options
from hookscope._shared.dtypes import Overflow, overflow_choice, parse_device
from hookscope._shared.options import Options
from hookscope.errors import SpecError

__all__ = ["ExtractConfig"]


@dataclass(frozen=True)
class ExtractConfig(Options):
    """How :func:`hookscope.extract` runs.

    What is stored: ``reduce`` per layer before storing (``"mean:1"``, ``"cls"``, ``"last"``, a
    function, or a dict ``{selector: reduction}``, first match wins), ``dtype`` to store floats
    in (``overflow``: what values it cannot hold do -- ``"warn"``, the default, once at the end
    with the count per site; ``"error"``: refused at the first batch that has them; ``"ignore"``:
    stored as +-inf), ``keep`` and ``calls`` as in :class:`~hookscope.CaptureOptions`, ``mask`` (``"auto"``:
    reductions over dim 1 use only real tokens when a batch has an ``attention_mask``; None:
    never; a key: that batch key, required), ``chunk_rows`` (a multiple of the batch; default
    up to 1,024 rows or 8 MiB per chunk), ``compression_level`` (zstd, -7..22; None for none),
    ``eval_mode`` (run in eval mode, restored after), ``tokens`` (``"auto"``: keep each row's token
    ids beside its values when the batches carry some, ``input_ids`` or an integer first input;
    True: required; False: never; each row's data index and padding mask are kept too, see
    ``Store.row_index``).

    How it runs: ``device`` to put the inputs on (default: the model's), ``batch_size``
    (default 32) and ``num_workers`` for a data set, ``indices`` (rows of a map-style data set),
    ``inputs=lambda batch: (args, kwargs)``, ``progress`` (default: when standard error is a
    terminal), ``resume`` (continue a store a stopped run left), ``overwrite`` (replace one),
    ``model_spec`` (how the store names the model), ``rank`` / ``world_size`` (default: from
    ``torch.distributed`` or torchrun's environment), ``command`` (the command line recorded),
    ``storage_options`` (for an ``out`` URL such as ``s3://bucket/feats.zarr``: the fsspec file
    system's options, any mapping, e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}``; not
    recorded, and shown by a repr or ``to_dict()`` with its secrets as ``***``, as the command's
    are: the values of secret options such as ``key`` and ``secret``, and credentials in URLs).

    >>> ExtractConfig(dtype="bf16", reduce="mean:1").recorded()["dtype"]
    'bfloat16'
    >>> ExtractConfig(compression_level=40)
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: compression_level=40 is not a zstd level; expected an int from -7 to 22, or None
    """

    feature = "extract"

    reduce: ReduceOption = None
    dtype: torch.dtype | str | None = None
    device: str | torch.device | None = None
    batch_size: int | None = None
    num_workers: int | None = None
    chunk_rows: int | None = None
    keep: Keep = "output"
    calls: Calls = "all"
    mask: str | None = "auto"
    inputs: Inputs | None = None
    indices: Sequence[int] | None = None
    progress: bool | None = None
    resume: bool = True
    overwrite: bool = False
    eval_mode: bool = True
    compression_level: int | None = 3
    model_spec: str | None = None
    rank: int | None = None
    world_size: int | None = None
    command: str | None = None
    overflow: Overflow = "warn"
    storage_options: Mapping[str, Any] | None = None
    tokens: TokensOption = "auto"

    def __post_init__(self) -> None:
        for flag in ("resume", "overwrite", "eval_mode"):
            if not isinstance(getattr(self, flag), bool):
                raise SpecError(f"{flag}={getattr(self, flag)!r} is an extract option and takes True or False")
        for count in ("batch_size", "chunk_rows"):
            value = getattr(self, count)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SpecError(f"{count}={value!r} must be a positive int")
        level = self.compression_level
        if not (level is None or (isinstance(level, int) and not isinstance(level, bool) and -7 <= level <= 22)):
            raise SpecError(f"compression_level={level!r} is not a zstd level; expected an int from -7 to 22, or None")
        if not (self.mask is None or (isinstance(self.mask, str) and self.mask)):
            raise SpecError(f"mask={self.mask!r} is not 'auto' (default), None, or the name of the batch's mask key")
        self.capture_options  # noqa: B018 (keep, calls and dtype refused now, as a capture refuses them)
        parse_device(self.device)
        overflow_choice(self.overflow)
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping):  # never its repr: it may hold credentials
                raise SpecError(
                    f"storage_options is a {type(self.storage_options).__name__}; expected a mapping of the file "
                    "system's options, e.g. {'endpoint_url': 'http://127.0.0.1:9000'}"
                )
            object.__setattr__(self, "storage_options", dict(self.storage_options))  # one spelling: a dict
        if self.tokens not in (True, False, "auto"):
            raise SpecError(
                f"tokens={self.tokens!r} is not 'auto' (keep token ids when the batches carry some), True or False"
            )

    def __repr__(self) -> str:
        """Every option, as a dataclass shows them; storage options without their secrets."""
        shown = {name: getattr(self, name) for name in self.names()}
        shown.update(self._without_secrets())
        return f"{type(self).__name__}({', '.join(f'{key}={value!r}' for key, value in shown.items())})"

    def to_dict(self) -> dict[str, Any]:
        """As :meth:`Options.to_dict`, storage options and the command without their secrets (``***``)."""
        return {**super().to_dict(), **self._without_secrets()}

    def _without_secrets(self) -> dict[str, Any]:
        """The options that may hold credentials, as they are shown: ``***`` in their place."""
        shown: dict[str, Any] = {}
        if self.storage_options is not None:
            shown["storage_options"] = redacted_options(self.storage_options)
        if self.command is not None:
            shown["command"] = redacted_command(self.command)
        return shown

    def recorded(self) -> dict[str, Any]:
        """What the store records of these options and a resumed run must match (reductions apart,
        which the store records per layer as resolved)."""
        kept = self.capture_options
        return {
            "keep": self.keep,
            "calls": self.calls,
            "dtype": kept.to_dict()["dtype"],
            "mask": self.mask_key,
            "eval_mode": self.eval_mode,
            "compression_level": self.compression_level,
            "tokens": self.tokens,
        }

    @property
    def mask_key(self) -> str | None:
        """The batch key of the token mask, or None for no masking."""
        return "attention_mask" if self.mask == "auto" else self.mask

    @property
    def mask_required(self) -> bool:
        """True when ``mask`` named a key, which every batch must then have."""
        return self.mask not in (None, "auto")

    @property
    def capture_options(self) -> CaptureOptions:
        """``keep``, ``calls``, ``dtype`` and ``overflow`` as a capture checks and reads them."""
        return CaptureOptions(
            keep=self.keep, calls=self.calls, dtype=self.dtype, overflow=self.overflow, token_mask=self.mask
        )

    @property
    def torch_device(self) -> torch.device | None:
        """``device`` as a torch device, or None for the model's."""
        return parse_device(self.device)
