"""``edit()`` and ``run_with_edits()``: change what chosen modules return (or take), scoped.

An edit is any callable ``edit(value, ctx) -> value``; :mod:`hookscope.edits` has the built-ins.
A forward hook (or, with ``on="input"``, a forward pre-hook) replaces the chosen tensor of the
module's output (or inputs) by what the edits return, in the order given. The hooks come off on
leaving the block, also when the forward raised.

Order with other hooks: hooks run in the order they were attached, so a capture attached after
an edit sees the edited value, and one attached before it sees the original.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from hookscope.core.attach import HookGroup, HookSpec, Scoped
from hookscope.core.select import Selector, describe_selector, ensure_module, select
from hookscope.core.sites import CallTracker
from hookscope.core.tree import call_leaves, flatten_tensors, map_call_tensors, map_tensors_with_paths
from hookscope.editing.context import EditContext, EditSide
from hookscope.errors import EditError, SpecError

__all__ = ["EditFn", "Editor", "edit", "run_with_edits"]

EditFn = Callable[[torch.Tensor, EditContext], torch.Tensor]
Calls = Literal["all"] | int | Sequence[int]


class Editor(Scoped):
    """Edit hooks attached to a model; made by :func:`edit`, removed on leaving ``with``."""

    def __init__(
        self,
        model: nn.Module,
        edits: Mapping[Selector, EditFn | Sequence[EditFn]],
        *,
        on: EditSide,
        calls: Calls,
    ) -> None:
        ensure_module(model)
        if on not in ("output", "input"):
            raise SpecError(f"on={on!r} is not 'output' (default) or 'input'")
        if not isinstance(edits, Mapping) or not edits:
            raise SpecError(
                "edits: expected a non-empty mapping {selector: edit or [edits]}, e.g. {'fc': hs.edits.zero()}"
            )
        self._want = _call_filter(calls)
        self._side: EditSide = on
        self._tracker = CallTracker()
        plan: dict[int, tuple[str, nn.Module, list[EditFn]]] = {}
        for selector, chosen in edits.items():
            functions = _functions(selector, chosen)
            for name, module in select(model, selector):
                plan.setdefault(id(module), (name, module, []))[2].extend(functions)
        self._plan = list(plan.values())
        specs = [
            HookSpec(name, module, "forward", self._output_hook(name, fns), with_kwargs=True, fitted=True)
            if on == "output"
            else HookSpec(name, module, "forward_pre", self._input_hook(name, fns), with_kwargs=True, fitted=True)
            for name, module, fns in self._plan
        ]
        self._group = HookGroup(model, specs, owner="edit", tracker=self._tracker, restore_mode=False)

    def _output_hook(self, name: str, fns: list[EditFn]) -> Callable[..., Any]:
        current, want = self._tracker.current, self._want

        def edit_output(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            call = current(module)
            if not want(call):
                return None

            def context(path: str) -> EditContext:
                return EditContext(name, call, module, "output", path, args, kwargs)

            for fn in fns:
                path, new = _run(fn, flatten_tensors(output), context)
                output = map_tensors_with_paths(_swap(path, new), output)
            return output

        return edit_output

    def _input_hook(self, name: str, fns: list[EditFn]) -> Callable[..., Any]:
        current, want = self._tracker.current, self._want

        def edit_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            call = current(module)
            if not want(call):
                return None

            def context(path: str) -> EditContext:
                return EditContext(name, call, module, "input", path, args, kwargs)

            for fn in fns:
                path, new = _run(fn, call_leaves(args, kwargs), context)
                args, kwargs = map_call_tensors(_swap(path, new), args, kwargs)
            return args, kwargs

        return edit_input

    @property
    def sites(self) -> list[str]:
        """The modules edited, in model order, with how many edits each."""
        return [f"{name or '(root)'} ({len(fns)} edit{'s' if len(fns) != 1 else ''})" for name, _, fns in self._plan]

    def __repr__(self) -> str:
        state = "live" if self.live else "removed"
        return f"<Editor on {self._side}s of {', '.join(self.sites)}; {state}>"


def _run(
    fn: EditFn, leaves: list[tuple[str, torch.Tensor]], context: Callable[[str], EditContext]
) -> tuple[str, torch.Tensor]:
    """Apply one edit to its tensor; check that what comes back can take the original's place."""
    if not leaves:
        raise EditError(f"{context('').site}: there is no tensor to edit")
    by_path = dict(leaves)
    wanted = getattr(fn, "path", None)
    if wanted is not None and wanted.startswith("input") and not leaves[0][0].startswith("output"):
        wanted = wanted.removeprefix("input")  # the input side's paths are [0], ['mask'], as errors show
    path = leaves[0][0] if wanted is None else wanted
    if path not in by_path:
        raise EditError(f"{context(path).site}: no tensor at {path!r}; the tensors are at {', '.join(by_path)}")
    old = by_path[path]
    ctx = context(path)
    new = fn(old, ctx)
    if not isinstance(new, torch.Tensor):
        raise EditError(
            f"{ctx.site}: the edit returned a {type(new).__name__}, expected a tensor like {_describe(old)}"
        )
    if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
        raise EditError(
            f"{ctx.site}: the edit returned {_describe(new)}, expected {_describe(old)} (the value it replaces)"
        )
    return path, new


def _swap(path: str, new: torch.Tensor) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A tree-map function putting ``new`` at ``path`` and keeping every other tensor."""
    return lambda at, tensor: new if at == path else tensor


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device}"


def _functions(selector: Selector, chosen: EditFn | Sequence[EditFn]) -> list[EditFn]:
    functions = list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]
    if not functions or not all(callable(fn) for fn in functions):
        raise SpecError(
            f"the edits for {describe_selector(selector)} are not callables: expected an edit such as "
            "hs.edits.zero() or a function (value, ctx) -> value, or a list of them"
        )
    return functions  # type: ignore[return-value]


def _call_filter(calls: Calls) -> Callable[[int], bool]:
    if calls == "all":
        return lambda index: True
    if isinstance(calls, int) and not isinstance(calls, bool) and calls >= 0:
        return lambda index: index == calls
    if isinstance(calls, (list, tuple, set)) and calls and all(isinstance(c, int) and c >= 0 for c in calls):
        chosen = set(calls)
        return lambda index: index in chosen
    raise SpecError(f"calls={calls!r} is not 'all' (default), a call index >= 0, or a list of them")


def edit(
    model: nn.Module,
    edits: Mapping[Selector, EditFn | Sequence[EditFn]],
    *,
    on: EditSide = "output",
    calls: Calls = "all",
) -> Editor:
    """Change what the chosen modules return (``on="input"``: what they take) while the block runs.

    ``edits`` maps a selector to an edit or a list of edits, applied in the order given; an
    edit is a built-in from :mod:`hookscope.edits` or any ``fn(value, ctx) -> value`` (``ctx``
    is an :class:`EditContext`: site name, call index, module, inputs). ``calls`` picks which
    calls of a module called several times are edited. An edit must return a tensor of the
    same shape, dtype and device, else :class:`~hookscope.errors.EditError` names the site.

    Example::

        with hs.edit(model, {"layer3": hs.edits.zero(channels=[1, 2]), "fc": my_fn}):
            model(x)
    """
    return Editor(model, edits, on=on, calls=calls)


def run_with_edits(
    model: nn.Module,
    *args: Any,
    edits: Mapping[Selector, EditFn | Sequence[EditFn]],
    on: EditSide = "output",
    calls: Calls = "all",
    model_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``model(*args, **kwargs)`` once with ``edits`` (see :func:`edit`) and return its output.

    >>> import torch, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Identity())
    >>> out = hs.run_with_edits(model, torch.ones(1, 2), edits={"1": hs.edits.scale(0.0)})
    >>> out.abs().sum().item()
    0.0
    """
    with edit(model, edits, on=on, calls=calls):
        return model(*args, **{**kwargs, **(model_kwargs or {})})
