"""``hs.report``: one self-contained HTML file of what a forward (and backward) pass did."""

from hookscope.reporting.api import report

__all__ = ["report"]
