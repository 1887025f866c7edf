"""Models made by ``torch.fx`` (``symbolic_trace``, ``torch.export``'s ``ExportedProgram.module()``).

A ``GraphModule`` runs its graph, not its submodules' ``forward``: a hook on a submodule the
graph never calls would never fire. :func:`refuse_uncalled` says so before anything attaches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx
from torch import nn

from hookscope.errors import UnsupportedModelError

__all__ = ["refuse_uncalled"]


def refuse_uncalled(model: nn.Module, names: Sequence[str]) -> None:
    """Refuse hooks on submodules of a ``torch.fx.GraphModule`` that its graph never calls.

    An ``ExportedProgram.module()`` keeps its submodules only as holders of weights (its graph
    reads them with ``get_attr``), and a ``symbolic_trace``d model calls its leaves but never
    its containers: a hook on either would never fire, which is silent loss.
    """
    graph = getattr(model, "graph", None)
    if graph is None or not isinstance(model, torch.fx.GraphModule):
        return
    called = {str(node.target) for node in graph.nodes if node.op == "call_module"}
    never = [name for name in dict.fromkeys(names) if name and name not in called]
    if never:
        shown = ", ".join(repr(name) for name in never[:6]) + (" ..." if len(never) > 6 else "")
        usable = ", ".join(repr(name) for name in sorted(called)[:6]) or "none: only the root"
        raise UnsupportedModelError(
            f"{type(model).__name__} is a torch.fx GraphModule whose graph never calls {shown}, so hooks on "
            f"them would never fire (torch.export's ExportedProgram.module() reads the weights directly); "
            f"modules its graph calls: {usable}; hook the root, or the eager model before it is exported or traced"
        )
