"""Trace: a per-call table of shapes, dtypes, value ranges and timing; where the first NaN/Inf appears.

``api`` holds ``trace()`` and ``tracing()``; ``recorder`` attaches the hooks and builds each
pass's :class:`Trace` (``result``) from :class:`TraceRow` s (``rows``), gathering a pass's
``drafts`` first; ``render`` draws it; ``identity`` lets a tensor seen twice be
measured once; ``timing`` holds the per-call clock and peak-memory counter; ``nonfinite`` is
the lighter detector that raises at the first module making a NaN/Inf.
"""

from hookscope._trace.api import run_with_trace, trace, tracing
from hookscope._trace.nonfinite import NonFiniteDetector, detect_nonfinite
from hookscope._trace.options import TraceOptions
from hookscope._trace.recorder import Tracer
from hookscope._trace.result import Trace
from hookscope._trace.rows import NonFiniteRow, TensorInfo, TraceRow

__all__ = [
    "NonFiniteDetector",
    "NonFiniteRow",
    "TensorInfo",
    "Trace",
    "TraceOptions",
    "TraceRow",
    "Tracer",
    "detect_nonfinite",
    "run_with_trace",
    "trace",
    "tracing",
]
