"""``ExtractConfig``: how an extraction runs and what its store records, declared and checked once.

``hs.extract`` and ``hookscope extract`` build one. Its :meth:`ExtractConfig.recorded` part is
what the store keeps and what a resumed run is compared against. What a capture keeps is a
:class:`~hookscope.CaptureOptions` held whole (``capture``), so an extraction accepts exactly
what a capture does; ``keep``, ``calls``, ``dtype``, ``overflow`` and ``mask`` are still taken
as keywords and go into it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

import torch

from hookscope._capture import CaptureOptions
from hookscope._core.sites import Calls, Keep
from hookscope._extract.config import store_options
from hookscope._extract.data import Inputs
from hookscope._extract.pipeline import ReduceOption
from hookscope._extract.provenance import TokensOption
from hookscope._shared.credentials import redacted_command, redacted_options
from hookscope._shared.dtypes import Overflow, parse_device
from hookscope._shared.options import Options
from hookscope.errors import SpecError

__all__ = ["ExtractConfig"]


class _FromCapture:
    """The default of a keyword that goes into ``capture``: not given, so the capture's own."""

    def __repr__(self) -> str:
        return "<capture's>"


_FROM_CAPTURE: Any = _FromCapture()
#: The keywords that go into ``capture`` (``mask`` as its ``token_mask``), and the capture
#: options an extraction leaves as they are: it keeps every row detached, on the host, as made.
_INTO_CAPTURE = {"keep": "keep", "calls": "calls", "dtype": "dtype", "overflow": "overflow", "mask": "token_mask"}
_NO_CAPTURE_CHANGES = CaptureOptions()  # frozen, so one object serves as every default
_FIXED = ("detach", "device", "reduce", "stop", "max_bytes", "copy", "passes", "grads")


@dataclass(frozen=True)
class ExtractConfig(Options):
    """How :func:`hookscope.extract` runs.

    What is stored: ``capture``, what each capture keeps (a :class:`~hookscope.CaptureOptions`,
    or its parts as keywords: ``keep`` and ``calls``; ``dtype`` to store floats in; ``overflow``:
    what values it cannot hold do -- ``"warn"``, the default, once at the end with the count per
    site; ``"error"``: refused at the first batch that has them; ``"ignore"``: stored as +-inf;
    ``mask``, its ``token_mask``: ``"auto"``, reductions over dim 1 use only real tokens when a
    batch has an ``attention_mask``; None: never; a key: that batch key, required), ``reduce``
    per layer before storing (``"mean:1"``, ``"cls"``, ``"last"``, a function, or a dict
    ``{selector: reduction}``, first match wins), ``chunk_rows`` (a multiple of the batch; default
    up to 1,024 rows or 8 MiB per chunk), ``compression_level`` (zstd, -7..22; None for none),
    ``eval_mode`` (run in eval mode, restored after), ``tokens`` (``"auto"``: keep each row's token
    ids beside its values when a site is stored per token, ``(N, seq, ...)``, and the batches
    carry some, ``input_ids`` or an integer first input; True: required; False: never; each
    row's data index is kept too, and its padding mask where a site is stored per token or the
    token ids are kept, see ``Store.row_index``).

    How it runs: ``device`` to put the inputs on (default: the model's), ``batch_size``
    (default 32) and ``num_workers`` for a data set, ``indices`` (rows of a map-style data set),
    ``inputs=lambda batch: (args, kwargs)``, ``progress`` (default: a bar when standard error is a
    terminal, a line in a notebook once the run has taken a second; ``True`` also plain lines
    elsewhere; ``False`` none), ``resume`` (continue a store a stopped run left), ``overwrite`` (replace one),
    ``model_spec`` (how the store names the model), ``rank`` / ``world_size`` (default: from
    ``torch.distributed`` or torchrun's environment), ``command`` (the command line recorded),
    ``storage_options`` (for an ``out`` URL such as ``s3://bucket/feats.zarr``: the fsspec file
    system's options, any mapping, e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}``; not
    recorded, and shown by a repr or ``to_dict()`` with its secrets as ``***``, as the command's
    are: the values of secret options such as ``key`` and ``secret``, and credentials in URLs).

    >>> ExtractConfig(dtype="bf16", reduce="mean:1").recorded()["dtype"]
    'bfloat16'
    >>> ExtractConfig(keep="input").capture == CaptureOptions(keep="input")
    True
    >>> ExtractConfig(compression_level=40)
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: compression_level=40 is not a zstd level; expected an int from -7 to 22, or None
    """

    feature = "extract"
    #: 2: the capture's options held whole (``capture``); 1 spelled them flat, and still reads.
    VERSION = 2
    PART_KEYWORDS = tuple(_INTO_CAPTURE)

    capture: CaptureOptions = _NO_CAPTURE_CHANGES
    reduce: ReduceOption = None
    device: str | torch.device | None = None
    batch_size: int | None = None
    num_workers: int | None = None
    chunk_rows: int | None = None
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
    storage_options: Mapping[str, Any] | None = None
    tokens: TokensOption = "auto"
    keep: InitVar[Keep] = _FROM_CAPTURE
    calls: InitVar[Calls] = _FROM_CAPTURE
    dtype: InitVar[torch.dtype | str | None] = _FROM_CAPTURE
    overflow: InitVar[Overflow] = _FROM_CAPTURE
    mask: InitVar[str | None] = _FROM_CAPTURE

    def __post_init__(
        self, keep: Keep, calls: Calls, dtype: torch.dtype | str | None, overflow: Overflow, mask: str | None
    ) -> None:
        self._hold_capture({"keep": keep, "calls": calls, "dtype": dtype, "overflow": overflow, "mask": mask})
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
        parse_device(self.device)
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

    def _hold_capture(self, given: dict[str, Any]) -> None:
        """``capture`` with the keywords given for it (checked as a capture checks them), refusing
        capture options an extraction does not take."""
        mask = given["mask"]
        if mask is not _FROM_CAPTURE and not (mask is None or (isinstance(mask, str) and mask)):
            raise SpecError(f"mask={mask!r} is not 'auto' (default), None, or the name of the batch's mask key")
        if not isinstance(self.capture, CaptureOptions):
            raise SpecError(
                f"capture= takes a CaptureOptions such as hs.CaptureOptions(keep='input'), not a "
                f"{type(self.capture).__name__}"
            )
        changes = {_INTO_CAPTURE[key]: value for key, value in given.items() if value is not _FROM_CAPTURE}
        held = dataclasses.replace(self.capture, **changes) if changes else self.capture
        default = CaptureOptions()
        for name in _FIXED:
            if getattr(held, name) != getattr(default, name):
                fix = "give reduce= to extract (one per layer if need be)" if name == "reduce" else "leave it out"
                raise SpecError(
                    f"capture option {name}={getattr(held, name)!r} is not one an extraction takes: it keeps every row "
                    f"detached, on the host, from a whole forward; {fix}"
                )
        object.__setattr__(self, "capture", held)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExtractConfig:
        """The options a :meth:`to_dict` wrote (version 2, or 1: the capture's options flat), or
        those a store records (``store.meta["config"]``, which has no version): what a run that
        resumes it would be given, besides the model, the layers and the data.

        >>> ExtractConfig.from_dict(ExtractConfig(dtype="bf16", tokens=False).to_dict()).capture.dtype
        torch.bfloat16
        >>> ExtractConfig.from_dict({"version": 1, "keep": "input", "calls": "first"}).capture.calls
        'first'
        """
        values = dict(data)
        if "version" not in values and "model" in values:  # a store's record
            values = {"version": cls.VERSION, **store_options(values)}
        if values.get("version") == 1:  # the capture's options flat, as keywords still are
            values["version"] = cls.VERSION
        elif isinstance(values.get("capture"), Mapping):
            values["capture"] = CaptureOptions.from_dict(values["capture"])
        return super().from_dict(values)

    def __repr__(self) -> str:
        """Every option, as a dataclass shows them; storage options without their secrets."""
        shown = {name: getattr(self, name) for name in self.option_names()}
        shown.update(self._without_secrets())
        return f"{type(self).__name__}({', '.join(f'{key}={value!r}' for key, value in shown.items())})"

    def to_dict(self) -> dict[str, Any]:
        """As :meth:`Options.to_dict`, storage options and the command without their secrets (``***``)."""
        return {**super().to_dict(), "capture": self.capture.to_dict(), **self._without_secrets()}

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
        kept = self.capture.to_dict()
        return {
            "keep": kept["keep"],
            "calls": kept["calls"],
            "dtype": kept["dtype"],
            "mask": self.mask_key,
            "eval_mode": self.eval_mode,
            "compression_level": self.compression_level,
            "tokens": self.tokens,
        }

    @property
    def mask_key(self) -> str | None:
        """The batch key of the token mask, or None for no masking."""
        return self.capture.mask_key

    @property
    def mask_required(self) -> bool:
        """True when ``mask`` named a key, which every batch must then have."""
        return self.capture.token_mask not in (None, "auto")

    @property
    def torch_device(self) -> torch.device | None:
        """``device`` as a torch device, or None for the model's."""
        return parse_device(self.device)


def _held(name: str) -> property:
    """``config.keep`` and the others: read from ``capture``, where they are held."""
    part = _INTO_CAPTURE[name]
    return property(lambda self: getattr(self.capture, part), doc=f"``capture.{part}``.")


for _name in _INTO_CAPTURE:  # after the dataclass is made: its __init__ keeps the keywords
    setattr(ExtractConfig, _name, _held(_name))
