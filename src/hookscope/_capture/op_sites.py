"""The op selectors of one capture: which op calls to keep, and the check that each one fired.

A capture given ``"h.0.attn:op[softmax#0]"`` keeps that op's output (and, with ``keep="both"``
or ``"input"``, its tensor arguments) through an :class:`~hookscope._core.ops.OpWatcher` on the
selector's modules; the values go through the capture's own keeper, so reductions, dtype,
device, ``max_bytes``, ``calls`` and the copy-on-write guard apply as to module sites.

An op selector whose module ran in a pass but whose op never did is an error at the end of that
pass, naming the ops the module called: a misspelt op would otherwise match nothing, silently.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from hookscope._core.names import ROOT_LABEL, escape_name, module_label
from hookscope._core.op_sites import OpPattern
from hookscope._core.ops import OpWatcher
from hookscope._core.select import select
from hookscope.errors import CaptureError

__all__ = ["OpKeep", "OpSelectors"]

#: Keeps one op call's values: ``(module, call, op label "softmax#0", args, kwargs, output)``;
#: returns what the model goes on with instead of the output, or None.
OpKeep = Callable[[str, int, str, tuple[Any, ...], dict[str, Any], Any], Any]


class OpSelectors:
    """The op selectors of a capture, the modules they watch, and which of them fired in a pass.

    Args:
        model: the captured model.
        patterns: the op selectors, parsed (:func:`~hookscope._core.op_sites.op_pattern`); a
            module part that names no module is the usual ``SelectionError``, raised here.
    """

    def __init__(self, model: nn.Module, patterns: Sequence[OpPattern]) -> None:
        self.patterns = list(patterns)
        self._per_module: dict[str, list[tuple[int, OpPattern]]] = {}
        self._modules_of: dict[int, list[str]] = {}
        modules: dict[str, nn.Module] = {}
        for number, pattern in enumerate(self.patterns):
            module_selector = "" if pattern.module == ROOT_LABEL else pattern.module  # "(root):op[add]"
            for name, module in select(model, module_selector):
                self._per_module.setdefault(name, []).append((number, pattern))
                self._modules_of.setdefault(number, []).append(name)
                modules.setdefault(name, module)
        #: ``(name, module)`` of every module an op selector watches, in selection order.
        self.modules = list(modules.items())
        self._fired: set[int] = set()  # the patterns that matched an op call, this pass
        self._watcher: OpWatcher | None = None

    def attach(self, model: nn.Module, keep: OpKeep, want: Callable[[int], bool]) -> OpWatcher:
        """Watch the modules' ops, handing each selected op call that ``want`` accepts to ``keep``."""
        self._watcher = OpWatcher(model, self.modules, self._listener(keep, want), owner="capture")
        return self._watcher

    def _listener(self, keep: OpKeep, want: Callable[[int], bool]) -> Any:
        per_module, fired = self._per_module, self._fired

        def listen(
            module: str, call: int, op: str, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            chosen = per_module.get(module)
            if chosen is None or not want(call):
                return None
            watcher = self._watcher
            if watcher is not None and watcher.replaying:
                return None  # a checkpointed block recomputing in backward: its values were kept already
            hit = False
            for number, pattern in chosen:
                if pattern.matches_call(call) and pattern.matches(op, index):
                    fired.add(number)
                    hit = True
            return keep(module, call, f"{op}#{index}", args, kwargs, output) if hit else None

        return listen

    def start(self) -> None:
        """A new pass: nothing has fired yet."""
        self._fired.clear()

    def check(self, calls: dict[str, int], want: Callable[[int], bool]) -> None:
        """At a pass's end: refuse an op selector whose module ran a call it names (``calls``:
        the pass's calls per module; ``want``: the capture's ``calls=``) but whose op never did."""
        for number, pattern in enumerate(self.patterns):
            if number in self._fired:
                continue
            for module in self._modules_of.get(number, []):
                if any(pattern.matches_call(call) and want(call) for call in range(calls.get(module, 0))):
                    raise CaptureError(self._unfired(pattern, module), site=str(pattern))

    def _unfired(self, pattern: OpPattern, module: str) -> str:
        seen = self._watcher.seen.get(module, {}) if self._watcher is not None else {}
        called = ", ".join(f"{op} (x{count})" if count > 1 else op for op, count in list(seen.items())[:20])
        close = difflib.get_close_matches(pattern.op, list(seen), n=3, cutoff=0.5)
        if pattern.op in seen:  # the name ran, the index did not
            hint = f"{pattern.op!r} ran {seen[pattern.op]} time(s) per call: indices 0 to {seen[pattern.op] - 1}"
        elif close:
            hint = "did you mean " + " or ".join(repr(f"{escape_name(module)}:op[{op}]") for op in close) + "?"
        elif seen:
            hint = "hs.layers(model, x, ops=True) lists the op sites"
        else:
            hint = (
                "a module run by torch.compile's generated code calls no torch function one by one: capture the "
                "eager model (the module before torch.compile); hs.layers(model, x, ops=True) lists the op sites"
            )
        return (
            f"op selector {str(pattern)!r} matched no op call of {module_label(module)!r}, which ran and called: "
            f"{called or 'no torch op returning a tensor'}; {hint}"
        )

    def remove(self) -> None:
        """Take the op watcher's hooks off (safe to call twice)."""
        if self._watcher is not None:
            self._watcher.remove()
