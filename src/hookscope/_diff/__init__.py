"""``hs.diff``: compare two models or two captures layer by layer and find where they part."""

from hookscope._diff.api import DiffFunction, diff
from hookscope._diff.metrics import Metrics
from hookscope._diff.result import Diff, DiffRow, Divergence, LeafDiff

__all__ = ["Diff", "DiffFunction", "DiffRow", "Divergence", "LeafDiff", "Metrics", "diff"]
