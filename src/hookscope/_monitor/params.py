"""Parameter gradient norms, read when the backward ends: one convention for every gradient a step logs.

The activation gradients of a step are the backward's own (tensor hooks record them as they
arrive). Read at ``step()``, a parameter's ``.grad`` would be whatever the loop made of it since:
the transformers ``Trainer`` clips it before ``on_pre_optimizer_step`` (while its own logged
``grad_norm`` is the norm before clipping), and a loop may clip or unscale before ``mon.step()``.
So the parameters' norms are read where the activations' are: a post-accumulate-grad hook on
each trainable parameter (a hook of the monitor's :class:`~hookscope._core.attach.HookGroup`, so
every removal takes it off) queues, once per backward, an autograd final callback that queues a
second one. Final callbacks run in order after the graph and may add more, so the second runs
after every callback queued during the backward, DDP's (which writes the averaged gradients
back) included, and before the caller's next line: clipping, unscaling and the optimiser come after.

"Once per backward" is kept by the backward's id (:func:`~hookscope._core.tracker.backward_id`),
not by a flag: a backward that raises (out of memory) never runs its callbacks, and the next one
queues its own. The read is one ``torch._foreach_norm`` per (device, dtype) of the gradients
and a stack, on the device; a later backward of the same step (gradient accumulation) reads
again and replaces it, so the step keeps the accumulated gradient. The weights' norms, which
no backward changes, are computed once, at :meth:`ParamNorms.take`. A sparse gradient
(``nn.Embedding(sparse=True)``) counts the values it holds. Nothing raises inside autograd's
callback: a read that fails is kept and reported when the step is taken. On a step ``every``
skips, the hook returns after one check.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from hookscope._core.attach import HookGroup
from hookscope._core.compat.private import foreach_norm
from hookscope._core.tracker import backward_id

__all__ = ["ParamNorms", "norms_of"]

Named = list[tuple[str, torch.Tensor]]
#: Each parameter's ``(|g|, |w|)`` from the norms of a step, read: ``{name: (|g|, |w|)}``.
Parse = Callable[[list[np.ndarray]], dict[str, tuple[float, float]]]
_HALF = (torch.float16, torch.bfloat16)


def norms_of(tensors: Named) -> tuple[list[str], list[torch.Tensor]]:
    """The L2 norm of each tensor, without a sync: the names in the order of the vectors returned
    (one per (device, dtype) of plain dense tensors, one per other tensor), each on its device.

    Half types sum in float32 (a loss-scaled gradient's norm overflows float16); a sparse
    tensor's norm is its coalesced values'; a tensor subclass (a DTensor) is measured alone.
    """
    groups: dict[tuple[torch.device, torch.dtype], Named] = {}
    alone: Named = []
    for name, tensor in tensors:
        plain = type(tensor) in (torch.Tensor, nn.Parameter) and tensor.layout == torch.strided
        if plain and tensor.is_floating_point():
            groups.setdefault((tensor.device, tensor.dtype), []).append((name, tensor.detach()))
        else:
            alone.append((name, tensor))
    names: list[str] = []
    vectors: list[torch.Tensor] = []
    with torch.no_grad():
        for (_, dtype), members in groups.items():
            names += [name for name, _ in members]
            vectors.append(torch.stack(_foreach_norm([t for _, t in members], dtype)))
        for name, tensor in alone:
            values = tensor.detach().coalesce().values() if tensor.is_sparse else tensor.detach()
            names.append(name)
            wide = values if values.is_complex() or values.dtype == torch.float64 else values.float()
            vectors.append(torch.linalg.vector_norm(wide).reshape(1))
    return names, vectors


def _foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    wide = torch.float32 if dtype in _HALF else None
    return foreach_norm(tensors, wide)


class ParamNorms:
    """The hooks that read the parameters' gradient norms at the end of each backward."""

    def __init__(self, model: nn.Module, params: list[tuple[str, nn.Parameter]], group: HookGroup) -> None:
        self._params = params
        self._weights = dict(params)
        self.recording = True  # set by the monitor for the step under way
        self.backward_seen = False  # a gradient reached a parameter since the last take()
        self._pending: set[int] = set()  # the backwards whose read is queued and has not run
        self._kept: tuple[list[str], list[torch.Tensor]] | None = None
        self._failure: BaseException | None = None
        holder = {id(p): module for module in model.modules() for p in module.parameters(recurse=False)}
        for name, parameter in params:
            group.add_grad_accumulated(name, holder.get(id(parameter), model), parameter, self._arrived)

    def _arrived(self, parameter: torch.Tensor) -> None:
        self.backward_seen = True
        if not self.recording:
            return
        task = backward_id()
        if task in self._pending:
            return
        self._pending.add(task)
        queue = torch.autograd.Variable._execution_engine.queue_callback
        queue(lambda: queue(lambda: self._read(task)))

    def _read(self, task: int) -> None:
        self._pending.discard(task)
        try:
            self._kept = self._grad_norms()
            self._failure = None
        except Exception as error:  # a statistic never breaks the caller's backward
            self._kept, self._failure = None, error

    def take(self, step: int) -> tuple[list[torch.Tensor], Parse]:
        """The step's norms, as its last backward left them (``.grad`` as it is now where no
        backward ran), with the weights' norms: the vectors to read (on their devices), and the
        function that turns them, read, into ``{name: (|g|, |w|)}``. A fresh step after."""
        kept, failure = self._kept, self._failure
        self.skip()
        if failure is not None:
            warnings.warn(
                f"hs.monitor: step {step} logs no parameter gradient norms: reading them when the backward ended "
                f"failed ({type(failure).__name__}: {failure})",
                RuntimeWarning,
                stacklevel=3,
            )
            return [], lambda rows: {}
        names, grads = kept if kept is not None else self._grad_norms()
        order, weights = norms_of([(name, self._weights[name]) for name in names])
        where = {name: i for i, name in enumerate(order)}

        def parse(rows: list[np.ndarray]) -> dict[str, tuple[float, float]]:
            g = np.concatenate(rows[: len(grads)]) if grads else np.empty(0)
            w = np.concatenate(rows[len(grads) :]) if weights else np.empty(0)
            return {name: (float(g[i]), float(w[where[name]])) for i, name in enumerate(names)}

        return [*grads, *weights], parse

    def _grad_norms(self) -> tuple[list[str], list[torch.Tensor]]:
        return norms_of([(name, p.grad) for name, p in self._params if p.grad is not None])

    def skip(self) -> None:
        """A fresh step, this one's norms unread (a step ``every`` skips)."""
        self._kept, self._failure = None, None
        self._pending.clear()  # a backward that raised never ran its callbacks
        self.backward_seen = False
