"""``trace()``, ``run_with_trace()`` and ``tracing()``: the entry points that make a :class:`Tracer`.

They check and split the arguments, run the model (or leave it to the caller) and hand back the
:class:`Trace`; the hooks and the pass's bookkeeping are ``recorder``'s. Separate so the
public signatures and their examples read on their own, apart from the hook machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.select import Selector, ensure_module, given_selectors
from hookscope._shared.options import with_options
from hookscope._trace.options import TraceOptions, check_flag
from hookscope._trace.recorder import Tracer
from hookscope._trace.result import Trace

__all__ = ["run_with_trace", "trace", "tracing"]


@with_options(TraceOptions)
def tracing(
    model: nn.Module,
    *,
    layers: Selector | Sequence[Selector] | None = None,
    options: TraceOptions | None = None,
    **opts: Any,
) -> Tracer:
    """Trace every forward pass of ``model`` while the block runs; ``tracer.trace`` is the latest.

    Use it where :func:`run_with_trace` cannot call the model for you (a generation loop, your
    own training step); the options are :class:`TraceOptions`'. The model runs as you call it:
    grad mode and train/eval mode are yours. ``passes="all"`` keeps every pass's trace
    (``tracer.passes``), not only the latest.

    Example::

        with hs.tracing(model, timing=True, passes="all") as tracer:
            model.generate(ids, max_new_tokens=5)
        print(tracer.trace)          # the last forward pass
        tracer.passes[0]             # the prefill; one more per generated token

    >>> import torch, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(4, 2))
    >>> with hs.tracing(model, passes="all") as tracer:
    ...     _ = model(torch.randn(3, 4)), model(torch.randn(5, 4))
    >>> [t["0"].outputs[0].shape for t in tracer.passes]
    [(3, 2), (5, 2)]
    """
    chosen = None if layers is None else given_selectors((), layers, feature="trace")
    return Tracer(model, layers=chosen, options=TraceOptions.build(options, opts))


@with_options(TraceOptions, keep=("grad", "model_kwargs"))
def run_with_trace(
    model: nn.Module,
    *args: Any,
    layers: Selector | Sequence[Selector] | None = None,
    options: TraceOptions | None = None,
    grad: bool = False,
    model_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Any, Trace]:
    """Run ``model(*args, **kwargs)`` once, tracing it; return ``(output, trace)``.

    Each row of the :class:`Trace` holds a call's order, depth, name, class and call index, the
    shapes, dtypes and devices of its inputs (keyword inputs too) and outputs (every tensor of a
    structured output), its own parameter count, and statistics of every output tensor: min,
    max, mean, std, mean ``|x|``, fraction of zeros, NaN and +/-Inf counts, computed on the device
    and read once after the forward (see :mod:`hookscope._shared.stats`).

    - ``layers``: trace only these modules (default: all, the model itself included);
    - the options are :class:`TraceOptions`' (``stats``, ``input_stats``, ``timing``,
      ``memory``, ``histograms``, ``passes``, ``ops``), as keywords or ``options=``;
    - ``ops``: op sites to add rows for (``"h.*.attn:op[softmax]"``, ``"h.0.attn:attn.pattern"``,
      a list, or ``True`` for every op of the traced modules): one row per op call, named by its
      site (``h.0.attn:op[softmax#0]``), one deeper than its module's call and inside it, with the
      same statistics as a module's row;
    - ``grad=False`` runs under ``torch.no_grad()``; ``True`` keeps autograd on. The train/eval
      mode is left as it is;
    - ``model_kwargs``: keyword arguments for the model whose names clash with these options
      (``nn.TransformerDecoder``'s ``memory=``); other keyword arguments go to the model.

    A forward that raises re-raises its error with a note naming the innermost module it went
    through and the shapes that went in; ``hs.tracing`` keeps the partial trace.

    >>> import torch, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> out, t = hs.run_with_trace(model, torch.randn(3, 4))
    >>> out.shape, len(t), t[1].name, t[1].outputs[0].shape, t["1"].stats.min >= 0
    (torch.Size([3, 2]), 4, '0', (3, 8), True)
    """
    check_flag("grad", grad)
    chosen, model_kw = TraceOptions.split(kwargs)
    ensure_loaded(ensure_module(model), (args, model_kw, model_kwargs))  # a meta model: one line, not torch's
    with tracing(model, layers=layers, options=TraceOptions.build(options, chosen)) as tracer:
        try:
            with nullcontext() if grad else torch.no_grad():
                output = model(*args, **{**model_kw, **(model_kwargs or {})})
        except Exception as error:
            failure = tracer.latest.failure if tracer.latest is not None else None
            if failure is not None and hasattr(error, "add_note"):
                error.add_note(f"hookscope.trace: the error went through {failure.describe()}")
            raise
    return output, tracer.trace


@with_options(TraceOptions, keep=("grad", "model_kwargs"))
def trace(
    model: nn.Module,
    *args: Any,
    layers: Selector | Sequence[Selector] | None = None,
    options: TraceOptions | None = None,
    grad: bool = False,
    model_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Trace:
    """Run ``model(*args, **kwargs)`` once and return its :class:`Trace`: one row per module call.

    The short form of :func:`run_with_trace`, for when the output is not needed; the same
    arguments.

    >>> import torch, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> t = hs.trace(model, torch.randn(3, 4))
    >>> len(t), t[1].name, t[1].outputs[0].shape, t["1"].stats.min >= 0
    (4, '0', (3, 8), True)

    ``ops=`` adds a row per call of the op sites it selects, under the row of its module's call
    (``hs.layers(model, x, ops=True)`` lists the op sites):

    >>> t = hs.trace(model, torch.randn(3, 4), ops="2:op[linear]")
    >>> [(row.site, row.depth) for row in t][-2:]
    [('2#0', 1), ('2#0:op[linear#0]', 2)]
    >>> t["2:op[linear#0]"].outputs[0].shape, t["2:op[linear#0]"].stats == t["2"].stats
    ((3, 2), True)
    """
    _, result = run_with_trace(
        model, *args, layers=layers, options=options, grad=grad, model_kwargs=model_kwargs, **kwargs
    )
    return result
