"""What the training monitor keeps of each step (:class:`MonitorStep`, :class:`GradRecord`), what it
flags (:class:`MonitorFlag`), and the pandas tables of a history.

One step type and one flag type serve ``hs.monitor`` and its preset ``hs.watch_grads``: a
step holds the gradient records, the dead units, and (for ``hs.monitor``) the scalars its
sinks were given, its flags and histograms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hookscope._core.names import call_label, leaf_label
from hookscope._core.site_index import SiteIndex
from hookscope._core.sites import Site
from hookscope._shared.histogram import Histogram
from hookscope._shared.optional import require
from hookscope._shared.stats import Stats
from hookscope._shared.tables import Column, Table
from hookscope.errors import SiteNotFoundError, SpecError

__all__ = [
    "METRICS",
    "FlagKind",
    "GradRecord",
    "GradWhat",
    "MonitorFlag",
    "MonitorStep",
    "history_frame",
    "named_columns",
]

GradWhat = Literal["grad_output", "grad_input", "param"]
#: What a flag says: a history's (:meth:`GradMonitor.summary`) or one step's (``hs.monitor``).
FlagKind = Literal[
    "vanishing", "exploding", "nonfinite", "dead",
    "grad_underflow", "grad_overflow", "act_underflow", "act_overflow", "grad_nonfinite",
]  # fmt: skip
METRICS = ("norm", "mean_abs", "max_abs", "nan", "inf", "ratio")
# The value of the call whose gradient a record holds: where its leaf is shown to sit.
_SIDE = {"grad_output": "output", "grad_input": "input"}


@dataclass(frozen=True)
class GradRecord:
    """One gradient of one step: of a module call's output or input tensor, or of a parameter.

    ``norm`` is the L2 norm, ``mean_abs`` and ``max_abs`` of ``|g|``; ``ratio`` is ``norm / |w|``
    for parameters (None for activations). ``order`` ranks activation gradients in the order
    backward produced them (0 first). ``path`` is, for an activation, the tensor's place
    relative to the call's output or input, as in a :class:`~hookscope.Site` (``""`` for the
    value itself, ``"[0]"``, ``"['mask']"``; :attr:`leaf` shows it whole, ``output[0]``), and
    for a parameter its name.
    """

    step: int
    module: str
    class_name: str
    call: int
    what: GradWhat
    path: str
    norm: float
    mean_abs: float
    max_abs: float
    nan: int
    inf: int
    count: int
    ratio: float | None = None
    order: int | None = None

    @property
    def finite(self) -> bool:
        """True when the gradient has no NaN or Inf."""
        return self.nan == 0 and self.inf == 0

    @property
    def layer(self) -> str:
        """``module#call`` for activations (``(root)#0`` for the model), the parameter's name for parameters."""
        return self.path if self.what == "param" else f"{call_label(self.module, self.call)}"

    @property
    def leaf(self) -> str:
        """The activation whose gradient this is, as shown (``output``, ``output[0]``,
        ``input['mask']``); a parameter's name for parameters."""
        return self.path if self.what == "param" else leaf_label(_SIDE[self.what], self.path)

    @property
    def column(self) -> str:
        """:attr:`layer`, with ``:`` and the :attr:`leaf` when the tensor is not the call's only
        output or first input (``h.0#0:output[0]``): the name used by history tables, plots and
        TensorBoard tags."""
        whole = self.path == "" or (self.what == "grad_input" and self.path == "[0]")
        return self.layer if self.what == "param" or whole else f"{self.layer}:{self.leaf}"

    @classmethod
    def of(
        cls,
        step: int,
        module: str,
        class_name: str,
        call: int,
        what: GradWhat,
        path: str,
        stats: Stats,
        *,
        order: int | None = None,
    ) -> GradRecord:
        """A record from a gradient's :class:`~hookscope._shared.stats.Stats`."""
        return cls(step, module, class_name, call, what, path, **_numbers(stats), order=order)

    @classmethod
    def of_parameter(cls, step: int, name: str, stats: Stats, weight_norm: float) -> GradRecord:
        """A parameter's record: ``ratio`` is its gradient's norm over the weight's norm."""
        numbers = _numbers(stats)
        module, _, _ = name.rpartition(".")
        ratio = numbers["norm"] / weight_norm if weight_norm > 0 else math.nan  # a zero weight: no ratio
        return cls(step, module, "", 0, "param", name, **numbers, ratio=ratio)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def _numbers(stats: Stats) -> dict[str, Any]:
    squares = (stats.std**2) * max(stats.count - 1, 0) + stats.mean**2 * stats.count
    return {
        "norm": math.sqrt(max(squares, 0.0)) if stats.finite else math.nan,
        "mean_abs": stats.abs_mean,
        "max_abs": max(abs(stats.min), abs(stats.max)) if stats.count else math.nan,
        "nan": stats.nan,
        "inf": stats.inf,
        "count": stats.count,
    }


@dataclass(frozen=True)
class MonitorFlag:
    """Something the gradients or activations showed that deserves a look: its kind, the layer
    (``module#call``, a canonical name, or a parameter), the steps it was seen at, why, and
    the value that crossed the line where there is one.

    >>> str(MonitorFlag("grad_underflow", "blocks.3", (12,), "loses 4.1% of its gradient to underflow in bfloat16"))
    'grad_underflow blocks.3: loses 4.1% of its gradient to underflow in bfloat16 (step 12)'
    """

    kind: FlagKind
    layer: str
    steps: tuple[int, ...]
    detail: str
    value: float = math.nan

    @property
    def step(self) -> int:
        """The first step it was seen at (a step's own flag has that one)."""
        return self.steps[0] if self.steps else -1

    @property
    def message(self) -> str:
        """The flag in one line, as ``str()`` gives it."""
        return str(self)

    def __str__(self) -> str:
        when = f"step {self.steps[0]}" if len(self.steps) == 1 else f"steps {ranges(self.steps)}"
        return f"{self.kind:<9} {self.layer}: {self.detail} ({when})"


@dataclass
class MonitorStep:
    """One recorded step: its gradient records, the dead units known at its end, and, for
    ``hs.monitor``, every scalar its sinks were given by name, its flags and histograms.

    Every gradient in it is as the step's backward left it: the activations' (``grad/``) and the
    parameters' (``param_grad/``) alike, before any clipping or optimiser step, after DDP's
    all-reduce, and divided by the loss scale where a GradScaler is known (``grad_scaler=``; the
    callbacks find the Trainer's): the gradients of the loss itself, whose scale is logged as
    ``grad/loss_scale``. The transformers Trainer's logged ``grad_norm`` is the norm of the same
    gradients: ``sqrt(sum of param_grad/norm**2)``. The gradients' precision fractions are of the
    gradients as the backward held them, scaled: what the format keeps of them.
    """

    step: int
    records: list[GradRecord] = field(default_factory=list)
    dead: dict[str, list[int]] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    flags: list[MonitorFlag] = field(default_factory=list)
    histograms: dict[str, Histogram] = field(default_factory=dict)  # by logged layer name, on request
    read_grads: bool = True  # whether gradients were read at this step (hs.monitor(grads=False): no)

    def of(self, what: GradWhat) -> list[GradRecord]:
        """The records of one kind (``grad_output``, ``grad_input``, ``param``)."""
        return [record for record in self.records if record.what == what]

    @property
    def grads(self) -> MonitorStep | None:
        """The step itself where its gradients were read, else None (kept from when a monitor's
        step held a separate gradient step)."""
        return self if self.read_grads else None

    def table(self, title: str | None = None, notes: Sequence[str] = ()) -> Table:
        """The step's gradients as a table, one row per record (NaN/Inf rows marked), under
        ``title`` (default: the step's number and counts), its flags and ``notes`` below."""
        columns = [Column("layer"), Column("what"), *(Column(h, "right") for h in ("norm", "mean |g|", "max |g|"))]
        if title is None:
            dead = f", {len(self.dead)} layers with dead units" if self.dead else ""
            title = (
                f"step {self.step}: {len(self.records)} gradients, {len(self.flags)} flags, "
                f"{len(self.scalars)} scalars logged{dead}"
            )
        notes = [*map(str, self.flags), *notes]
        if not self.records and self.scalars:  # hs.monitor(grads=False): what it logged instead
            return self._scalar_table(title, notes)
        table = Table([*columns, Column("nan/inf", "right")], title=title, notes=notes)
        for r in self.records:
            cells = (f"{r.norm:.4g}", f"{r.mean_abs:.4g}", f"{r.max_abs:.4g}", f"{r.nan}/{r.inf}")
            table.add(r.column, r.what, *cells, bad=bool(r.nan or r.inf))
        return table

    def _scalar_table(self, title: str, notes: list[str]) -> Table:
        """The first :data:`_SCALARS_SHOWN` logged scalars by name (a NaN/Inf one marked)."""
        table = Table([Column("scalar"), Column("value", "right")], title=title, notes=notes)
        for name, value in list(self.scalars.items())[:_SCALARS_SHOWN]:
            table.add(name, f"{value:.4g}", bad=not math.isfinite(value))
        if len(self.scalars) > _SCALARS_SHOWN:
            table.notes.append(f"and {len(self.scalars) - _SCALARS_SHOWN} more scalars in step.scalars")
        return table

    def _repr_html_(self) -> str:
        """The step's gradients and flags as a table, for Jupyter."""
        return self.table().html()


#: The most scalars a step's table lists when it holds no gradients (``step.scalars`` has them all).
_SCALARS_SHOWN = 30


def ranges(steps: Sequence[int]) -> str:
    """Step numbers as runs: ``0-2, 5``."""
    if not steps:
        return "-"
    parts, start, last = [], steps[0], steps[0]
    for step in [*steps[1:], None]:
        if step is not None and step == last + 1:
            last = step
            continue
        parts.append(str(start) if start == last else f"{start}-{last}")
        if step is not None:
            start = last = step
    return ", ".join(parts)


def history_frame(steps: Sequence[MonitorStep], metric: str, what: str) -> Any:
    """Steps x layers of one metric, as a pandas DataFrame (layers in the order first seen)."""
    if metric not in METRICS:
        raise SpecError(f"metric {metric!r} is not one of {', '.join(METRICS)}")
    if what not in ("grad_output", "grad_input", "param"):
        raise SpecError(f"what={what!r} is not 'grad_output', 'grad_input' or 'param'")
    pd = require("pandas", purpose="history()", extra="pandas")
    rows: dict[int, dict[str, float]] = {}
    for step in steps:
        row = rows.setdefault(step.step, {})
        for record in step.of(what):  # type: ignore[arg-type]
            key = record.column
            value = getattr(record, metric)
            row[key] = math.nan if value is None else float(value)
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.index.name = "step"
    return frame


def named_columns(steps: Sequence[MonitorStep], keys: Sequence[str], what: str) -> list[str]:
    """The history columns (:attr:`GradRecord.column`) that ``keys`` name, in the order given.

    An activation's gradient is named as a capture's value is (``cache[key]``): ``"fc"`` (its
    last call), ``"fc#0"``, ``"h.0#0:output[0]"``, ``"(root)"``, an escaped name; a parameter's
    by its name (``"fc.weight"``). A name that matches nothing raises
    :class:`~hookscope.errors.SiteNotFoundError` with the closest recorded names.

    >>> from hookscope._shared.stats import tensor_stats
    >>> import torch
    >>> step = MonitorStep(0, [GradRecord.of(0, "fc", "Linear", 0, "grad_output", "", tensor_stats(torch.ones(2)))])
    >>> named_columns([step], ["fc", "fc#0:output"], "grad_output")
    ['fc#0', 'fc#0']
    """
    records = [record for step in steps for record in step.of(what)]  # type: ignore[arg-type]
    if what == "param":
        names = list(dict.fromkeys(record.column for record in records))
        unknown = [key for key in keys if key not in names]
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], names, n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"recorded: {names[:12]}"
            raise SiteNotFoundError(
                f"no parameter gradient named {unknown[0]!r} was recorded; {hint}",
                key=unknown[0],
                candidates=tuple(close or names),
            )
        return list(keys)
    columns: dict[Site, str] = {}
    for record in records:
        columns.setdefault(Site(record.module, record.call, _SIDE[record.what], record.path), record.column)  # type: ignore[arg-type]
    index = SiteIndex(
        columns,
        verb="recorded",
        empty_hint=f"no {what} gradient was recorded (did a backward pass run while the monitor was attached?)",
    )
    return [columns[index.resolve(key)] for key in keys]
