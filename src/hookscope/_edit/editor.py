"""``edit()`` and ``run_with_edits()``: change what chosen modules return (or take), scoped.

An edit is any callable ``edit(value, ctx) -> value``; :mod:`hookscope.edits` has the built-ins.
A forward hook (or, with ``on="input"``, a forward pre-hook) replaces the chosen tensor of the
module's output (or inputs) by what the edits return, in the order given. The hooks come off on
leaving the block, also when the forward raised.

Order with other hooks: hooks run in the order they were attached, so a capture attached after
an edit sees the edited value, and one attached before it sees the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hookscope._core.attach import HookGroup, HookSpec, Scoped
from hookscope._core.names import leaf_label, module_label, parse_leaf
from hookscope._core.select import Selector, describe_selector, ensure_module, select
from hookscope._core.sites import CallTracker
from hookscope._core.tree import call_leaves, flatten_tensors, map_call_tensors, map_tensors_with_paths
from hookscope._edit.context import EditContext, EditSide
from hookscope._edit.options import EditOptions
from hookscope._shared.dtypes import dtype_name
from hookscope._shared.options import with_options
from hookscope.errors import EditError, SpecError

__all__ = ["EditFn", "Editor", "edit", "run_with_edits"]

EditFn = Callable[[torch.Tensor, EditContext], torch.Tensor]


class Editor(Scoped):
    """Edit hooks attached to a model; made by :func:`edit`, removed on leaving ``with``.

    Edits change the forwards of the thread that attached them (with their ``nn.DataParallel``
    replicas, and a checkpointed block recomputing in their backward); a forward of the same
    model on another thread runs unedited.
    """

    def __init__(
        self,
        model: nn.Module,
        edits: Mapping[Selector, EditFn | Sequence[EditFn]],
        options: EditOptions | None = None,
        **opts: Any,
    ) -> None:
        ensure_module(model)
        options = EditOptions.build(options, opts)
        if not isinstance(edits, Mapping) or not edits:
            raise SpecError(
                "edits: expected a non-empty mapping {selector: edit or [edits]}, e.g. {'fc': hs.edits.zero()}"
            )
        self.options = options
        on = options.on
        self._want = options.wants
        self._side: EditSide = on
        self._tracker = CallTracker(self, feature="edit")
        plan: dict[int, tuple[str, nn.Module, list[EditFn]]] = {}
        for selector, chosen in edits.items():
            functions = _functions(selector, chosen)
            for name, module in select(model, selector):
                plan.setdefault(id(module), (name, module, []))[2].extend(functions)
        self._plan = list(plan.values())
        # Counted per pass, from 0 each time (so compiled code sees the same values on every
        # pass and is not recompiled), and added to the earlier passes' when the next one starts.
        self._applied = dict.fromkeys((name for name, _, _ in self._plan), 0)
        self._earlier = dict.fromkeys(self._applied, 0)
        specs = [
            HookSpec(name, module, "forward", self._output_hook(name, fns), with_kwargs=True, fitted=True)
            if on == "output"
            else HookSpec(name, module, "forward_pre", self._input_hook(name, fns), with_kwargs=True, fitted=True)
            for name, module, fns in self._plan
        ]
        self._group = HookGroup(model, specs, owner="edit", tracker=self._tracker, restore_mode=False)

    def _output_hook(self, name: str, fns: list[EditFn]) -> Callable[..., Any]:
        current, want, targets = self._tracker.current, self._want, _targets(fns, "output")
        applied, tracker, foreign = self._applied, self._tracker, self._tracker.foreign

        def edit_output(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if tracker.shared and foreign():
                return None  # another thread's forward: left as it is
            call = current(module)
            if not want(call):
                return None
            leaves = _apply(targets, flatten_tensors(output, ""), name, call, module, "output", args, kwargs)
            if not tracker.replaying:  # a checkpointed block recomputing in backward: edited again, not counted
                applied[name] += 1
            return map_tensors_with_paths(lambda path, tensor: leaves.get(path, tensor), output, "")

        return edit_output

    def _input_hook(self, name: str, fns: list[EditFn]) -> Callable[..., Any]:
        current, want, targets = self._tracker.current, self._want, _targets(fns, "input")
        applied, tracker, foreign = self._applied, self._tracker, self._tracker.foreign

        def edit_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if tracker.shared and foreign():
                return None
            call = current(module)
            if not want(call):
                return None
            leaves = _apply(targets, call_leaves(args, kwargs), name, call, module, "input", args, kwargs)
            if not tracker.replaying:
                applied[name] += 1
            return map_call_tensors(lambda path, tensor: leaves.get(path, tensor), args, kwargs)

        return edit_input

    @property
    def sites(self) -> list[str]:
        """The modules edited, in model order, with how many edits each."""
        return [f"{module_label(name)} ({len(fns)} edit{'s' if len(fns) != 1 else ''})" for name, _, fns in self._plan]

    @property
    def applied(self) -> dict[str, int]:
        """How many calls of each edited module were edited since attaching, in model order.

        A module at 0 was selected but never ran (or ran only in calls ``calls=`` left out):
        the edit changed nothing there.
        """
        return {module_label(name): self._earlier[name] + count for name, count in self._applied.items()}

    # -- told by the call tracker -------------------------------------------------------------------

    #: Edits apply inside ``nn.DataParallel`` replicas too, as plain hooks would.
    accepts_replicas = True

    def pass_started(self, module: nn.Module) -> None:
        for name, count in self._applied.items():
            self._earlier[name] += count
            self._applied[name] = 0

    def pass_ended(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        pass

    def pass_abandoned(self) -> None:
        pass

    def __repr__(self) -> str:
        state = "live" if self.live else "removed"
        return f"<Editor on {self._side}s of {', '.join(self.sites)}; {state}>"


def _targets(fns: list[EditFn], side: EditSide) -> list[tuple[EditFn, str | None]]:
    """Each edit with the path it asks for relative to ``side``, read once at attach time (None:
    the first tensor). A path may be written in full, as errors show it (``output[0]``,
    ``input['mask']``), or relative to the side edited (``[0]``); one of the other side is refused.
    """
    other = "what the module takes, pass on='input'" if side == "output" else "what it returns, leave on='output'"
    targets = []
    for fn in fns:
        wanted = getattr(fn, "path", None)
        if wanted is not None:
            wanted = parse_leaf(wanted, side, shown=f"path={wanted!r}", hint=f"; to edit {other}")
        targets.append((fn, wanted))
    return targets


def _apply(
    targets: list[tuple[EditFn, str | None]],
    found: list[tuple[str, torch.Tensor]],
    name: str,
    call: int,
    module: nn.Module,
    side: EditSide,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """Run the edits in order on the call's tensors (``{path: tensor}``, edited ones replaced),
    checking that each result can take the original's place."""
    leaves = dict(found)
    if not leaves:
        raise EditError(f"{EditContext(name, call, module, side, '', args, kwargs).site}: there is no tensor to edit")
    first = found[0][0]
    for fn, wanted in targets:
        path = first if wanted is None else wanted
        ctx = EditContext(name, call, module, side, path, args, kwargs)
        old = leaves.get(path)
        if old is None:
            shown = ", ".join(leaf_label(side, found_path) for found_path in leaves)
            raise EditError(f"{ctx.site}: no tensor at {ctx.label!r}; the tensors are at {shown}")
        new = fn(old, ctx)
        if not isinstance(new, torch.Tensor):
            raise EditError(
                f"{ctx.site}: the edit returned a {type(new).__name__}, expected a tensor like {_describe(old)}"
            )
        if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
            raise EditError(
                f"{ctx.site}: the edit returned {_describe(new)}, expected {_describe(old)} (the value it replaces)"
            )
        leaves[path] = new
    return leaves


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)} {dtype_name(tensor.dtype)} on {tensor.device}"


def _functions(selector: Selector, chosen: EditFn | Sequence[EditFn]) -> list[EditFn]:
    functions: list[Any] = list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]
    if not functions or not all(callable(fn) for fn in functions):
        raise SpecError(
            f"the edits for {describe_selector(selector)} are not callables: expected an edit such as "
            "hs.edits.zero() or a function (value, ctx) -> value, or a list of them"
        )
    for fn in functions:
        _check_arity(selector, fn)
    return functions


def _check_arity(selector: Selector, fn: Callable[..., Any]) -> None:
    """Refuse, when the edit is attached, a function the hook could not call as ``fn(value, ctx)``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables: nothing to check
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise SpecError(
            f"edit {name!r} for {describe_selector(selector)} takes {signature}, but an edit is called as "
            "edit(value, ctx); take both, e.g. lambda value, ctx: value * 2"
        ) from None


@with_options(EditOptions)
def edit(
    model: nn.Module,
    edits: Mapping[Selector, EditFn | Sequence[EditFn]],
    *,
    options: EditOptions | None = None,
    **opts: Any,
) -> Editor:
    """Change what the chosen modules return (``on="input"``: what they take) while the block runs.

    ``edits`` maps a selector (the modules to edit) to an edit or a list of edits, applied in
    the order given; an edit is a built-in from :mod:`hookscope.edits` or any
    ``fn(value, ctx) -> value`` (``ctx`` is an :class:`EditContext`: site name, call index,
    module, inputs). The options are :class:`EditOptions`': ``on`` and ``calls`` (which calls of
    a module called several times are edited). An edit must return a tensor of the same shape,
    dtype and device, else :class:`~hookscope.errors.EditError` names the site.
    ``editor.applied`` counts the calls edited per module, so an edit that never ran shows.

    Example::

        with hs.edit(model, {"layer3": hs.edits.zero(channels=[1, 2]), "fc": my_fn}) as editor:
            model(x)
        editor.applied                  # {'layer3': 1, 'fc': 1}
    """
    return Editor(model, edits, EditOptions.build(options, opts))


@with_options(EditOptions, keep=("model_kwargs",))
def run_with_edits(
    model: nn.Module,
    *args: Any,
    edits: Mapping[Selector, EditFn | Sequence[EditFn]],
    options: EditOptions | None = None,
    model_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Any, Editor]:
    """Run ``model(*args, **kwargs)`` once with ``edits`` (see :func:`edit`); return ``(output, editor)``.

    The editor is removed when this returns; ``editor.applied`` says how many calls of each
    module were edited. Keyword arguments that are not options go to the model.

    >>> import torch, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Identity())
    >>> out, editor = hs.run_with_edits(model, torch.ones(1, 2), edits={"1": hs.edits.scale(0.0)})
    >>> out.abs().sum().item(), editor.applied
    (0.0, {'1': 1})
    """
    chosen, model_kw = EditOptions.split(kwargs)
    with Editor(model, edits, EditOptions.build(options, chosen)) as editor:
        output = model(*args, **{**model_kw, **(model_kwargs or {})})
    return output, editor
