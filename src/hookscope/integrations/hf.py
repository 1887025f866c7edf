"""``HookscopeCallback``: :func:`hookscope.monitor` inside the transformers ``Trainer``.

Attached once, at ``on_train_begin``; each optimiser step is read at ``on_pre_optimizer_step``
(after every micro-batch's backward, before the optimiser and ``zero_grad``), so gradient
accumulation gives one record per optimiser step with the micro-batches merged; removed at
``on_train_end``. The Trainer (transformers 5) clips the gradients before that callback, and
logs as ``grad_norm`` their norm before clipping; the record holds every gradient as the
backward left it, before clipping, the parameters' too (read when the backward ends): the
Trainer's ``grad_norm`` is ``sqrt(sum of param_grad/norm**2)`` of the same step. A NaN/Inf stops training with
:class:`hookscope.NonFiniteError` naming the module, call and step (``error.step`` is the
Trainer's ``global_step``), after saving the offending batch and a trace of it to
``output_dir`` (default: the Trainer's), and with every hook already removed. Under ``fp16``
the gradients are divided by the loss scale of the Trainer's GradScaler (accelerate's
``accelerator.scaler``, found by :func:`trainer_scaler`), as the Trainer's ``grad_norm`` is.

>>> from hookscope.integrations.hf import HookscopeCallback
>>> HookscopeCallback(precision="bf16", every=10)
HookscopeCallback(every=10, precision='bf16', sinks=0)
"""

from __future__ import annotations

from typing import Any

import hookscope as hs
from hookscope._shared.names import public_dir
from hookscope._shared.optional import require
from hookscope.integrations._options import MonitorCallback

__all__ = ["HookscopeCallback", "trainer_scaler"]

_transformers = require("transformers", purpose="hookscope.integrations.hf", package="transformers")


def trainer_scaler(optimizer: Any) -> Any:
    """The GradScaler that scales a Trainer's loss, from the optimizer its callbacks are given:
    accelerate wraps it (``AcceleratedOptimizer``) with its ``accelerator.scaler``, which steps
    and unscales it; None without fp16 (bf16 and fp32 scale nothing) and under DeepSpeed, whose
    loss scale is its own."""
    scaler = getattr(optimizer, "scaler", None)
    return scaler if callable(getattr(scaler, "get_scale", None)) else None


class HookscopeCallback(MonitorCallback, _transformers.TrainerCallback):  # type: ignore[misc,name-defined]
    """Gradient and activation statistics, precision health and the NaN/Inf tripwire for ``Trainer``.

    The options are :class:`hookscope.MonitorOptions`' (``grads``, ``params``, ``activations``,
    ``precision``, ``tripwire``, ``every``, ``sinks``, ``names``, ``flag_above``, ...), as
    keywords or whole (``options=``), checked when the callback is made; ``layers`` picks the
    layers; ``output_dir`` is where a trip keeps its evidence (default: the Trainer's
    ``output_dir``). ``callback.steps`` holds every logged step, ``callback.flags`` every flag.

    Example::

        trainer = Trainer(model, args, train_dataset=data,
                          callbacks=[HookscopeCallback(precision="bf16", sinks=["out/metrics.jsonl"])])
        trainer.train()
    """

    @property
    def flags(self) -> list[hs.MonitorFlag]:
        """Every flag raised so far (precision losses above the threshold), in step order."""
        return [flag for step in self.steps for flag in step.flags]

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise hs.SpecError("HookscopeCallback needs the Trainer's model (on_train_begin got none)")
        self._attach(model, args.output_dir, state.global_step, trainer_scaler(kwargs.get("optimizer")))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None or not self.monitor.live:
            return
        try:
            logged = self.monitor.step(step=state.global_step)
        except BaseException as error:
            self._remove(during=error)  # the Trainer calls no callback when training raises: let go here
            raise
        if logged is not None:
            self.steps.append(logged)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()


def __dir__() -> list[str]:
    """``__all__``, the dunders and public submodules, not the imports: what tab completion offers."""
    return public_dir(__name__)
