"""Plots of what hookscope measures; each function returns a matplotlib ``Figure``.

matplotlib is imported when a plot is drawn, not with ``hookscope`` (``pip install
'hookscope[plots]'``). Figures are made without pyplot, so plotting never opens a window or
touches pyplot's global state; save one with ``fig.savefig("grad_flow.png")``.
"""

from hookscope.plots.grads import grad_flow, grad_history

__all__ = ["grad_flow", "grad_history"]
