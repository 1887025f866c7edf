"""Errors raised by hookscope.

Every error derives from :class:`HookscopeError` and from the builtin exception it resembles, so
``except LookupError`` catches a selector that matched nothing just as ``except HookscopeError``
does::

    HookscopeError (Exception)
    ├── SelectionError (LookupError)       a selector matched no module
    ├── SpecError (ValueError)             an argument has the wrong form: an unknown hook kind,
    │                                      a hook that is not callable, an unusable selector
    └── UnsupportedModelError (TypeError)  the object is not an eager ``torch.nn.Module``
                                           (a TorchScript module, a list, a function, ...)

A message says what happened, what was expected, and how to fix it, in one line: the command
line prints exactly that line.
"""

from __future__ import annotations

__all__ = ["HookscopeError", "SelectionError", "SpecError", "UnsupportedModelError"]


class HookscopeError(Exception):
    """Base class of every error hookscope raises on purpose."""


class SelectionError(HookscopeError, LookupError):
    """A selector matched none of the model's modules.

    The message names the closest existing names, e.g. ``selector 'blocks.*.mpl' matched 0 of 143
    modules; did you mean 'blocks.*.mlp'?``.
    """


class SpecError(HookscopeError, ValueError):
    """An argument was understood but has the wrong form (unknown kind, not callable, ...)."""


class UnsupportedModelError(HookscopeError, TypeError):
    """The model is not something hooks can be attached to (not an eager ``nn.Module``)."""
