"""``hs.info()``: what this installation of hookscope runs on, for ``hookscope info`` and bug reports.

``packages`` holds the optional packages and how each is found (without importing it),
``memory`` reads the allocation policies from the modules that own them, ``result`` is the
:class:`Info` they fill.
"""

from __future__ import annotations

import platform
import sys
from types import MappingProxyType

import torch

from hookscope._info.memory import memory_policy
from hookscope._info.packages import INTEGRATIONS, OPTIONAL
from hookscope._info.result import Info
from hookscope._shared.stats import kernel
from hookscope._version import __version__

__all__ = ["Info", "info", "statistics_path"]


def statistics_path() -> str:
    """Which path computes statistics of CPU tensors in this process, and why, in one line.

    >>> statistics_path().startswith(("fused C kernel", "torch reductions"))
    True
    """
    return kernel.statistics_path()


def info() -> Info:
    """What this installation runs on: versions, optional packages, memory policy, statistics path.

    The same facts ``hookscope info`` prints; ``print(hs.info())`` gives its text, for a bug
    report. Optional packages are found without being imported (see :class:`Info`), so this
    takes milliseconds.

    >>> import hookscope as hs, torch
    >>> found = hs.info()
    >>> found.torch == torch.__version__, str(found).splitlines()[-1] == "statistics: " + found.statistics
    (True, True)
    """
    return Info(
        hookscope=__version__,
        python=platform.python_version(),
        torch=torch.__version__,
        platform=_platform(),
        devices=_devices(),
        integrations=MappingProxyType({package.module: package.found() for package in INTEGRATIONS}),
        extras=MappingProxyType({package.module: package.found() for package in OPTIONAL}),
        statistics=kernel.statistics_path(),
        fused_kernel=kernel.enabled(),
        memory=MappingProxyType(memory_policy()),
    )


def _platform() -> str:
    libc, version = platform.libc_ver()
    runs_on = f"{platform.system() or sys.platform} {platform.machine()}".strip()
    return f"{runs_on} ({libc} {version})" if libc else runs_on


def _devices() -> str:
    cpu = f"CPU, torch on {torch.get_num_threads()} threads"
    if not torch.cuda.is_available():
        return f"{cpu}; CUDA: not available"
    count = torch.cuda.device_count()
    return f"{cpu}; CUDA {torch.version.cuda}: {count} device{'s' if count != 1 else ''}"
