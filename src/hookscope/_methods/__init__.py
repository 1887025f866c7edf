"""Methods: the studies researchers run on top of captures and edits (patching sweeps, attribution
patching, the logit lens, residual stream algebra), each one call, batched where it can be.

``metrics`` scores an output per row; ``runs`` holds a study's inputs and sites; ``sweep`` the
exact patching sweep and ``attribution`` its first-order estimate; ``result`` the labelled grid
both return; ``resid`` the residual stream stacked and normalised; ``lens`` the logit lens and
``readout`` what a model does between its final norm and its logits.
"""

from hookscope._capture import Stacked
from hookscope._methods.attribution import attribution_patch
from hookscope._methods.lens import Lens, logit_lens
from hookscope._methods.metrics import Metric, kl_to, logit_diff, logprob, loss
from hookscope._methods.resid import accumulated_resid, apply_ln, decompose_resid
from hookscope._methods.result import Disagreement, Effects
from hookscope._methods.sweep import patch_sweep

__all__ = [
    "Disagreement",
    "Effects",
    "Lens",
    "Metric",
    "Stacked",
    "accumulated_resid",
    "apply_ln",
    "attribution_patch",
    "decompose_resid",
    "kl_to",
    "logit_diff",
    "logit_lens",
    "logprob",
    "loss",
    "patch_sweep",
]
