"""Parameter gradient norms, read when the backward ends: one convention for every gradient a step logs.

The activation gradients of a step are the backward's own (tensor hooks record them as they
arrive). Read at ``step()``, a parameter's ``.grad`` would be whatever the loop made of it since:
the transformers ``Trainer`` clips it before ``on_pre_optimizer_step`` (while its own logged
``grad_norm`` is the norm before clipping), and a loop may clip before ``mon.step()``. So the
parameters' norms are read where the activations' are: a post-accumulate-grad hook on each
trainable parameter queues, once per backward, an autograd final callback that queues a second
one. Final callbacks run in order after the graph and may add more, so the second runs after
every callback queued during the backward, DDP's (which writes the averaged gradients back)
included, and before the caller's next line: clipping, unscaling and the optimiser come after.

It stacks ``[|g|, |w|]`` of every parameter on its device; a later backward of the same step
(gradient accumulation) reads again and replaces it, so the step keeps the accumulated gradient.
Nothing crosses to the host here; on a step ``every`` skips the hook returns after one check.
Under a GradScaler (fp16) these gradients, like the activations', carry the loss scale.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ParamNorms", "norms_now"]


def norms_now(params: list[tuple[str, nn.Parameter]]) -> tuple[list[str], list[torch.Tensor]]:
    """The parameters with a gradient, and ``[|g|, |w|]`` of each on its device (not read)."""
    named = [(name, p, p.grad) for name, p in params if p.grad is not None]
    with torch.no_grad():
        norms = [
            torch.stack([torch.linalg.vector_norm(g.detach().float()), torch.linalg.vector_norm(p.detach().float())])
            for _, p, g in named
        ]
    return [name for name, _, _ in named], norms


class ParamNorms:
    """The hooks that read the parameters' gradient norms at the end of each backward."""

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        self._params = params
        self.recording = True  # set by the monitor for the step under way
        self.backward_seen = False  # a gradient reached a parameter since the last take()
        self._queued = False
        self._kept: tuple[list[str], list[torch.Tensor]] | None = None
        self._handles: list[RemovableHandle] = []
        try:
            for _, parameter in params:
                hook = parameter.register_post_accumulate_grad_hook(self._arrived)  # type: ignore[no-untyped-call]
                self._handles.append(hook)
        except BaseException:
            self.remove()
            raise

    def _arrived(self, parameter: torch.Tensor) -> None:
        self.backward_seen = True
        if self._queued or not self.recording:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._after_the_others)

    def _after_the_others(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._read)

    def _read(self) -> None:
        self._queued = False
        self._kept = norms_now(self._params)

    def take(self) -> tuple[list[str], list[torch.Tensor]]:
        """The step's norms, as its last backward left them (``.grad`` as it is now where no
        backward ran); a fresh step after."""
        kept = self._kept
        self.skip()
        return kept if kept is not None else norms_now(self._params)

    def skip(self) -> None:
        """A fresh step, this one's norms unread (a step ``every`` skips)."""
        self._kept = None
        self._queued = self.backward_seen = False  # also after a backward that raised before its callbacks ran

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
