"""``MonitorOptions``: the training monitor's options, declared and validated once.

``hs.monitor`` (keywords or ``options=``), the transformers and Lightning callbacks (each holds
one) and ``hookscope train-check`` build the same object, so an option added here reaches all
of them. It round-trips to a dict (:meth:`~hookscope._shared.options.Options.to_dict`); the
options that are Python objects (a sink object, a GradScaler) are named there, not restorable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hookscope._shared.options import Options
from hookscope._shared.precision import precision_target
from hookscope.errors import SpecError

__all__ = ["MonitorOptions"]


@dataclass(frozen=True)
class MonitorOptions(Options):
    """What :func:`hookscope.monitor` watches, how often, and where it logs.

    >>> MonitorOptions(every=10, precision="bf16").changes()
    {'precision': 'bf16', 'every': 10}
    >>> MonitorOptions.from_dict(MonitorOptions(every=10).to_dict()) == MonitorOptions(every=10)
    True
    """

    feature = "monitor"

    grads: bool = True
    """Gradient statistics per layer (``grad/norm``, ``grad/max_abs``), in one tensor hook per watched
    tensor.
    """
    params: bool = True
    """Per-parameter gradient norms and ``|g| / |w|`` (``param_grad/norm``, ``param_grad/ratio``).
    """
    activations: bool = True
    """Activation statistics per layer (``act/mean_abs``, ``act/max_abs``, ``act/std``).
    """
    precision: str | torch.dtype | None = None
    """``"bf16"``, ``"fp16"``, ``"fp8"`` (e4m3fn), ``"float8_e5m2"``: what that format loses of each
    layer's output and of its gradient, per step (underflow, subnormal, overflow fractions and the
    dynamic range in octaves), flagged above ``flag_above``.
    """
    tripwire: bool = True
    """Stop at the first NaN/Inf: in the forward, ``model(x)`` raises :class:`~hookscope.NonFiniteError`
    naming the module; in the backward, ``step()`` does, naming the first gradient in backward order,
    with ``error.step``. A trip takes every hook off before the error leaves, so a loop the monitor does
    not enclose (a Trainer's) keeps none. Under ``torch.compile`` a forward trip is not seen until the
    ``with`` block (or the callback's end) removes the hooks, and keeps no evidence: check a run that
    trips eagerly. ``tripwire=False`` raises neither: a NaN/Inf gradient becomes a ``grad_nonfinite``
    flag of the step, and the run goes on. So does one under a known ``grad_scaler``: an overflow is the
    scaler's to handle (it skips the step and lowers its scale).
    """
    every: int = 1
    """Log every N-th step (by the step numbers, from ``start``); other steps' hooks return at once and
    cross to the host never. Only forwards under grad count (an evaluation's forward between steps does
    not), and the backward tripwire checks logged steps.
    """
    sinks: tuple[Any, ...] = ()
    """Paths (``.jsonl``, ``.csv``; closed with the monitor), a TensorBoard ``SummaryWriter``, or
    objects with ``write(step, scalars)`` (left open: their owner closes them, so one sink can serve
    several runs). Every sink gets every step; sinks that raise are named after the others wrote, in one
    :class:`~hookscope.SinkError`.
    """
    names: str = "std"
    """``"std"`` logs canonical names (``blocks.3``) where the model has them, ``"modules"`` module
    names.
    """
    flag_above: float = 0.01
    """The fraction of a layer's values a format may lose before the step is flagged.
    """
    histograms: bool = False
    """Also a histogram of each layer's output per logged step (64 buckets of a sample of at most 32,768
    values, counted on the device): ``step.histograms``, and the sinks that draw them (TensorBoard,
    wandb).
    """
    trip_dir: str | os.PathLike[str] | None = None  # kept as a str
    """Where a trip keeps its evidence: the offending batch and a trace of the model on it (every call's
    shapes and value ranges), named by step.
    """
    start: int = 0
    """The number of the first step (a resumed run's), for the logs and ``error.step``.
    """
    grad_scaler: Any = None
    """The ``torch.amp.GradScaler`` that scales the loss (fp16): every gradient statistic of a step is
    divided by its scale (``get_scale()``, read once per logged step: call ``step()`` before
    ``scaler.update()``), so the record holds the gradients of the loss itself. Under float16 autocast
    with none given, a warning (once) says the gradients may carry a scale.
    """

    def __post_init__(self) -> None:
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise SpecError(f"every={every!r} is not a positive whole number of steps; 1 logs every step")
        if self.names not in ("std", "modules"):
            raise SpecError(
                f"names={self.names!r}: expected 'std' (canonical names where the model has them) or 'modules'"
            )
        if isinstance(self.start, bool) or not isinstance(self.start, int):
            raise SpecError(f"start={self.start!r} is not a whole step number; 0 starts the count")
        if isinstance(self.flag_above, bool) or not isinstance(self.flag_above, (int, float)):
            raise SpecError(f"flag_above={self.flag_above!r} is not a fraction (0.01 flags a loss above 1%)")
        precision_target(self.precision)  # a format that is not a low-precision one is refused here
        if isinstance(self.sinks, (str, os.PathLike)):
            raise SpecError(f"sinks={self.sinks!r} is one sink: give a list, sinks=[{self.sinks!r}]")
        # Paths as strings: a stored dict holds them (a sink object is named there, not kept).
        sinks = tuple(os.fspath(sink) if isinstance(sink, os.PathLike) else sink for sink in self.sinks)
        object.__setattr__(self, "sinks", sinks)
        if isinstance(self.trip_dir, os.PathLike):
            object.__setattr__(self, "trip_dir", os.fspath(self.trip_dir))

    @property
    def target(self) -> torch.dtype | None:
        """The low-precision format whose losses are counted, or None."""
        return precision_target(self.precision)
