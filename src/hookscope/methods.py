"""The methods researchers run every day, on any model, in one call each.

- **Metrics** score an output with one value per row: :func:`logit_diff`, :func:`logprob`,
  :func:`kl_to`, :func:`loss`, or any function of the output.
- **Patching**: :func:`patch_sweep` patches every site × position (× head) on its own, many
  patches per forward; :func:`attribution_patch` estimates the same grid from one backward and
  flags the cells where the estimate is wrong (``verify=``). Both return :class:`Effects`.
- **Logit lens**: :func:`logit_lens` reads every layer's residual stream through the model's final
  norm and unembedding, and the linear steps the model takes between them and its logits
  (a tuned lens with ``translators=``).
- **The residual stream**: :func:`accumulated_resid`, :func:`decompose_resid` (summing to the
  last ``resid_post``) and :func:`apply_ln`; ``cache.stack(pattern)`` stacks any captured values.

Gradients with respect to captured values are part of capture: ``hs.capture(..., grads=True)``
and ``hs.run_with_capture(..., backward=metric)`` fill ``cache.grad``.

>>> import torch, hookscope as hs
>>> hs.methods.logit_diff(2, 1)(torch.tensor([[[0.0, 2.0, 5.0]]]))
tensor([3.])
"""

from __future__ import annotations

from hookscope import _methods
from hookscope._methods import *  # noqa: F403 (the names of its __all__, listed once there)
from hookscope._shared.names import public_dir

__all__ = _methods.__all__


def __dir__() -> list[str]:
    """``__all__``, the dunders and public submodules, not the imports: what tab completion offers."""
    return public_dir(__name__)
