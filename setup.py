"""Builds hookscope's one compiled piece, the fused statistics kernel, where a C compiler is.

Everything else is declared in pyproject.toml. The kernel is plain C loaded with ctypes (no Python or
torch headers), and optional: where it cannot be built the install goes on and statistics are computed
by torch reductions instead (``hookscope._shared.fused.available()`` says which).
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hookscope._shared._fused_stats",
            sources=["src/hookscope/_shared/fused_stats.c"],
            extra_compile_args=["-O3", "-pthread", "-Wno-psabi"],
            extra_link_args=["-pthread"],
            libraries=["dl"] if sys.platform.startswith("linux") else [],  # dlsym, in libc only from glibc 2.34
            optional=True,
        )
    ]
)
