"""The rows of a trace: one :class:`TraceRow` per module call, one :class:`TensorInfo` per tensor,
and :class:`NonFiniteRow`, the row :meth:`Trace.first_nonfinite` answers with."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from hookscope._core.names import call_label, leaf_label, module_label
from hookscope._core.op_sites import op_text
from hookscope._shared.histogram import Histogram
from hookscope._shared.shapes import format_shape
from hookscope._shared.stats import Stats

__all__ = ["CallStatus", "LeafWhat", "NonFiniteRow", "TensorInfo", "TraceRow"]

CallStatus = Literal["ok", "raised"]
LeafWhat = Literal["input", "output"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor a call took or returned: where it sat, what it was, and its statistics.

    ``what`` says whether the call took it (``"input"``) or returned it (``"output"``), and
    ``path`` is where it sat in that value, reading like the Python that fetches it: ``""`` for
    the value itself, ``"[0]"``, ``"['mask']"``, ``".logits"``; :attr:`label` joins the two as
    tables and messages show them (``output[0]``, ``input['mask']``). ``stats`` is None when
    statistics were off or the tensor cannot be summarised (complex, sparse, ``meta``).
    ``source`` names the call that returned this very tensor earlier in the pass
    (``"layer1.0.relu#0"``), or is None when it came from outside a traced module (the model's
    input, a functional op between modules). ``histogram`` is the distribution of its values
    when the trace was taken with ``histograms=True``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    stats: Stats | None = None
    source: str | None = None
    histogram: Histogram | None = None
    what: LeafWhat = "output"

    @property
    def label(self) -> str:
        """The leaf as shown: ``output``, ``output[0]``, ``input['mask']``."""
        return leaf_label(self.what, self.path)

    def describe(self) -> str:
        """The leaf, its shape and dtype: ``input[0] [4, 64, 8, 8] float32``."""
        return f"{self.label} {format_shape(self.shape)} {self.dtype}"

    @property
    def finite(self) -> bool | None:
        """True/False when statistics were computed, None when they were not."""
        return None if self.stats is None else self.stats.finite

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (statistics nested under ``"stats"``)."""
        described: dict[str, Any] = {
            "what": self.what,
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "source": self.source,
            "stats": None if self.stats is None else self.stats.to_dict(),
        }
        if self.histogram is not None:
            described["histogram"] = self.histogram.to_dict()
        return described


@dataclass(frozen=True)
class TraceRow:
    """One call of one module, in the order calls started.

    ``depth`` counts the traced calls the call runs inside (the model's own call is 0; with
    ``layers=`` only the traced ones count), ``parent`` is the ``order`` of the innermost of
    them. ``finished`` numbers calls in the order they returned, which is the order in which
    their outputs came to exist. ``status`` is ``"raised"`` for a call an exception went
    through (``Trace.failure`` says where a failed forward raised). ``time_ms`` includes the
    children's time, ``self_ms`` does not; neither includes hookscope's own measuring on the
    CPU. ``peak_bytes`` is the rise of peak CUDA memory during the call.

    A row of an op site (a trace taken with ``ops=``) has ``op`` set: the op within its module
    call (``"softmax#0"``, or ``"attn.pattern#0"`` for an attention sub-site); ``name`` and
    ``call`` are its module's and its call's, ``parent`` that call's row, ``class_name`` is
    ``"op"`` (``"attention"`` for a sub-site), and it has no parameters, time or memory of its own.
    A module's own call has ``op == ""``.
    """

    order: int
    depth: int
    name: str
    class_name: str
    call: int
    params: int
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    parent: int | None = None
    finished: int | None = None
    status: CallStatus = "ok"
    time_ms: float | None = None
    self_ms: float | None = None
    peak_bytes: int | None = None
    op: str = ""

    def __repr__(self) -> str:
        """One line: the call, what went in and came out (the dataclass's own repr dumps every
        statistic of every leaf)."""
        state = " raised" if self.status == "raised" else ", not finite" if self.output_finite is False else ""
        return f"<{type(self).__name__} {self.order} {self._called()}: {self._flow()}{state}>"

    def _called(self) -> str:
        return f"{self.called_as(numbered=False)!r} ({self.class_name}, call {self.call})"

    def called_as(self, *, numbered: bool) -> str:
        """The module as shown (``h.0.attn``, with ``#call`` when ``numbered``), then the op for
        an op site's row: ``h.0.attn:op[softmax#0]``, ``h.0.attn#1:attn.pattern``."""
        shown = call_label(self.name, self.call) if numbered else module_label(self.name)
        return f"{shown}:{op_text(self.op)}" if self.op else shown

    def _flow(self) -> str:
        return f"{_leaves(self.inputs, 'no input')} -> {_leaves(self.outputs, 'no output')}"

    @property
    def site(self) -> str:
        """``name#call``, the row's address (``(root)`` for the model itself); for an op site's
        row, the op's: ``h.0.attn#0:op[softmax#0]``."""
        return self.called_as(numbered=True)

    def describe(self) -> str:
        """The call in words, for error notes.

        For example ``'layer3.conv' (Conv2d, call 0) with input[0] [4, 64, 8, 8] float32``.
        """
        inputs = ", ".join(info.describe() for info in self.inputs) or "no tensor input"
        return f"{self._called()} with {inputs}"

    @property
    def output(self) -> TensorInfo | None:
        """The main output: the first floating-point tensor, else the first tensor, else None."""
        for info in self.outputs:
            if _is_float(info.dtype):
                return info
        return self.outputs[0] if self.outputs else None

    @property
    def stats(self) -> Stats | None:
        """Statistics of the main output."""
        main = self.output
        return None if main is None else main.stats

    @property
    def output_finite(self) -> bool | None:
        """False when any output has a NaN or Inf; None when nothing was measured."""
        known = [info.finite for info in self.outputs if info.finite is not None]
        return None if not known else all(known)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with every input and output leaf."""
        return {
            "order": self.order,
            "depth": self.depth,
            "name": self.name,
            "class": self.class_name,
            "call": self.call,
            "op": self.op,
            "params": self.params,
            "parent": self.parent,
            "finished": self.finished,
            "status": self.status,
            "time_ms": self.time_ms,
            "self_ms": self.self_ms,
            "peak_bytes": self.peak_bytes,
            "inputs": [info.to_dict() for info in self.inputs],
            "outputs": [info.to_dict() for info in self.outputs],
        }


@dataclass(frozen=True, repr=False, kw_only=True)
class NonFiniteRow(TraceRow):
    """The row of the call :meth:`Trace.first_nonfinite` names, with the leaf that holds the NaN/Inf.

    ``from_input`` tells the two answers apart. False: the call made the values from finite
    inputs (the blame rule), and ``leaf`` is its first non-finite output. True: no traced call
    made them; they were already in what came in (the model's input, or a value made outside
    the traced modules), and this is the first call, in the order calls returned, whose input
    held them; ``leaf`` is that input. ``what``, ``path`` and the ``nan``, ``posinf``,
    ``neginf`` counts (of ``count`` values) are the leaf's. Every other field is the row's
    (compare rows by ``order``: a ``NonFiniteRow`` is not equal to its plain row).

    >>> import math, torch, hookscope as hs
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> found = hs.trace(model, torch.tensor([[1.0, math.nan]])).first_nonfinite()
    >>> found.from_input, found.name, found.label, found.nan
    (True, '0', 'input[0]', 1)
    """

    from_input: bool
    leaf: TensorInfo

    @classmethod
    def of(cls, row: TraceRow, *, from_input: bool, leaf: TensorInfo) -> NonFiniteRow:
        """``row`` with the verdict added."""
        return cls(**{f.name: getattr(row, f.name) for f in fields(TraceRow)}, from_input=from_input, leaf=leaf)

    @property
    def what(self) -> LeafWhat:
        """``"output"`` when the call made the values, ``"input"`` when they came in."""
        return self.leaf.what

    @property
    def path(self) -> str:
        """Where the leaf sits in that value (``""``, ``"[0]"``, ``".logits"``)."""
        return self.leaf.path

    @property
    def label(self) -> str:
        """The leaf as shown: ``output``, ``input[0]``."""
        return self.leaf.label

    @property
    def nan(self) -> int:
        """NaN values in the leaf."""
        return self._leaf_stats().nan

    @property
    def posinf(self) -> int:
        """+inf values in the leaf."""
        return self._leaf_stats().posinf

    @property
    def neginf(self) -> int:
        """-inf values in the leaf."""
        return self._leaf_stats().neginf

    @property
    def count(self) -> int:
        """All values of the leaf."""
        return self._leaf_stats().count

    def _leaf_stats(self) -> Stats:
        stats = self.leaf.stats
        if stats is None:  # a leaf is found non-finite only from its statistics
            raise AssertionError(f"{self.leaf.label} of {self.site} was not measured")
        return stats

    def __repr__(self) -> str:
        """One line: the call, the leaf and its counts, and whether the values came in."""
        state = "came in with its input (from_input=True)" if self.from_input else "inputs finite"
        counts = f"{self.nan:,} NaN, {self.posinf:,} +inf, {self.neginf:,} -inf (of {self.count:,})"
        return f"<{type(self).__name__} {self._called()} {self.label}: {counts}; {state}>"


_SHOWN_LEAVES = 2


def _leaves(infos: tuple[TensorInfo, ...], none: str) -> str:
    shown = ", ".join(info.describe() for info in infos[:_SHOWN_LEAVES]) or none
    more = len(infos) - _SHOWN_LEAVES
    return shown + (f" +{more} more" if more > 0 else "")


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))
