"""``hs.diff``: compare two models or two captures layer by layer and find where they part."""

from hookscope.diffing.api import DiffFunction, diff
from hookscope.diffing.metrics import Metrics
from hookscope.diffing.result import Diff, DiffRow, Divergence, LeafDiff

__all__ = ["Diff", "DiffFunction", "DiffRow", "Divergence", "LeafDiff", "Metrics", "diff"]
