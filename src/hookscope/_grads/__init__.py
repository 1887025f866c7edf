"""Gradients: per-call activation gradients and parameter gradients over a training loop.

``monitor`` attaches the hooks and reads each step, ``records`` holds what a step keeps and
its pandas tables, ``summary`` flags vanishing, exploding and non-finite gradients and dead units.
"""

from hookscope._grads.monitor import GradMonitor, watch_grads
from hookscope._grads.records import GradRecord, GradStep
from hookscope._grads.summary import GradFlag, GradSummary

__all__ = ["GradFlag", "GradMonitor", "GradRecord", "GradStep", "GradSummary", "watch_grads"]
