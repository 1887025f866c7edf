"""Verify: every feature of hookscope checked on the user's model against references made without
it (raw hooks, ``torch.autograd``, float64, an eager twin), rated SUPPORTED / REFUSED /
SILENTLY_WRONG / ERROR.

``reference`` records what the model does with plain PyTorch; one module per feature holds its
checks; ``api`` runs them in order and ``report`` holds the rows.
"""

from hookscope._verify.api import CHECKS, verify
from hookscope._verify.report import STATUSES, Status, VerifyReport, VerifyRow

__all__ = ["CHECKS", "STATUSES", "Status", "VerifyReport", "VerifyRow", "verify"]
