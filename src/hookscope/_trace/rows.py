"""The rows of a trace: one :class:`TraceRow` per module call, one :class:`TensorInfo` per tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hookscope._core.names import call_label, leaf_label, module_label
from hookscope._shared.histogram import Histogram
from hookscope._shared.shapes import format_shape
from hookscope._shared.stats import Stats

__all__ = ["CallStatus", "LeafWhat", "TensorInfo", "TraceRow"]

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

    @property
    def site(self) -> str:
        """``name#call``, the row's address (``(root)`` for the model itself)."""
        return f"{call_label(self.name, self.call)}"

    def describe(self) -> str:
        """The call in words, for error notes.

        For example ``'layer3.conv' (Conv2d, call 0) with input[0] [4, 64, 8, 8] float32``.
        """
        inputs = ", ".join(info.describe() for info in self.inputs) or "no tensor input"
        return f"{module_label(self.name)!r} ({self.class_name}, call {self.call}) with {inputs}"

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


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))
