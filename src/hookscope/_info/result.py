"""``Info``: what this installation of hookscope runs on, as fields, as the CLI's text and as HTML."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hookscope._info.packages import INTEGRATIONS, OPTIONAL, Package
from hookscope._shared.tables import Column, Table

__all__ = ["Info"]


@dataclass(frozen=True)
class Info:
    """What this installation runs on: what :func:`hookscope.info` returns.

    ``print()`` it for the text ``hookscope info`` prints (paste it into a bug report); in
    Jupyter it shows as a table. Packages map to their version, or None where not installed.

    Attributes:
        hookscope: hookscope's version.
        python: Python's version.
        torch: torch's version (``torch.__version__``).
        platform: the operating system, machine and C library.
        devices: the CPU threads torch computes with, and the CUDA devices it sees.
        integrations: ``transformers``, ``accelerate``, ``lightning``: version or None.
        extras: the optional packages single features import on first use (``pandas``,
            ``matplotlib``, ``zarr``, ``wandb``, ...): version or None.
        statistics: which path computes statistics of CPU tensors, and why (the fused C kernel
            or torch reductions).
        fused_kernel: True when that path is the fused C kernel.
        memory: how hookscope allocates and keeps memory, one line per policy (``malloc``,
            ``captured values``, ``CUDA to host``, ``statistics threads``).
    """

    hookscope: str
    python: str
    torch: str
    platform: str
    devices: str
    integrations: Mapping[str, str | None]
    extras: Mapping[str, str | None]
    statistics: str
    fused_kernel: bool
    memory: Mapping[str, str]

    def missing(self) -> dict[str, str]:
        """The packages not installed, each with what needs it and the install line."""
        return {
            package.module: f"{package.purpose}: {package.install}"
            for package in (*INTEGRATIONS, *OPTIONAL)
            if self._version(package) is None
        }

    def _version(self, package: Package) -> str | None:
        return {**self.integrations, **self.extras}.get(package.module)

    def __str__(self) -> str:
        missing = self.missing()
        lines = [
            f"hookscope {self.hookscope}",
            f"python {self.python}, torch {self.torch}",
            f"platform: {self.platform}",
            f"devices: {self.devices}",
            f"integrations: {_found(self.integrations)}",
            f"extras: {_found(self.extras)}",
            *([] if not missing else ["not installed:", *(f"  {name} ({why})" for name, why in missing.items())]),
            "memory:",
            *(f"  {what}: {line}" for what, line in self.memory.items()),
            f"statistics: {self.statistics}",
        ]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        table = Table([Column("what"), Column("")], title=f"hookscope {self.hookscope}")
        for what, value in (("python", self.python), ("torch", self.torch), ("platform", self.platform)):
            table.add(what, value)
        table.add("devices", self.devices)
        missing = self.missing()
        for name, version in {**self.integrations, **self.extras}.items():
            table.add(name, version if version is not None else f"not installed ({missing[name]})")
        for what, line in self.memory.items():
            table.add(what, line)
        table.add("statistics", self.statistics)
        return table.html()


def _found(packages: Mapping[str, str | None]) -> str:
    found = [f"{name} {version}" for name, version in packages.items() if version is not None]
    return ", ".join(found) if found else "none found"
