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

from types import ModuleType
from typing import TYPE_CHECKING

from hookscope import edits, methods, plots
from hookscope._arch.samples import default_input_shape, sample_input
from hookscope._arch.std import StdMap, StdSite, std_map
from hookscope._capture import Cache, Capture, CaptureOptions, capture, load, run_with_capture
from hookscope._capture.files import load_tensors, save_tensors, tensor_file_format
from hookscope._core.attach import AttachedHook, HookGroup, HookSpec, remove_all
from hookscope._core.select import Selector, ensure_module, select
from hookscope._core.sites import Site
from hookscope._core.tree import flatten_tensors, map_tensors
from hookscope._diff import Diff, DiffRow, Divergence, diff
from hookscope._edit import EditContext, EditOptions, Editor, edit, run_with_edits
from hookscope._extract import ExtractConfig, extract
from hookscope._hooks import AttachedHooks, attached, hooks
from hookscope._layers import Layer, LayerTable, layers
from hookscope._monitor import (
    CsvSink,
    GradFlag,
    GradMonitor,
    GradRecord,
    GradStep,
    GradSummary,
    JsonLinesSink,
    MLflowSink,
    Monitor,
    MonitorFlag,
    MonitorOptions,
    MonitorStep,
    TensorBoardSink,
    WandbSink,
    monitor,
    watch_grads,
)
from hookscope._report import report
from hookscope._shared.dtypes import dtype_name, parse_dtype
from hookscope._shared.files import check_output_path
from hookscope._shared.histogram import Histogram
from hookscope._shared.names import public_dir, public_submodule
from hookscope._shared.precision import Precision
from hookscope._shared.stats import RunningStats, Stats, tensor_stats
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
    "CsvSink",
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
    "JsonLinesSink",
    "Layer",
    "LayerTable",
    "MLflowSink",
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
    "TensorBoardSink",
    "TensorInfo",
    "Trace",
    "TraceOptions",
    "TraceRow",
    "Tracer",
    "UnsupportedModelError",
    "WandbSink",
    "__version__",
    "attached",
    "capture",
    "check_output_path",
    "default_input_shape",
    "detect_nonfinite",
    "diff",
    "dtype_name",
    "edit",
    "edits",
    "ensure_module",
    "extract",
    "flatten_tensors",
    "hooks",
    "layers",
    "load",
    "load_tensors",
    "map_tensors",
    "methods",
    "monitor",
    "open_store",
    "parse_dtype",
    "plots",
    "remove_all",
    "report",
    "run_with_capture",
    "run_with_edits",
    "run_with_trace",
    "sample_input",
    "save_tensors",
    "select",
    "std_map",
    "tensor_file_format",
    "tensor_stats",
    "trace",
    "tracing",
    "watch_grads",
]


#: Where each export rewritten below is defined, for tools that must find its source module
#: (the test suite's doctest collection reads it; ``inspect.getsourcefile`` still works).
_defined_in: dict[object, str] = {}


def _own_exports() -> None:
    """Name ``hookscope`` as the home of every exported class and function.

    Reprs, tracebacks, pickles and documentation then show ``hookscope.Capture``, the name a
    user writes, not the private module it happens to be defined in (``hookscope._capture...``).
    """
    for name in __all__:
        exported = globals()[name]
        home = getattr(exported, "__module__", None)
        if (
            (isinstance(exported, type) or callable(exported))
            and isinstance(home, str)
            and home.startswith("hookscope.")
        ):
            _defined_in[exported] = home
            exported.__module__ = __name__


_own_exports()


def __dir__() -> list[str]:
    """The public names, the dunders and the public submodules (``hs.errors``, ``hs.integrations``,
    ...), not the imports they are built from: what tab completion offers."""
    return public_dir(__name__)


if not TYPE_CHECKING:  # hidden from mypy, which would otherwise accept any hs.<name>

    def __getattr__(name: str) -> ModuleType:
        """A public submodule not imported yet (``hs.integrations``, ``hs.demo``), imported now."""
        return public_submodule(__name__, name)
