"""What this installation of hookscope runs on: facts ``hookscope info`` prints.

Public so that the command line (which imports only the public API) and bug reports can say
which statistics path computes CPU statistics: the fused C kernel, built with the package where a
C compiler was, or torch reductions where it was not (the same numbers, more passes).

>>> statistics_path().startswith(("fused C kernel", "torch reductions"))
True
"""

from __future__ import annotations

from hookscope._shared.stats import kernel

__all__ = ["statistics_path"]


def statistics_path() -> str:
    """Which path computes statistics of CPU tensors in this process, and why, in one line."""
    return kernel.statistics_path()
