"""Plots of what hookscope measures; each function returns a matplotlib ``Figure``.

matplotlib is imported when a plot is drawn, not with ``hookscope`` (``pip install
'hookscope[plots]'``). Figures are made without pyplot, so plotting never opens a window or
touches pyplot's global state; save one with ``fig.savefig("grad_flow.png")``.

- :func:`feature_maps`: a conv-like output's channels as a grid of images;
- :func:`histograms`: value distributions per layer (from a trace or a capture);
- :func:`layer_stats`: mean, std, min and max of each layer's output along depth;
- :func:`grad_flow`, :func:`grad_history`: gradients per layer, and over training steps;
- :func:`diff_profile`: where two models part, the error of each site along depth;
- :func:`attention`: an attention pattern as heatmaps, one per head, tokens on the axes;
- :func:`effects`, :func:`lens`: a patching sweep's grid, a logit lens's tokens per layer.
"""

from hookscope._shared.names import public_dir
from hookscope.plots.activations import feature_maps, histograms
from hookscope.plots.attention import attention
from hookscope.plots.depth import layer_stats
from hookscope.plots.diff import diff_profile
from hookscope.plots.grads import grad_flow, grad_history
from hookscope.plots.methods import effects, lens

__all__ = [
    "attention",
    "diff_profile",
    "effects",
    "feature_maps",
    "grad_flow",
    "grad_history",
    "histograms",
    "layer_stats",
    "lens",
]


def __dir__() -> list[str]:
    """``__all__``, the dunders and the modules the plots live in, not the imports."""
    return public_dir(__name__)
