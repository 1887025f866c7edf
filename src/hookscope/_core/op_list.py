"""List the op sites of a model: one forward, every op call of the chosen modules, in order.

Why a module of its own: op sites are named by counters (``softmax#0``) that nobody can guess
from the source alone, and listing them is a use of :class:`~hookscope._core.ops.OpWatcher` (a
listener that keeps what it is told), not part of watching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import named_modules
from hookscope._core.op_sites import OpSite
from hookscope._core.ops import OpWatcher
from hookscope._core.select import Selector, ensure_module, select
from hookscope._core.tree import flatten_tensors

__all__ = ["OpCall", "OpLog", "list_ops"]


@dataclass(frozen=True)
class OpCall:
    """One op call found by :func:`list_ops`: where it ran, and the shapes and dtypes it returned
    (one per tensor of its output, in order)."""

    module: str
    call: int
    op: str
    index: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def site(self) -> OpSite:
        """The op site: ``OpSite("h.0.attn", 0, "softmax", 0)``."""
        return OpSite(self.module, self.call, self.op, self.index)

    def __str__(self) -> str:
        return str(self.site)


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A tensor's shape; a nested tensor's sizes after the first are -1 (ragged or not)."""
    if tensor.is_nested:
        return (tensor.size(0), *(-1,) * (tensor.dim() - 1))
    return tuple(tensor.shape)


class OpLog:
    """A listener that keeps an :class:`OpCall` per op, in call order, and changes nothing."""

    def __init__(self) -> None:
        self.calls: list[OpCall] = []

    def __call__(
        self, module: str, call: int, op: str, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        tensors = [tensor for _, tensor in flatten_tensors(output, root="")]
        shapes = tuple(_shape(tensor) for tensor in tensors)
        self.calls.append(OpCall(module, call, op, index, shapes, tuple(tensor.dtype for tensor in tensors)))


def list_ops(
    model: nn.Module,
    *args: Any,
    layers: Selector | None = None,
    children: bool = False,
    **kwargs: Any,
) -> list[OpCall]:
    """Run one forward and list every op site of the chosen modules, in the order the ops ran.

    Why: op sites are named by counters (``softmax#0``) that nobody can guess from the source
    alone; this shows them. The forward runs in eval mode under ``torch.no_grad()``; modes are
    restored. ``layers`` picks the modules (any selector; by default every module, so each op is
    listed under the module whose own code ran it); ``children=True`` lists the ops of their
    submodules under them too.

    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Softmax(dim=-1))
    >>> [(str(op), op.shapes) for op in list_ops(model, torch.ones(2, 3))]
    [('0#0:op[linear#0]', ((2, 4),)), ('1#0:op[softmax#0]', ((2, 4),))]
    """
    ensure_module(model)
    ensure_loaded(model, (args, kwargs))
    modules = named_modules(model) if layers is None else select(model, layers)
    log = OpLog()
    watcher = OpWatcher(model, modules, log, children=children, owner="layers", restore_mode=True, bare_to_caller=True)
    with watcher, torch.no_grad():
        model.eval()
        model(*args, **kwargs)
    return log.calls
