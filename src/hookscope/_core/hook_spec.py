"""What one hook is: :class:`HookSpec`, checked when it is made, before anything attaches.

A spec names the module, the PyTorch hook kind, the function and its flags; a function PyTorch
could not call with that kind's arguments is refused here, with the kind that would fit.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from hookscope._core.names import module_label
from hookscope.errors import SpecError, UnsupportedModelError

__all__ = ["HOOK_KINDS", "HookKind", "HookSpec", "check_kind"]

HookKind = Literal["forward_pre", "forward", "backward_pre", "backward"]
HOOK_KINDS: tuple[str, ...] = get_args(HookKind)
# How PyTorch calls each kind of hook, for the arity check made once at attach time.
_SIGNATURES: dict[tuple[str, bool], str] = {
    ("forward_pre", False): "fn(module, args)",
    ("forward_pre", True): "fn(module, args, kwargs)",
    ("forward", False): "fn(module, args, output)",
    ("forward", True): "fn(module, args, kwargs, output)",
    ("backward_pre", False): "fn(module, grad_output)",
    ("backward", False): "fn(module, grad_input, grad_output)",
}


def check_kind(kind: str) -> HookKind:
    """Return ``kind`` if it names a hook kind, else raise ``SpecError`` with the closest kind."""
    if kind in HOOK_KINDS:
        return kind  # type: ignore[return-value]
    close = difflib.get_close_matches(str(kind), HOOK_KINDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise SpecError(f"hook kind {kind!r} is unknown; expected one of {', '.join(HOOK_KINDS)}{hint}")


@dataclass(frozen=True)
class HookSpec:
    """One hook to attach: which module, which PyTorch hook kind, which function, which flags.

    ``fn`` is called exactly as PyTorch calls that kind of hook (see ``signature``); a value it
    returns replaces the inputs/output/gradients as PyTorch documents.
    """

    name: str
    module: nn.Module
    kind: HookKind
    fn: Callable[..., Any]
    with_kwargs: bool = False
    prepend: bool = False
    always_call: bool = False
    fitted: bool = False  # hookscope's own hooks, written for this kind: skip the signature check

    def __post_init__(self) -> None:
        check_kind(self.kind)
        if self.with_kwargs and self.kind not in ("forward_pre", "forward"):
            raise SpecError(f"with_kwargs=True applies to forward and forward_pre hooks, not {self.kind!r}")
        if self.always_call and self.kind != "forward":
            raise SpecError(f"always_call=True applies to forward hooks only, not {self.kind!r}")
        if not callable(self.fn):
            raise SpecError(
                f"the hook for {module_label(self.name)!r} is a {type(self.fn).__name__}, not callable; "
                f"expected a function called as {self.signature}"
            )
        if isinstance(self.module, torch.jit.ScriptModule):
            raise UnsupportedModelError(
                f"module {module_label(self.name)!r} is a TorchScript {type(self.module).__name__}: "
                "scripted code never runs Python hooks; hook the eager module instead, or pick "
                "modules outside the scripted part"
            )
        if not self.fitted:
            _check_arity(self)

    @property
    def signature(self) -> str:
        """How PyTorch will call ``fn``, e.g. ``fn(module, args, output)``."""
        return _SIGNATURES[(self.kind, self.with_kwargs)]


def _check_arity(spec: HookSpec) -> None:
    """Refuse, at attach time, a function PyTorch could not call with this kind's arguments."""
    try:
        signature = inspect.signature(spec.fn)
    except (TypeError, ValueError):  # builtins and some C callables: nothing to check
        return
    n_args = _arity(spec.signature)
    if _binds(signature, n_args):
        return
    fitting = [
        f"kind={kind!r}" + (", with_kwargs=True" if with_kwargs else "")
        for (kind, with_kwargs), text in _SIGNATURES.items()
        if _arity(text) != n_args and _binds(signature, _arity(text))
    ]
    hint = f"; did you mean {' or '.join(fitting)}?" if fitting else ""
    raise SpecError(
        f"hook {getattr(spec.fn, '__qualname__', spec.fn)!r} for {module_label(spec.name)!r} takes "
        f"{signature}, but a {spec.kind} hook is called as {spec.signature}{hint}"
    )


def _arity(call: str) -> int:
    """How many arguments a call written like ``fn(module, args, output)`` passes."""
    return call.count(",") + 1


def _binds(signature: inspect.Signature, n_args: int) -> bool:
    try:
        signature.bind(*range(n_args))
    except TypeError:
        return False
    return True
