"""Builds hookscope's one compiled piece, the fused statistics kernel, where a C compiler is.

Everything else is declared in pyproject.toml. The kernel (``src/hookscope/_shared/stats/fused_stats.c``)
is plain C loaded with ctypes: it includes no Python or torch header and calls no Python C API, so
it is built as a plain shared library, ``hookscope/_shared/stats/_fused_stats.so`` (no interpreter tag in
its name), and the wheel is tagged ``py3-none-<platform>``: one wheel serves every Python 3 of that
platform. Optional: where it cannot be built (no compiler, ``CC=false``, Windows) the install goes
on without it and statistics are computed by torch reductions instead; ``hookscope info`` and
``hookscope._shared.stats.kernel.available()`` say which path runs.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

KERNEL = "hookscope._shared.stats._fused_stats"


class PlainLibrary(build_ext):
    """Name the kernel ``_fused_stats.so`` (``.dylib`` on macOS), not ``_fused_stats.cpython-3XX-....so``:
    it is not a Python extension module, and its name must not tie it to one interpreter."""

    def get_ext_filename(self, fullname: str) -> str:
        if fullname not in (KERNEL, KERNEL.rsplit(".", 1)[1]):  # asked for by full name and by its last part
            return str(super().get_ext_filename(fullname))
        suffix = ".dylib" if sys.platform == "darwin" else ".dll" if sys.platform == "win32" else ".so"
        return fullname.replace(".", "/") + suffix

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return list(ext.export_symbols)  # no PyInit_ function to export: there is none


class AnyPython(bdist_wheel):
    """Tag the wheel ``py3-none-<platform>``: the platform for the compiled library, any Python 3."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    ext_modules=[
        Extension(
            KERNEL,
            sources=["src/hookscope/_shared/stats/fused_stats.c"],
            extra_compile_args=["-O3", "-Wno-psabi"],
            libraries=["dl"] if sys.platform.startswith("linux") else [],  # dlsym, in libc only from glibc 2.34
            optional=True,
        )
    ],
    cmdclass={"build_ext": PlainLibrary, "bdist_wheel": AnyPython},
)
