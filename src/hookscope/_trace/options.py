"""``TraceOptions``: what a trace records of each call, declared and checked in one place.

``hs.trace``, ``hs.run_with_trace``, ``hs.tracing`` and ``hookscope trace`` build one, so a
bad value is refused before any hook is attached and an option means the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from hookscope._core.op_sites import OpPattern, op_pattern
from hookscope._shared.histogram import DEFAULT_BINS
from hookscope._shared.options import Options
from hookscope._shared.stats import STAT_CHOICES
from hookscope.errors import SpecError

__all__ = ["OpsChoice", "Passes", "StatsChoice", "TraceOptions"]

Passes = Literal["latest", "all"]  # spelled as a capture's passes= is
#: ``stats=``: True (all), False (shapes only), or the statistics to keep (:data:`STAT_CHOICES`).
StatsChoice = bool | str | tuple[str, ...] | list[str]
#: ``ops=``: False, True (every op of every traced module), or op selectors.
OpsChoice = bool | str | tuple[str, ...] | list[str]


@dataclass(frozen=True)
class TraceOptions(Options):
    """What a trace records of every traced call.

    >>> TraceOptions(histograms=True).bins
    64
    >>> sorted(TraceOptions(stats=["min", "max"]).stat_fields)
    ['max', 'min']
    >>> TraceOptions(stats=False, histograms=8)
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: histograms= needs statistics: leave stats=True (stats=False records shapes only)
    """

    feature = "trace"

    stats: StatsChoice = True
    """Min, max, mean, std, mean ``|x|``, fraction of zeros, NaN and +/-Inf counts of every output tensor,
    computed on the device and read once per pass; ``False``: shapes only; or a list of the
    statistics to keep, among ``"min"``, ``"max"``, ``"mean"``, ``"std"``, ``"abs_mean"``,
    ``"zeros"`` and ``"nonfinite"`` (NaN/Inf counts are always kept; the others read NaN and, where
    they would cost a pass of their own, are not computed).
    """
    input_stats: bool = True
    """Also measure inputs no traced module returned (the model's input, results of functional ops);
    ``False`` skips them and ``first_nonfinite`` takes them as finite.
    """
    timing: bool = False
    """Per-call time (CUDA events on GPU; on the CPU hookscope's own measuring is taken out)."""
    memory: bool = False
    """The rise of peak CUDA memory per call (this resets PyTorch's peak counter,
    ``torch.cuda.max_memory_allocated``, as it goes).
    """
    histograms: bool | int = False
    """``True`` (64 bins) or a bin count: a histogram of every measured tensor's finite values, counted
    on the device from a sample of at most 32,768 values.
    """
    passes: Passes = "latest"
    """``"latest"`` (each forward replaces the trace) or ``"all"`` (every pass's trace is kept,
    ``tracer.passes``: a ``generate()`` loop's prefill, then one per token).
    """
    ops: OpsChoice = False
    """Op sites to add rows for, one per op call, nested under their module's call: an op selector
    (``"h.*.attn:op[softmax]"``), an attention sub-site (``"h.*.attn:attn.pattern"``), a list of
    them, or ``True`` for every op that every traced module's own code calls (a row per ``view``,
    ``split``, ``add``...: many rows, one statistic each). The selectors' modules are traced too; a
    selector whose module ran but whose op never did is an error at the end of the pass.
    """

    experts: bool = False
    """For every fused mixture-of-experts module traced, a row per expert (``expert.weights``: the
    tokens it took and their routing weights) and its router's entropy; :meth:`Trace.experts`
    reads them as one table (:mod:`hookscope._trace.experts`).
    """

    def __post_init__(self) -> None:
        object.__setattr__(self, "stats", _stat_choice(self.stats))
        for option in ("input_stats", "timing", "memory", "experts"):
            check_flag(option, getattr(self, option))
        ops: object = self.ops
        # True or False; a list or one text: a tuple of texts, each checked
        object.__setattr__(self, "ops", bool(ops) if isinstance(ops, (bool, np.bool_)) else _op_selectors(ops))
        if self.experts and self.ops is True:
            raise SpecError(
                "experts=True and ops=True: while experts are tapped hookscope computes them, so an experts module's "
                "own ops do not run and ops=True could not list them; trace them in separate runs, or name the op "
                "sites you want with ops=[...]"
            )
        if self.passes not in ("latest", "all"):
            raise SpecError(f"passes={self.passes!r} is not 'latest' (each forward replaces the trace) or 'all'")
        _bins(self.histograms, bool(self.stats))  # refused now, not when the tracer attaches

    @property
    def stat_fields(self) -> frozenset[str] | None:
        """The statistics ``stats`` chose; None for all of them (or for none, with ``stats=False``)."""
        return None if isinstance(self.stats, bool) else frozenset(self.stats)

    @property
    def bins(self) -> int | None:
        """The histogram bin count ``histograms`` asks for; None when off."""
        return _bins(self.histograms, bool(self.stats))

    @property
    def op_patterns(self) -> list[OpPattern]:
        """The op selectors ``ops`` names, parsed (none for ``False`` and ``True``)."""
        if isinstance(self.ops, bool):
            return []
        return [pattern for text in self.ops if (pattern := op_pattern(text)) is not None]


def _stat_choice(stats: object) -> bool | tuple[str, ...]:
    """``stats=`` as True, False or a tuple of known statistics (in :data:`STAT_CHOICES` order)."""
    if isinstance(stats, (bool, np.bool_)):
        return bool(stats)
    chosen = [stats] if isinstance(stats, str) else stats
    if isinstance(chosen, (list, tuple)) and all(isinstance(field, str) for field in chosen):
        if not chosen:
            raise SpecError(
                f"stats= chose no statistic; expected some of {', '.join(STAT_CHOICES)}, or False for shapes only"
            )
        unknown = [field for field in chosen if field not in STAT_CHOICES]
        if not unknown:
            return tuple(field for field in STAT_CHOICES if field in chosen)
        raise SpecError(
            f"stats= names {', '.join(map(repr, unknown))}, not a statistic; expected some of "
            f"{', '.join(STAT_CHOICES)} (or True for all, False for shapes only)"
        )
    raise SpecError(
        f"stats={stats!r}; expected True (every statistic), False (shapes only) or a list of statistics "
        f"among {', '.join(STAT_CHOICES)}; to pass stats= to the model, use model_kwargs={{'stats': ...}}"
    )


def _op_selectors(ops: object) -> tuple[str, ...]:
    """``ops=`` given as selectors: a tuple of op selector texts, each checked now."""
    texts = [ops] if isinstance(ops, str) else ops
    if not isinstance(texts, (list, tuple)) or not texts:
        raise SpecError(
            f"ops={ops!r}; expected True (every op of the traced modules), an op selector such as "
            "'h.*.attn:op[softmax]' or 'h.0.attn:attn.pattern', or a list of them"
        )
    for text in texts:
        if op_pattern(text) is None:  # a malformed op selector raised there already
            raise SpecError(
                f"ops= takes op selectors, such as 'h.*.attn:op[softmax]' or 'h.0.attn:attn.pattern', not {text!r}; "
                "modules are chosen by layers="
            )
    return tuple(texts)


def check_flag(option: str, value: object) -> None:
    """A trace option that takes True or False; anything else was likely meant for the model."""
    if not isinstance(value, (bool, np.bool_)):
        raise SpecError(
            f"{option}= is trace's own option and takes True or False, not a {type(value).__name__}; "
            f"to pass {option}= to the model, use model_kwargs={{{option!r}: ...}}"
        )


def _bins(histograms: object, stats: bool) -> int | None:
    """The bin count ``histograms=`` asks for (None: off), or a clear error."""
    if isinstance(histograms, (bool, np.bool_)):
        bins = DEFAULT_BINS if histograms else None
    elif isinstance(histograms, int) and histograms > 0:
        bins = histograms
    else:
        raise SpecError(f"histograms={histograms!r}; expected True, False or a positive number of bins such as 64")
    if bins and not stats:
        raise SpecError("histograms= needs statistics: leave stats=True (stats=False records shapes only)")
    return bins
