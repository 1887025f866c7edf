"""Stand-in sweep targets for the runner's tests: each does one plain thing a model type may do
(answer, hang, die), so the runner's limits are tested without building any model."""

from __future__ import annotations

import os
import time
from typing import Any


def answers(model_type: str, options: dict[str, Any], report: Any) -> dict[str, Any]:
    """Reports an entry at once."""
    return {"model_type": model_type, "stages": {"build": {"ok": True, "reason": None}}, "options": options}


def sleeps(model_type: str, options: dict[str, Any], report: Any) -> dict[str, Any]:
    """Reports a first attempt, then hangs far past any limit a test sets."""
    report({"model_type": model_type, "stages": {"build": {"ok": True, "reason": None}}})
    time.sleep(600)
    return {"model_type": model_type}


def dies(model_type: str, options: dict[str, Any], report: Any) -> dict[str, Any]:
    """Exits without a word, as a process killed by the kernel would."""
    os._exit(3)


def allocates(model_type: str, options: dict[str, Any], report: Any) -> dict[str, Any]:
    """Asks for far more memory than the limit a test sets."""
    block = bytearray(4 * 2**30)
    return {"model_type": model_type, "size": len(block)}
