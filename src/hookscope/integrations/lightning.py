"""``HookscopeCallback``: :func:`hookscope.monitor` inside a Lightning ``Trainer``.

Attached at ``on_train_start`` to the ``LightningModule``; each optimiser step is read at
``on_before_optimizer_step`` (every micro-batch's backward done, ``accumulate_grad_batches``
merged, before the optimiser and ``zero_grad``); removed at ``on_train_end`` and in
``on_exception``. A NaN/Inf stops training with :class:`hookscope.NonFiniteError` naming the
module and ``error.step`` (the Trainer's ``global_step``), after saving the batch and a trace to
``output_dir`` (default: the Trainer's ``default_root_dir``). Under ``precision="16-mixed"`` the
gradients are divided by the loss scale of the precision plugin's GradScaler.

>>> from hookscope.integrations.lightning import HookscopeCallback
>>> HookscopeCallback(every=5)
HookscopeCallback(every=5, precision=None, sinks=0)
"""

from __future__ import annotations

from typing import Any

from hookscope._shared.names import public_dir
from hookscope._shared.optional import require
from hookscope.integrations._options import MonitorCallback

__all__ = ["HookscopeCallback"]

_pl = require("lightning.pytorch", purpose="hookscope.integrations.lightning", extra="lightning", package="lightning")


class HookscopeCallback(MonitorCallback, _pl.Callback):  # type: ignore[misc,name-defined]
    """Gradient and activation statistics, precision health and the NaN/Inf tripwire for Lightning.

    The options are :class:`hookscope.MonitorOptions`' (keywords, or whole as ``options=``);
    ``callback.steps`` holds every logged step.
    With ``log_to_lightning=True`` (default) each logged step's scalars also go to the Trainer's
    loggers (``logger.log_metrics``), so TensorBoard, wandb, MLflow or CSV loggers configured on
    the Trainer receive them.

    Example::

        trainer = lightning.Trainer(max_steps=100, callbacks=[HookscopeCallback(precision="bf16")])
        trainer.fit(module, loader)
    """

    def __init__(self, layers: Any = None, *, log_to_lightning: bool = True, **options: Any) -> None:
        super().__init__(layers, **options)
        self.log_to_lightning = log_to_lightning

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)  # 16-mixed's GradScaler
        self._attach(pl_module, trainer.default_root_dir, trainer.global_step, scaler)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is None or not self.monitor.live:
            return
        logged = self.monitor.step(step=trainer.global_step)
        if logged is None:
            return
        self.steps.append(logged)
        if self.log_to_lightning and trainer.loggers:
            finite = {name: value for name, value in logged.scalars.items() if value == value}
            for logger in trainer.loggers:
                logger.log_metrics(finite, step=logged.step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove(during=exception)


def __dir__() -> list[str]:
    """``__all__``, the dunders and public submodules, not the imports: what tab completion offers."""
    return public_dir(__name__)
