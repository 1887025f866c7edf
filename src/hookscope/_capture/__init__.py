"""Capture: keep the inputs and outputs of chosen layers, correctly and cheaply, and save them.

``capture()`` / ``run_with_capture()`` (in ``api``) attach a ``Capture`` (``recorder``: the
hooks) with a ``CaptureOptions`` (``options``), ``Cache`` (in
``cache``) holds the values by site, ``guard`` keeps them right under in-place ops, ``reduce``
holds the named on-device reductions and ``files`` the file formats; ``attn_sites`` computes
attention sub-sites from a kernel call (a trace makes rows of them too).
"""

from hookscope._capture.api import capture, run_with_capture
from hookscope._capture.attn_sites import attention_values
from hookscope._capture.cache import Cache, load
from hookscope._capture.options import CaptureOptions
from hookscope._capture.recorder import Capture
from hookscope._capture.stack import Stacked

__all__ = ["Cache", "Capture", "CaptureOptions", "Stacked", "attention_values", "capture", "load", "run_with_capture"]
