"""``edit()`` and ``run_with_edits()``: change what chosen modules return (or take), scoped.

An edit is any callable ``edit(value, ctx) -> value``; :mod:`hookscope.edits` has the built-ins.
A forward hook (or, with ``on="input"``, a forward pre-hook) replaces the chosen tensor of the
module's output (or inputs) by what the edits return, in the order given. The hooks come off on
leaving the block, also when the forward raised.

An op selector (``"h.0.attn:op[softmax#0]"``, :mod:`~hookscope._core.op_sites`) edits what that
torch call inside the module returns, through the op watcher shared with capture
(:class:`~hookscope._arch.op_selectors.OpSelectors`); an attention sub-site
(``"h.0.attn:attn.pattern"``) edits a value of a ``scaled_dot_product_attention`` call, and the
call's output is computed again from it (:mod:`~hookscope._edit.attention`). Either way the rest
of the forward runs on the edited value. An op selector whose module ran without that op is an
:class:`~hookscope.errors.EditError` at the end of the pass, naming the ops it did call.

Order with other hooks: hooks run in the order they were attached, so a capture attached after
an edit sees the edited value, and one attached before it sees the original.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hookscope._arch.plan import expand_sites, plan_sites
from hookscope._core.attach import HookGroup, HookSpec, Scoped
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import ROOT_LABEL, call_label, module_label, parse_leaf, split_leaf_selector
from hookscope._core.op_sites import SDPA, OpPattern, split_op_label
from hookscope._core.plan import attach_plan
from hookscope._core.select import Selector, describe_selector, ensure_module, select
from hookscope._core.tracker import CallTracker
from hookscope._core.tree import call_leaves, flatten_tensors, map_call_tensors, map_tensors_with_paths
from hookscope._edit.attention import edited_attention
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
        self._handled: BaseException | None = None
        self._tracker = CallTracker(self, feature="edit")
        # Per module and side: the edits with the tensor each asks for (None: the first).
        plan: dict[tuple[int, EditSide], tuple[str, nn.Module, EditSide, list[tuple[EditFn, str | None]]]] = {}
        op_plan: list[tuple[OpPattern, list[EditFn]]] = []
        for selector, chosen in edits.items():
            functions = _functions(selector, chosen)
            sites = expand_sites(model, selector, "write")  # "std:blocks.3.resid_mid" -> its sites
            op_plan += [(_checked_op_edit(pattern, functions, on), functions) for pattern in sites.patterns]
            for target in sites.selectors:
                split = split_leaf_selector(target)
                side: EditSide = on if split is None else "input" if split[1] == "input" else "output"
                targets = _targets(functions, on) if split is None else _at_path(functions, split[2], target)
                for name, module in select(model, target if split is None else split[0]):
                    plan.setdefault((id(module), side), (name, module, side, []))[3].extend(targets)
        self._plan = list(plan.values())
        self._op_patterns = [pattern for pattern, _ in op_plan]
        sites = plan_sites(model, None, "write", owner="edit", error=EditError, patterns=self._op_patterns)
        self._ops = sites.ops
        self._op_targets = [_targets(fns, "output") for _, fns in op_plan]
        self._op_modules = dict(self._ops.modules) if self._ops is not None else {}
        # The applied count of each (op selector, module) pair, by the pair's site text.
        self._op_keys = {
            (number, name): _op_key(pattern, name)
            for number, (pattern, _) in enumerate(op_plan)
            for name in (self._ops.modules_of(number) if self._ops is not None else [])
        }
        # Counted per pass, from 0 each time (so compiled code sees the same values on every
        # pass and is not recompiled), and added to the earlier passes' when the next one starts.
        self._applied = dict.fromkeys((name for name, _, _, _ in self._plan), 0)
        self._forward_calls: dict[str, int] = {}  # calls per module in the last forward pass
        self._applied.update(dict.fromkeys(self._op_keys.values(), 0))
        self._earlier = dict.fromkeys(self._applied, 0)
        self._op_counts = {key: len(op_plan[key[0]][1]) for key in self._op_keys}
        specs = [
            HookSpec(name, module, "forward", self._output_hook(name, targets), with_kwargs=True, fitted=True)
            if side == "output"
            else HookSpec(name, module, "forward_pre", self._input_hook(name, targets), with_kwargs=True, fitted=True)
            for name, module, side, targets in self._plan
        ]
        self._group, self._watcher = attach_plan(
            sites,
            lambda counted: HookGroup(
                model, specs, owner="edit", tracker=self._tracker, count=counted, restore_mode=False
            ),
            lambda ops: ops.attach(
                model, self._edit_op, self._want, self._edit_attention, replays=self._refuse_unplaceable_replay
            ),
            self.remove,  # hs.remove_all(model) takes both groups off
        )

    def _output_hook(self, name: str, targets: list[tuple[EditFn, str | None]]) -> Callable[..., Any]:
        current, want = self._tracker.current, self._want
        applied, tracker, foreign = self._applied, self._tracker, self._tracker.foreign
        refuse = self._refuse_unplaceable_replay

        def edit_output(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if tracker.shared and foreign():
                return None  # another thread's forward: left as it is
            if tracker.replaying:
                refuse(name, call_patterns=False)
            call = current(module)
            if not want(call):
                return None
            leaves = _apply(targets, flatten_tensors(output, ""), name, call, module, "output", args, kwargs)
            if not tracker.replaying:  # a checkpointed block recomputing in backward: edited again, not counted
                applied[name] += 1
            return map_tensors_with_paths(lambda path, tensor: leaves.get(path, tensor), output, "")

        return edit_output

    def _input_hook(self, name: str, targets: list[tuple[EditFn, str | None]]) -> Callable[..., Any]:
        current, want = self._tracker.current, self._want
        applied, tracker, foreign = self._applied, self._tracker, self._tracker.foreign
        refuse = self._refuse_unplaceable_replay

        def edit_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if tracker.shared and foreign():
                return None
            if tracker.replaying:
                refuse(name, call_patterns=False)
            call = current(module)
            if not want(call):
                return None
            leaves = _apply(targets, call_leaves(args, kwargs), name, call, module, "input", args, kwargs)
            if not tracker.replaying:
                applied[name] += 1
            return map_call_tensors(lambda path, tensor: leaves.get(path, tensor), args, kwargs)

        return edit_input

    def _edit_op(
        self, name: str, call: int, label: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Edit what one selected op call returned (told by the op watcher, after the op ran)."""
        op, index = split_op_label(label)
        numbers = [n for n in self._matching(name, call, op, index) if not self._op_patterns[n].sub]
        targets = [target for number in numbers for target in self._op_targets[number]]
        found = flatten_tensors(output, "")
        leaves = _apply(targets, found, name, call, self._op_modules[name], "output", args, kwargs, op=label)
        self._count_ops(numbers, name)
        return map_tensors_with_paths(lambda path, tensor: leaves.get(path, tensor), output, "")

    def _edit_attention(self, name: str, call: int, index: int, kinds: list[str], *told: Any) -> Any:
        """Edit the attention sub-sites asked for of the ``index``-th ``scaled_dot_product_attention``
        call (``told``: its args, kwargs and output), and return what the call gives with them
        (:func:`~hookscope._edit.attention.edited_attention`)."""
        args, kwargs, output = told
        numbers = [n for n in self._matching(name, call, SDPA, index) if self._op_patterns[n].sub]
        module = self._op_modules[name]

        def apply(kind: str, value: torch.Tensor) -> torch.Tensor:
            targets = [t for n in numbers if self._op_patterns[n].sub == kind for t in self._op_targets[n]]
            op = f"attn.{kind}#{index}"
            return _apply(targets, [("", value)], name, call, module, "output", args, kwargs, op=op)[""]

        if not isinstance(output, torch.Tensor):
            raise EditError(f"{call_label(name, call)}: {SDPA} returned a {type(output).__name__}, expected a tensor")
        counts = self._ops.head_counts(name) if self._ops is not None else None
        edited = edited_attention(kinds, apply, args, kwargs, output, call_label(name, call), counts)
        self._count_ops(numbers, name)
        return edited

    def _matching(self, name: str, call: int, op: str, index: int) -> list[int]:
        return self._ops.matching(name, call, op, index) if self._ops is not None else []

    def _refuse_unplaceable_replay(self, name: str, *, call_patterns: bool = True) -> None:
        """In a checkpointed block's recomputation in backward, calls are numbered within the
        recomputation: a module called several times in the forward cannot be told which call
        it repeats, so an edit of some of its calls would apply to the wrong one (and the
        gradients be silently wrong). Refused then; editing every call stays exact."""
        chooses = self.options.calls != "all" or (
            call_patterns and any(pattern.call is not None for pattern in self._op_patterns)
        )
        if chooses and self._forward_calls.get(name, 0) > 1:
            raise EditError(
                f"{module_label(name)!r} runs {self._forward_calls[name]} times in the forward and is recomputed by "
                "a checkpointed block in backward, where hookscope cannot tell which of its calls is being "
                "recomputed: an edit of some of its calls (calls=, or '#1' in a selector) would apply to the wrong "
                "one; edit every call, or run without gradient checkpointing"
            )

    def _count_ops(self, numbers: list[int], name: str) -> None:
        if self._watcher is not None and self._watcher.replaying:
            return  # a checkpointed block recomputing in backward: edited again, not counted
        for number in numbers:
            self._applied[self._op_keys[number, name]] += 1

    @property
    def sites(self) -> list[str]:
        """The modules edited, in model order, with how many edits each; then the op sites
        (``h.0.attn:op[softmax#0] (1 edit)``), one per op selector and module it selects."""
        counted = [
            (module_label(name) if side == self._side else f"{module_label(name)}:{side}", len(targets))
            for name, _, side, targets in self._plan
        ]
        counted += [(key, self._op_counts[pair]) for pair, key in self._op_keys.items()]
        return [f"{site} ({count} edit{'s' if count != 1 else ''})" for site, count in counted]

    @property
    def applied(self) -> dict[str, int]:
        """How many calls of each edited module were edited since attaching, in model order;
        then, per op selector and module (``"h.0.attn:op[softmax#*]"``), how many op calls.

        A module at 0 was selected but never ran (or ran only in calls ``calls=`` left out):
        the edit changed nothing there.
        """
        shown = {name: module_label(name) for name, _, _, _ in self._plan}
        return {shown.get(key, key): self._earlier[key] + count for key, count in self._applied.items()}

    def remove(self) -> None:
        """Remove every hook of this editor (the op watcher's too). Safe to call twice."""
        try:
            if self._ops is not None:
                self._ops.remove()
        finally:
            self._group.remove()

    # -- told by the call tracker -------------------------------------------------------------------

    #: Edits apply inside ``nn.DataParallel`` replicas too, as plain hooks would.
    accepts_replicas = True

    def pass_started(self, module: nn.Module) -> None:
        if self._tracker.replaying:
            return  # a recomputation in backward is no new pass
        for name, count in self._applied.items():
            self._earlier[name] += count
            self._applied[name] = 0
        self._handled = sys.exc_info()[1]  # an exception already being handled when the pass began
        if self._ops is not None:
            self._ops.start()

    def pass_ended(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Refuse an op selector that matched nothing in a pass its module ran (not one that raised)."""
        if not self._tracker.replaying:
            self._forward_calls = self._tracker.counts()
        if self._ops is not None and not self._tracker.replaying and sys.exc_info()[1] is self._handled:
            self._ops.check(self._tracker.counts(), self._want)

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


def _at_path(functions: list[EditFn], path: str, selector: str) -> list[tuple[EditFn, str | None]]:
    """The edits of a leaf selector (``"h.0:output[0]"``), each at the selector's tensor; an edit
    naming a path of its own as well is refused (two answers to one question)."""
    for fn in functions:
        if getattr(fn, "path", None) is not None:
            raise SpecError(
                f"{selector!r} names its tensor, and the edit {fn!r} names path={fn.path!r} too "  # type: ignore[attr-defined]
                "(one place to say it): select the module alone, or leave path= out"
            )
    return [(fn, path or None) for fn in functions]


def _apply(
    targets: list[tuple[EditFn, str | None]],
    found: list[tuple[str, torch.Tensor]],
    name: str,
    call: int,
    module: nn.Module,
    side: EditSide,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    op: str = "",
) -> dict[str, torch.Tensor]:
    """Run the edits in order on the call's tensors (``{path: tensor}``, edited ones replaced),
    checking that each result can take the original's place; ``op``: an op site's op."""
    leaves = dict(found)
    if not leaves:
        raise EditError(
            f"{EditContext(name, call, module, side, '', args, kwargs, op).site}: there is no tensor to edit"
        )
    first = found[0][0]
    for fn, wanted in targets:
        path = first if wanted is None else wanted
        ctx = EditContext(name, call, module, side, path, args, kwargs, op)
        old = leaves.get(path)
        if old is None:
            shown = ", ".join(dataclasses.replace(ctx, path=found_path).label for found_path in leaves)
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


def _checked_op_edit(pattern: OpPattern, functions: list[EditFn], on: EditSide) -> OpPattern:
    """Refuse, when the edit is attached, what an op site cannot take: ``on="input"``, and a
    ``path=`` inside an attention sub-site (one tensor)."""
    if on == "input":
        raise SpecError(
            f"on='input' edits what a module takes, and {str(pattern)!r} is an op selector: an op's value is "
            "edited once the op has run (its output); leave on='output' for the op sites, and edit an op's "
            "argument where it is made (the op or module that returned it) in an edit of its own with on='input'"
        )
    if pattern.sub and any(getattr(fn, "path", None) is not None for fn in functions):
        raise SpecError(
            f"{str(pattern)!r} is one tensor, an attention sub-site: its edits take no path=; leave path out"
        )
    return pattern


def _op_key(pattern: OpPattern, name: str) -> str:
    """The site text of an op selector on one module it selects: ``h.0.attn:op[softmax#*]``."""
    return str(dataclasses.replace(pattern, module=name or ROOT_LABEL))


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

    A selector may be an op site or an attention sub-site (see the module docstring):
    ``"h.0.attn:op[softmax#0]"``, ``"h.*:op[add#0]"``, ``"h.0.attn:attn.pattern"``,
    ``"h.0.attn:attn.z"`` (``hs.edits.zero(heads=3)`` ablates head 3 there); module and op
    selectors mix in one mapping, and ``applied`` counts op calls per selector and module.

    Example::

        with hs.edit(model, {"layer3": hs.edits.zero(channels=[1, 2]), "fc": my_fn}) as editor:
            model(x)
        editor.applied                  # {'layer3': 1, 'fc': 1}

    A residual sum inside a module's own code, halved:

    >>> import torch, hookscope as hs
    >>> class Block(nn.Module):
    ...     def forward(self, x):
    ...         return x + x.relu()
    >>> model = nn.Sequential(Block())
    >>> with hs.edit(model, {"0:op[add#0]": hs.edits.scale(0.5)}) as editor:
    ...     out = model(torch.ones(1, 2))
    >>> out, editor.applied
    (tensor([[1., 1.]]), {'0:op[add#0]': 1})
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
    ensure_loaded(model, (args, kwargs, model_kwargs))  # a meta model: one line, not torch's error
    chosen, model_kw = EditOptions.split(kwargs)
    with Editor(model, edits, EditOptions.build(options, chosen)) as editor:
        output = model(*args, **{**model_kw, **(model_kwargs or {})})
    return output, editor
