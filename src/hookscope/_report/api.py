"""``report()``: trace a forward pass (and a backward one), draw it, and write one HTML file."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from hookscope._arch.std import expand_std
from hookscope._capture import capture
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.select import Selector, ensure_module, given_selectors
from hookscope._core.sites import Site
from hookscope._core.tree import call_leaves
from hookscope._monitor import GradMonitor, Recorded, recorded_steps, summarise, watch_grads
from hookscope._report import sections
from hookscope._report.images import Image, embed
from hookscope._report.render import render, script_json
from hookscope._shared.files import check_output_path, write_text
from hookscope._shared.histogram import Histogram
from hookscope._shared.optional import require
from hookscope._shared.options import renamed
from hookscope._shared.thinning import DEFAULT_MAX_SITES, spread
from hookscope._trace import Trace, TraceRow, trace
from hookscope._version import __version__
from hookscope.errors import SpecError

__all__ = ["DEFAULT_FEATURE_MAPS", "html_path", "report"]

DEFAULT_FEATURE_MAPS = 6
_FEATURE_CHANNELS = 16


def report(
    model: nn.Module,
    *args: Any,
    out: str | os.PathLike[str] = "report.html",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    grads: Recorded | None = None,
    layers: Selector | Sequence[Selector] | None = None,
    max_sites: int = DEFAULT_MAX_SITES,
    feature_maps: int = DEFAULT_FEATURE_MAPS,
    title: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    sites: Selector | Sequence[Selector] | None = None,
    **kwargs: Any,
) -> Path:
    """Run ``model(*args, **kwargs)`` and write a self-contained HTML report of it to ``out``.

    The page needs no network: styles, script and images are inside it. It shows

    - the model: classes, parameters, dtypes, devices, input and output shapes;
    - the trace (:func:`hookscope.trace`): one row per call, sortable, filterable by name,
      NaN/Inf rows highlighted, each row opening onto every tensor's statistics and a histogram;
    - layer statistics along depth, value histograms per layer, feature-map grids of up to
      ``feature_maps`` conv-like outputs (first item of the batch);
    - gradients when ``loss_fn`` is given: ``loss_fn(output)`` must return a scalar; one
      backward pass is watched (:func:`hookscope.watch_grads`) and the parameters' ``.grad``
      are set back as they were. Or pass ``grads=`` a monitor that recorded steps already
      (``hs.monitor`` or ``hs.watch_grads``) or its steps.

    Images are drawn for a subset, so a model of thousands of modules gives a page that loads
    at once: ``layers`` (a selector; formerly ``sites``) picks the layers drawn, by default up to ``max_sites``
    leaf modules spread from first to last. Every name and ``title`` are HTML-escaped. The
    forward runs twice under ``torch.no_grad()`` (trace, then feature maps), plus once with
    autograd for ``loss_fn``; train/eval mode is left as it is, so in training mode dropout
    differs between those runs and BatchNorm's running statistics take each of them in:
    report a model in eval mode. The ``.grad`` of the parameters and of any input tensor
    that requires grad are put back after the backward. Returns the path written.

    Example::

        hs.report(model, images, out="report.html", loss_fn=lambda logits: F.cross_entropy(logits, labels))
    """
    ensure_loaded(model)  # a meta model: one line, not torch's error
    model = ensure_module(model)
    layers = renamed(layers, sites, new_name="layers", old_name="sites", where="hs.report")
    layers = None if layers is None else given_selectors((), layers, feature="report")
    if layers is not None:  # "std:blocks.*" -> the modules carrying those canonical names
        layers = expand_std(model, layers, "module")[0]
    path = html_path(out)
    if loss_fn is not None and not callable(loss_fn):
        raise SpecError(f"loss_fn must be a function of the model's output; got {type(loss_fn).__name__}")
    if loss_fn is not None and grads is not None:
        raise SpecError("pass loss_fn= (one backward pass is run) or grads= (a monitor or its steps), not both")
    for option, value in (("max_sites", max_sites), ("feature_maps", feature_maps)):
        if not isinstance(value, int) or value < 0:
            raise SpecError(f"{option}={value!r}; expected a count of 0 or more")
    _need_plotting()
    call_kwargs = {**kwargs, **(model_kwargs or {})}
    traced = trace(model, *args, histograms=True, model_kwargs=call_kwargs)
    chosen = traced.measured_leaves(layers)  # a mistyped selector fails here, before anything is drawn
    figures: dict[str, Image | None] = {"layer_stats": None, "histograms": None}
    if chosen:
        figures["layer_stats"] = _layer_stats(traced, layers)
        counted = [(row.site, histogram) for row in chosen if (histogram := _counted_histogram(row)) is not None]
        if counted and max_sites:
            figures["histograms"] = _histograms(spread(counted, max_sites))
    maps = _feature_maps(model, args, call_kwargs, chosen, feature_maps)
    monitor_section = _gradients(model, args, call_kwargs, loss_fn, grads)
    context = {
        "title": title or f"hookscope report: {type(model).__name__}",
        "meta": {
            "hookscope": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "created": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        },
        "overview": sections.overview(model, traced),
        "notes": _notes(traced),
        "columns": sections.COLUMNS,
        "rows": sections.table_rows(traced),
        "details_json": script_json(sections.details(traced)),
        "figures": figures,
        "feature_maps": maps,
        "grads": monitor_section,
    }
    return write_text(path, render(context), what="out")


def html_path(out: str | os.PathLike[str]) -> Path:
    """``out`` as a path, or a clear error when it is no HTML file name."""
    path = Path(out)
    if path.suffix.lower() not in (".html", ".htm"):
        raise SpecError(f"out={os.fspath(out)!r}: a report is one HTML file; give a name ending in .html")
    if path.is_dir():
        raise SpecError(
            f"out={os.fspath(out)!r} is a folder; give a file name such as {os.fspath(path / 'report.html')!r}"
        )
    return check_output_path(path, what="out")  # before the model runs, not after


def _need_plotting() -> None:
    """Both of the report's packages, checked before the model runs rather than after."""
    for module in ("jinja2", "matplotlib"):
        require(module, purpose="hs.report", extra="report")


def _notes(traced: Trace) -> list[dict[str, str]]:
    notes = []
    origin = traced.first_nonfinite()
    if origin is not None and not origin.from_input:
        main = origin.stats
        counts = "" if main is None else f" ({main.nan} NaN, {main.inf} Inf in its output)"
        notes.append({"kind": "bad", "text": f"NaN/Inf first appears in {origin.site} ({origin.class_name}){counts}"})
    elif any(row.output_finite is False for row in traced.rows):
        notes.append(
            {"kind": "bad", "text": "some outputs hold NaN/Inf; they were already non-finite where they came in"}
        )
    return notes


def _layer_stats(traced: Trace, layers: Selector | Sequence[Selector] | None) -> Image:
    from hookscope.plots import layer_stats

    fig = layer_stats(traced, layers)
    return embed(
        fig,
        "layer statistics along depth",
        "Each layer's output: range, mean ± std (top) and scale on a log axis (bottom), "
        "in the order the outputs were made.",
    )


def _counted_histogram(row: TraceRow) -> Histogram | None:
    """The histogram of the call's main output, when it counted any finite value."""
    histogram = None if row.output is None else row.output.histogram
    return histogram if histogram is not None and histogram.counted > 0 else None


def _histograms(named: list[tuple[str, Histogram]]) -> Image:
    from hookscope.plots import histograms

    fig = histograms(named)  # one panel per chosen call, not every call of a reused module
    return embed(
        fig,
        f"value histograms of {len(named)} layers",
        f"Distribution of the output values of {len(named)} layers "
        "(up to 32,768 values of each, in runs of 128 spread through the tensor).",
    )


def _feature_maps(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], chosen: list[TraceRow], limit: int
) -> list[Image]:
    rows = spread(sections.feature_map_rows(chosen), limit) if limit else []
    if not rows:
        return []
    from hookscope.plots import feature_maps

    wanted = {row.name for row in rows}
    calls = {row.call for row in rows}
    only: int | Literal["all"] = calls.pop() if len(calls) == 1 else "all"  # just the calls drawn, where one serves
    # A predicate, not the names: a name such as 'a[0]' or 're:q' would read as a glob or a regex.
    with capture(model, lambda name, _: name in wanted, calls=only) as cache, torch.no_grad():
        model(*args, **kwargs)
    images = []
    for row in rows:
        path = row.output.path if row.output is not None else ""
        value = cache[Site(row.name, row.call, "output", path)]  # the leaf, where the output is a tuple
        fig = feature_maps(value, _FEATURE_CHANNELS, title=row.site)
        shape = "x".join(str(size) for size in value.shape[1:])
        images.append(embed(fig, f"feature maps of {row.site}", f"{row.site} ({row.class_name}), output {shape}"))
    return images


def _gradients(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    grads: Recorded | None,
) -> dict[str, Any] | None:
    loss = None
    if loss_fn is not None:
        grads, loss = _one_backward(model, args, kwargs, loss_fn)
    if grads is None:
        return None
    steps = recorded_steps(grads, argument="grads=")
    from hookscope.plots import grad_flow, grad_history

    figures = [embed(grad_flow(steps), "gradient flow per layer")]
    if len(steps) > 1:
        figures.append(embed(grad_history(steps), "gradient norms over steps"))
    latest = steps[-1]
    caption = (
        f"One backward pass of loss_fn(output), loss {loss:.4g}: |gradient| per layer, in forward order."
        if loss is not None
        else f"{len(steps)} recorded steps; the flow shown is the latest's (step {latest.step})."
    )
    return {
        "caption": caption,
        "flags": [str(flag) for flag in summarise(steps).flags],
        "figures": figures,
        "params": sections.param_rows(latest),
    }


def _one_backward(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: Callable[[Any], torch.Tensor]
) -> tuple[GradMonitor, float]:
    """Watch one backward pass of ``loss_fn(model(...))``; the parameters' ``.grad`` are put back."""
    leaves = [t for _, t in call_leaves(args, kwargs) if t.requires_grad and t.is_leaf]
    saved = {tensor: tensor.grad for tensor in [*model.parameters(), *leaves]}
    for tensor in saved:
        tensor.grad = None
    try:
        with watch_grads(model) as monitor, torch.enable_grad():
            loss = loss_fn(model(*args, **kwargs))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise SpecError(f"loss_fn must return a scalar tensor; it returned {shape}")
            if not loss.requires_grad:
                raise SpecError(
                    "loss_fn returned a tensor that does not depend on any parameter that requires grad "
                    "(frozen weights, or a value made outside the model's output); nothing to backpropagate"
                )
            loss.backward()  # type: ignore[no-untyped-call]
            monitor.step()
    finally:
        for tensor, grad in saved.items():
            tensor.grad = grad
    return monitor, float(loss.detach())
