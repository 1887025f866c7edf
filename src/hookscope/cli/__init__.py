"""The ``hookscope`` command line. Imported only by the console script, never by ``import hookscope``."""

from hookscope.cli.app import main

__all__ = ["main"]
