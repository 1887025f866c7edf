"""One module per ``hookscope`` command; :mod:`hookscope.cli.app` registers them in help order."""
