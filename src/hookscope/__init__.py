"""hookscope: look inside PyTorch models and change what happens there, through module hooks.

>>> import hookscope as hs
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
>>> hs.select(model, nn.Linear)[0][0]
'0'

The public API is what ``__all__`` lists; everything else is private. Heavy optional
libraries (rich, matplotlib, zarr, jinja2, transformers, typer) are imported only where used.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from hookscope import edits, methods, plots
from hookscope._arch.samples import default_input_shape, sample_input
from hookscope._arch.std import StdMap, StdSite, std_map
from hookscope._capture import Cache, Capture, CaptureOptions, capture, load, run_with_capture
from hookscope._core.attach import AttachedHook, HookGroup, HookSpec
from hookscope._core.live_hooks import remove_all
from hookscope._core.select import Selector, ensure_module, select
from hookscope._core.sites import Site
from hookscope._diff import Diff, DiffRow, Divergence, diff
from hookscope._edit import EditContext, EditOptions, Editor, edit, run_with_edits
from hookscope._extract import ExtractConfig, extract
from hookscope._hooks import AttachedHooks, attached, hooks
from hookscope._info import Info, info
from hookscope._layers import Layer, LayerTable, layers
from hookscope._monitor import (
    GradFlag,
    GradMonitor,
    GradRecord,
    GradStep,
    GradSummary,
    Monitor,
    MonitorFlag,
    MonitorOptions,
    MonitorStep,
    monitor,
    watch_grads,
)
from hookscope._report import report
from hookscope._shared.histogram import Histogram
from hookscope._shared.names import DEFINED_IN, own_exports, public_dir, public_submodule
from hookscope._shared.precision import Precision
from hookscope._shared.stats import RunningStats, Stats
from hookscope._store import SiteStats, Store, StoreArray, StoreLoader, open_store
from hookscope._trace import (
    NonFiniteRow,
    TensorInfo,
    Trace,
    TraceOptions,
    Tracer,
    TraceRow,
    run_with_trace,
    trace,
    tracing,
)
from hookscope._trace.nonfinite import NonFiniteDetector, detect_nonfinite
from hookscope._verify import VerifyReport, verify
from hookscope._version import __version__
from hookscope.errors import (
    CaptureError,
    CastOverflowWarning,
    ConcurrentPassError,
    DataError,
    EditError,
    FileFormatError,
    HookscopeError,
    MissingDependencyError,
    NonFiniteError,
    OutputPathError,
    OutputWriteError,
    PairingWarning,
    SelectionError,
    SinkError,
    SiteNotFoundError,
    SpecError,
    StaleCompiledCodeWarning,
    StdMapError,
    StoreBusyError,
    StoreError,
    StoreIndexError,
    StoreReadError,
    StoreRepairWarning,
    StoreWriteError,
    UnsupportedModelError,
)

__all__ = [
    "AttachedHook",
    "AttachedHooks",
    "Cache",
    "Capture",
    "CaptureError",
    "CaptureOptions",
    "CastOverflowWarning",
    "ConcurrentPassError",
    "DataError",
    "Diff",
    "DiffRow",
    "Divergence",
    "EditContext",
    "EditError",
    "EditOptions",
    "Editor",
    "ExtractConfig",
    "FileFormatError",
    "GradFlag",
    "GradMonitor",
    "GradRecord",
    "GradStep",
    "GradSummary",
    "Histogram",
    "HookGroup",
    "HookSpec",
    "HookscopeError",
    "Info",
    "Layer",
    "LayerTable",
    "MissingDependencyError",
    "Monitor",
    "MonitorFlag",
    "MonitorOptions",
    "MonitorStep",
    "NonFiniteDetector",
    "NonFiniteError",
    "NonFiniteRow",
    "OutputPathError",
    "OutputWriteError",
    "PairingWarning",
    "Precision",
    "RunningStats",
    "SelectionError",
    "Selector",
    "SinkError",
    "Site",
    "SiteNotFoundError",
    "SiteStats",
    "SpecError",
    "StaleCompiledCodeWarning",
    "Stats",
    "StdMap",
    "StdMapError",
    "StdSite",
    "Store",
    "StoreArray",
    "StoreBusyError",
    "StoreError",
    "StoreIndexError",
    "StoreLoader",
    "StoreReadError",
    "StoreRepairWarning",
    "StoreWriteError",
    "TensorInfo",
    "Trace",
    "TraceOptions",
    "TraceRow",
    "Tracer",
    "UnsupportedModelError",
    "VerifyReport",
    "__version__",
    "attached",
    "capture",
    "default_input_shape",
    "detect_nonfinite",
    "diff",
    "edit",
    "edits",
    "ensure_module",
    "extract",
    "hooks",
    "info",
    "layers",
    "load",
    "methods",
    "monitor",
    "open_store",
    "plots",
    "remove_all",
    "report",
    "run_with_capture",
    "run_with_edits",
    "run_with_trace",
    "sample_input",
    "select",
    "std_map",
    "trace",
    "tracing",
    "verify",
    "watch_grads",
]


#: Where each export is defined (``own_exports`` renames them ``hookscope.X``), for tools that must
#: find its source module: the test suite's doctest collection reads it.
_defined_in = DEFINED_IN

own_exports(__name__)

#: Names that moved to a public submodule, and where: ``hs.save_tensors`` still works, with a
#: ``FutureWarning`` (once per name) naming the new home.
_MOVED = {
    "check_output_path": "hookscope.io",
    "load_tensors": "hookscope.io",
    "save_tensors": "hookscope.io",
    "tensor_file_format": "hookscope.io",
    "CsvSink": "hookscope.sinks",
    "JsonLinesSink": "hookscope.sinks",
    "MLflowSink": "hookscope.sinks",
    "TensorBoardSink": "hookscope.sinks",
    "WandbSink": "hookscope.sinks",
    "dtype_name": "hookscope.tensors",
    "flatten_tensors": "hookscope.tensors",
    "map_tensors": "hookscope.tensors",
    "parse_dtype": "hookscope.tensors",
    "tensor_stats": "hookscope.tensors",
}
_warned: set[str] = set()


def __dir__() -> list[str]:
    """The public names, the dunders and the public submodules (``hs.errors``, ``hs.integrations``,
    ...), not the imports they are built from: what tab completion offers."""
    return public_dir(__name__)


if not TYPE_CHECKING:  # hidden from mypy, which would otherwise accept any hs.<name>

    def __getattr__(name: str) -> Any:
        """A public submodule not imported yet (``hs.integrations``, ``hs.demo``), imported now;
        or a name that moved to one (``hs.save_tensors``: ``hookscope.io.save_tensors``)."""
        home = _MOVED.get(name)
        if home is None:
            return public_submodule(__name__, name)
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"hs.{name} is now {home}.{name}; import it from there (hs.{name} will be removed)",
                FutureWarning,
                stacklevel=2,
            )
        return getattr(importlib.import_module(home), name)
