"""``hs.report``: one self-contained HTML file of what a forward (and backward) pass did."""

from hookscope._report.api import report

__all__ = ["report"]
