"""``hs.diff``: run two models on the same inputs (or take two captures) and compare them site by site."""

from __future__ import annotations

import contextlib
import copy
import gc
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hookscope._arch.std import known_std_map, select_std
from hookscope._capture import Cache, capture
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import call_label, unwrapped_modules
from hookscope._core.select import Selector, ensure_module
from hookscope._core.tree import map_tensors
from hookscope._diff.matching import Match, name_pairs
from hookscope._diff.metrics import read_metrics
from hookscope._diff.recorder import CallDraft, Comparer, Kept, LeafDraft, Reference, compare_leaves
from hookscope._diff.result import Diff, DiffRow, LeafDiff
from hookscope._shared.dtypes import dtype_name, parse_device
from hookscope._shared.tolerances import model_dtypes, tolerances
from hookscope._shared.units import counted
from hookscope.errors import PairingWarning, SpecError

__all__ = ["DiffFunction", "cast_floats", "compare_caches", "compare_models", "diff"]
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def compare_models(
    a: nn.Module,
    b: nn.Module,
    inputs_a: Inputs,
    inputs_b: Inputs,
    *,
    match: Match,
    layers: Selector | Sequence[Selector] | None,
    rtol: float,
    atol: float,
    keep_on: str | torch.device,
    paired_b_only: bool = False,
) -> Diff:
    """Run a, keeping its values; run b, comparing each value as b makes it (see ``recorder``).

    ``paired_b_only`` hooks only b's modules that pair with one of a's: for a wrapper around a
    (autocast, compile), whose own root is no counterpart of anything.
    """
    ensure_loaded(a)  # a meta model: one line, not torch's error
    ensure_loaded(b)
    _check_tolerances(rtol, atol)
    if match == "std":  # pair the modules carrying the same canonical name (two architectures)
        match, std_layers = std_pairs(ensure_module(a), ensure_module(b))
        layers = std_layers if layers is None else layers
    modules_a = _modules(ensure_module(a), layers)
    modules_b = unwrapped_modules(ensure_module(b))  # a wrapper's held module: its calls are the wrapper's
    pairs = None if match == "order" else name_pairs([n for n, _ in modules_a], [n for n, _ in modules_b], match)
    if pairs is not None:
        if not pairs or (set(pairs) == {""} and len(modules_a) > 1 and layers is None):
            raise SpecError(_no_pairs(modules_a, modules_b, match))
        if layers is not None or paired_b_only:  # b's other modules were left out on purpose, not missing
            modules_b = [(name, module) for name, module in modules_b if name in pairs]
    elif layers is not None:
        raise SpecError("layers= picks a's modules by name, which match='order' cannot pair; leave layers out")
    wanted = {name for name, _ in modules_a}
    keeping = capture(a, lambda name, _: name in wanted, keep="both", device=keep_on)
    with Reference(a, modules_a) as reference, keeping, torch.no_grad(), _blame("a"):
        a(*inputs_a[0], **inputs_a[1])
    reference.fill(keeping.cache)
    del keeping
    gc.collect()  # a capture and its call tracker refer to each other: free its cache now, so that
    # the calls hold the only references to a's values and each goes once it is compared
    with Comparer(b, modules_b, reference.calls, pairs) as comparer, torch.no_grad(), _blame("b"):
        b(*inputs_b[0], **inputs_b[1])
    meta = {"a": type(a).__name__, "b": type(b).__name__, "inputs": True}
    return _diff(comparer, reference.calls, rtol, atol, meta, check_classes=pairs is None)


def compare_caches(a: Cache, b: Cache, *, match: Match, rtol: float, atol: float) -> Diff:
    """Two captures already taken: their sites paired by module (and call), compared directly."""
    _check_tolerances(rtol, atol)
    calls_a, calls_b = _calls_of(a), _calls_of(b)
    if match == "order":
        paired = list(zip(calls_a, calls_b, strict=False))
    else:
        pairs = name_pairs(list(dict.fromkeys(k.name for k in calls_a)), [k.name for k in calls_b], match)
        by_site = {(kept.name, kept.call): kept for kept in calls_a}
        paired = [(by_site[(pairs[k.name], k.call)], k) for k in calls_b if (pairs.get(k.name), k.call) in by_site]
    drafts = []
    for order, (kept_a, kept_b) in enumerate(paired):
        draft = CallDraft(kept_b.name, kept_b.call, kept_b.class_name, True, kept_a, finished=order)
        for what, values_b in (("input", kept_b.inputs), ("output", kept_b.outputs)):
            values_a = kept_a.inputs if what == "input" else kept_a.outputs
            leaves = [(path, tensor) for path, tensor in values_b.items() if tensor is not None]
            draft.leaves += compare_leaves(what, values_a, kept_a.shapes, leaves)
        drafts.append(draft)
    matched = {(kept.name, kept.call) for kept, _ in paired}
    paired_b = {id(kb) for _, kb in paired}
    only_b = [f"{call_label(k.name, k.call)}" for k in calls_b if id(k) not in paired_b]
    with_inputs = any(kept.inputs for kept in calls_a) and any(kept.inputs for kept in calls_b)
    return _rows(drafts, calls_a, matched, only_b, rtol, atol, {"a": "Cache", "b": "Cache", "inputs": with_inputs})


def _calls_of(cache: Cache) -> list[Kept]:
    """A cache's values grouped by call, in the order their outputs were kept (the order outputs
    were made, as for two models; a call with inputs only goes where its inputs were)."""
    calls: dict[tuple[str, int], Kept] = {}
    first_seen: dict[tuple[str, int], int] = {}
    first_output: dict[tuple[str, int], int] = {}
    for position, site in enumerate(cache.sites()):
        key = (site.module, site.call)
        kept = calls.setdefault(key, Kept(site.module, site.call, ""))
        tensor = cache[site]
        (kept.inputs if site.what == "input" else kept.outputs)[site.path] = tensor
        kept.shapes[(site.what, site.path)] = (tuple(tensor.shape), dtype_name(tensor.dtype))
        first_seen.setdefault(key, position)
        if site.what == "output":
            first_output.setdefault(key, position)
    return sorted(calls.values(), key=lambda k: first_output.get((k.name, k.call), first_seen[(k.name, k.call)]))


def _diff(
    comparer: Comparer, reference: list[Kept], rtol: float, atol: float, meta: dict[str, Any], *, check_classes: bool
) -> Diff:
    only_b = [f"{call_label(d.name_b, d.call)}" for d in comparer.drafts if d.reference is None]
    finished = sorted((d for d in comparer.drafts if d.finished is not None), key=lambda d: d.finished or 0)
    return _rows(finished, reference, comparer.matched, only_b, rtol, atol, meta, check_classes=check_classes)


def _rows(
    drafts: list[CallDraft],
    reference: list[Kept],
    matched: set[tuple[str, int]],
    only_b: list[str],
    rtol: float,
    atol: float,
    meta: dict[str, Any],
    *,
    check_classes: bool = False,
) -> Diff:
    leaves = [leaf for draft in drafts if draft.reference is not None for leaf in draft.leaves]
    measured = read_metrics([leaf.raw for leaf in leaves if leaf.raw is not None])
    metrics = iter(measured)
    read = {id(leaf): next(metrics) for leaf in leaves if leaf.raw is not None}
    rows: list[DiffRow] = []
    off_track: list[str] = []
    for draft in drafts:
        kept = draft.reference
        if kept is None:
            continue
        inputs = tuple(
            LeafDiff(leaf.path, leaf.shape_a, leaf.shape_b, read.get(id(leaf)), leaf.note)
            for leaf in draft.leaves
            if leaf.what == "input"
        )
        unlike = check_classes and _unlike(kept, draft)
        if unlike:
            off_track.append(f"a's {call_label(kept.name, kept.call)} ({kept.class_name}) with b's {draft.name_b}")
        for leaf in (leaf for leaf in draft.leaves if leaf.what == "output"):
            note = leaf.note
            if unlike and note is None:  # paired by order, a layer against another kind
                note = f"classes differ ({kept.class_name} vs {draft.class_b})"
            rows.append(_row(len(rows), kept, draft, leaf, read.get(id(leaf)), note, inputs))
    if off_track:
        warnings.warn(PairingWarning(_off_track_message(off_track)), stacklevel=5)  # the user's hs.diff call
    only_a = [f"{call_label(k.name, k.call)}" for k in reference if (k.name, k.call) not in matched]
    return Diff(rows, rtol=rtol, atol=atol, only_a=only_a, only_b=only_b, meta=meta)


def _unlike(kept: Kept, draft: CallDraft) -> bool:
    """Whether a pair made by call order joins modules of different kinds: a layer with another
    layer's class, or a layer with a container. Two containers may differ in class (two
    implementations of one block), and so may the roots."""
    if kept.leaf != draft.leaf:
        return kept.name != "" or draft.name_b != ""
    return kept.leaf and kept.class_name != draft.class_b


def _off_track_message(pairs: list[str]) -> str:
    shown = "; ".join(pairs[:3]) + (f"; and {len(pairs) - 3} more" if len(pairs) > 3 else "")
    return (
        f"match='order' paired {counted(len(pairs), 'call')} with a module of another kind ({shown}): "
        "the models' call orders differ there, so those rows compare unrelated values (marked "
        "'classes differ'); pair by name or by a mapping (match={'a.pattern.*': 'b.pattern.*'}) instead"
    )


def _row(
    order: int, kept: Kept, draft: CallDraft, leaf: LeafDraft, metrics: Any, note: str | None, inputs: Any
) -> DiffRow:
    return DiffRow(
        order=order,
        name=kept.name,
        name_b=draft.name_b,
        call=kept.call,
        class_name=kept.class_name or draft.class_b,
        class_b=draft.class_b,
        path=leaf.path,
        shape=leaf.shape_a,
        shape_b=leaf.shape_b,
        dtype=leaf.dtype_a,
        dtype_b=leaf.dtype_b,
        metrics=metrics,
        note=note,
        inputs=inputs,
    )


@contextlib.contextmanager
def _blame(which: str) -> Iterator[None]:
    """Say which model's forward an exception came from."""
    try:
        yield
    except Exception as error:
        if hasattr(error, "add_note"):
            error.add_note(f"hookscope.diff: raised in model {which}'s forward")
        raise


def _modules(model: nn.Module, layers: Selector | Sequence[Selector] | None) -> list[tuple[str, nn.Module]]:
    if layers is None:
        return unwrapped_modules(model)
    kept = {
        id(module) for _, module in unwrapped_modules(model)
    }  # a wrapper's held module: its calls are the wrapper's
    return [(name, module) for name, module in select_std(model, layers) if id(module) in kept]


def std_pairs(a: nn.Module, b: nn.Module) -> tuple[Callable[[str], str | None], list[Selector]]:
    """``match="std"``: a's module for each canonical name that a module carries in both models,
    paired with b's (``{a's name: b's name}``), and a's modules to compare."""
    std_a, std_b = known_std_map(a), known_std_map(b)
    pairs: dict[str, str] = {}
    for name, site in std_a.items():
        other = std_b.sites.get(name)
        if site.module is not None and other is not None and other.module is not None:
            pairs.setdefault(site.module, other.module)
    if not pairs:
        raise SpecError(
            f"match='std' found no canonical name a module carries in both models ({std_a.family} and {std_b.family})"
        )
    return pairs.get, list(pairs)


def _check_tolerances(rtol: float, atol: float) -> None:
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not isinstance(value, (int, float)) or value < 0:
            raise SpecError(f"{name}={value!r}; expected a tolerance of 0 or more")


def _no_pairs(modules_a: list[tuple[str, nn.Module]], modules_b: list[tuple[str, nn.Module]], match: Match) -> str:
    sample_a = ", ".join(repr(n) for n, _ in modules_a[1:4])
    sample_b = ", ".join(repr(n) for n, _ in modules_b[1:4])
    return (
        f"no module of b matches one of a by {'name' if match == 'name' else 'the given map'} "
        f"(a has {sample_a} ..., b has {sample_b} ...); pass match={{'a.pattern.*': 'b.pattern.*'}} "
        "or match='order' for models that differ only in their names"
    )


_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu|meta)(:\d+)?$")


def _is_device(value: object) -> bool:
    return isinstance(value, torch.device) or (isinstance(value, str) and _DEVICE.match(value) is not None)


def _inside(prefix: str) -> Callable[[str], str]:
    """a's names as they read in a wrapper that holds a as ``prefix``."""
    return lambda name: f"{prefix}.{name}" if name else prefix


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype``."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def _own_inputs(inputs: object) -> Inputs:
    """``inputs_b`` checked: a pair ``(args tuple, kwargs dict)``, as ``inputs=`` of ``hs.extract`` returns."""
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], tuple) and isinstance(inputs[1], dict):
        return inputs[0], inputs[1]
    raise SpecError(
        f"inputs_b is {type(inputs).__name__}; expected b's (args tuple, kwargs dict), "
        "e.g. inputs_b=((x.half(),), {})"
    )


def _moved(value: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), value)


def _usable_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device this process can put tensors on; else ``SpecError`` saying why."""
    target = parse_device(device)
    assert target is not None
    try:
        torch.empty(0, device=target)
    except (RuntimeError, AssertionError) as error:  # a CPU build asked for CUDA raises AssertionError
        raise SpecError(
            f"device {str(target)!r} cannot be used here ({type(error).__name__}: {error}); compare against a "
            f"device this machine has, e.g. 'cpu' or 'meta' (torch {torch.__version__})"
        ) from None
    return target


def _given(rtol: float | None, atol: float | None, dtypes: list[torch.dtype]) -> tuple[float, float]:
    """The tolerances asked for, each left out one the default for these dtypes."""
    default_rtol, default_atol = tolerances(*dtypes)
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


class DiffFunction:
    """``hs.diff(a, b, *args, **kwargs)``, and the built-in comparisons ``hs.diff.dtypes``,
    ``hs.diff.compiled`` and ``hs.diff.devices``."""

    def __call__(
        self,
        a: nn.Module | Cache,
        b: nn.Module | Cache,
        *args: Any,
        match: Match = "name",
        layers: Selector | Sequence[Selector] | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        keep_on: str | torch.device = "cpu",
        model_kwargs: dict[str, Any] | None = None,
        inputs_b: Inputs | None = None,
        **kwargs: Any,
    ) -> Diff:
        """Compare ``a`` and ``b`` layer by layer: two models run on the same inputs, or two captures.

        For each site (module and call) and each output tensor: max and mean |a - b|, relative
        error ``||a - b|| / ||a||``, cosine similarity, SQNR in dB, and whether it is within
        ``max|a - b| <= atol + rtol * max|a|``; the call's inputs are compared too, so
        :meth:`Diff.first_divergence` can tell a layer that introduced a difference from one that
        was handed it. Sites are paired ``match="name"`` (default), by a mapping of name patterns
        (``{"model.layers.*": "transformer.h.*"}``), by a function of a's names, by execution
        order (``"order"``, for the same structure under other names), or by canonical name
        (``"std"``, for two architectures: the modules carrying ``blocks.3.attn``, ``embed``,
        ... in each, see :func:`hookscope.std_map`). ``layers`` limits the comparison to a's
        modules a selector picks (``"std:..."`` selectors included).

        Models run once each under ``torch.no_grad()``, a first: its values are copied to
        ``keep_on`` (the CPU) as they are made, then b's are compared the moment they exist and
        a's copy is dropped, so the peak is one copy of a's values plus b's own forward.
        Train/eval modes are left as they are (use eval mode: dropout would differ).

        ``inputs_b=(args, kwargs)`` gives b inputs of its own, for a b that cannot take a's:
        a copy in another dtype needs inputs in that dtype, a port may name its arguments
        differently. They should hold the same values, or every site differs from the first.

        Example::

            d = hs.diff(model, quantised, x)
            print(d.first_divergence())     # first divergence at h.3.mlp#0 (Linear): ...
            d.to_pandas()

        b in float64, given float64 inputs; the output's max|a-b| is the one computed by hand:

        >>> import copy, hookscope as hs
        >>> a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> b, x = copy.deepcopy(a).double(), torch.randn(2, 4)
        >>> d = hs.diff(a, b, x, inputs_b=((x.double(),), {}))
        >>> [row.site for row in d.rows], d.within(rtol=1e-5, atol=1e-6)
        (['0#0', '1#0', '(root)#0'], True)
        >>> with torch.no_grad():
        ...     by_hand = (a(x).double() - b(x.double())).abs().max().item()
        >>> d.rows[-1].metrics.max_abs == by_hand
        True
        """
        if isinstance(a, Cache) or isinstance(b, Cache):
            if not (isinstance(a, Cache) and isinstance(b, Cache)):
                raise SpecError("pass two models or two captures (Cache) to hs.diff, not one of each")
            if args or kwargs or inputs_b is not None:
                raise SpecError("two captures are compared as they are: pass no inputs with them")
            if match == "std":
                raise SpecError("match='std' pairs the modules of two models; two captures are paired by their names")
            rtol, atol = _given(rtol, atol, [v.dtype for cache in (a, b) for v in cache.values()])
            return compare_caches(a, b, match=match, rtol=rtol, atol=atol)
        inputs = (args, {**kwargs, **(model_kwargs or {})})
        other = inputs if inputs_b is None else _own_inputs(inputs_b)
        rtol, atol = _given(rtol, atol, model_dtypes(ensure_module(a), ensure_module(b)))
        return compare_models(a, b, inputs, other, match=match, layers=layers, rtol=rtol, atol=atol, keep_on=keep_on)

    def tolerances(self, *dtypes: torch.dtype | None) -> tuple[float, float]:
        """The default ``(rtol, atol)`` for values of these dtypes: ``(1e-5, 1e-8)`` for float32
        and float64, ``(1e-2, 1e-3)`` when any is bfloat16, float16 or narrower. ``hs.diff``
        takes them from the dtypes of the two models' parameters (or the captured values).

        >>> import hookscope as hs
        >>> hs.diff.tolerances(torch.float32, torch.bfloat16)
        (0.01, 0.001)
        """
        return tolerances(*dtypes)

    def dtypes(
        self,
        model: nn.Module,
        *args: Any,
        dtype: torch.dtype | str | None = None,
        autocast: bool = False,
        rtol: float | None = None,
        atol: float | None = None,
        **kwargs: Any,
    ) -> Diff:
        """``model`` in its own dtype against a copy cast to ``dtype`` (inputs cast too), or, with
        ``autocast=True``, against the same model under ``torch.autocast`` on its device.

        The dtype may also come last among the positional arguments, as in the example; it
        defaults to bfloat16. Tolerances default to :meth:`tolerances` of that dtype (for bf16 and
        fp16: rtol 1e-2, atol 1e-3), the same as ``hs.diff`` of a model and such a copy.

        Example::

            print(hs.diff.dtypes(model, x, torch.bfloat16))     # where bf16 loses the most
        """
        from hookscope._shared.dtypes import floating_dtype

        if args and isinstance(args[-1], torch.dtype):  # hs.diff.dtypes(model, x, torch.bfloat16)
            if dtype is not None:
                raise SpecError(f"two dtypes given: {args[-1]} among the inputs and dtype={dtype!r}; pass one")
            args, dtype = args[:-1], args[-1]
        target = floating_dtype(torch.bfloat16 if dtype is None else dtype)
        if target is None:
            raise SpecError("dtype: name the floating dtype to compare against, e.g. torch.bfloat16 or 'fp16'")
        inputs = (args, kwargs)
        rtol, atol = _given(rtol, atol, [target])
        options: dict[str, Any] = {"layers": None, "rtol": rtol, "atol": atol, "keep_on": "cpu"}
        if autocast:
            device = next((p.device.type for p in model.parameters() if not p.is_meta), "cpu")  # offloaded: meta
            wrapped = _Autocast(model, device, target)
            return compare_models(model, wrapped, inputs, inputs, match=_inside("inner"), paired_b_only=True, **options)
        cast = copy.deepcopy(model).to(target)
        return compare_models(
            model, cast, inputs, (cast_floats(args, target), cast_floats(kwargs, target)), match="name", **options
        )

    def compiled(
        self,
        model: nn.Module,
        *args: Any,
        backend: str = "inductor",
        rtol: float = 1e-4,
        atol: float = 1e-5,
        **kwargs: Any,
    ) -> Diff:
        """``model`` eager against ``torch.compile(model, backend=backend)``, compared at the
        model's output: inside a compiled graph the submodules' hooks would break the graph or
        not run at all, so only the whole model is compared. To find the layer, compile the
        layers one at a time, or diff eager against ``backend="eager"`` (graph capture alone).

        Example::

            hs.diff.compiled(model, x).within()     # does inductor change the result?
        """
        compiled = _Compiled(model, backend)
        inputs = (args, kwargs)
        options: dict[str, Any] = {"rtol": rtol, "atol": atol, "keep_on": "cpu"}
        return compare_models(model, compiled, inputs, inputs, match="name", layers=[""], paired_b_only=True, **options)

    def devices(
        self,
        model: nn.Module,
        *args: Any,
        device: str | torch.device | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-5,
        **kwargs: Any,
    ) -> Diff:
        """``model`` where it is against a copy on ``device`` (inputs moved too), layer by layer.

        The device may also come last among the positional arguments; it defaults to ``cuda``.

        Example::

            hs.diff.devices(model, x, "cuda").first_divergence()
        """
        if args and _is_device(args[-1]):  # hs.diff.devices(model, x, "cuda")
            if device is not None:
                raise SpecError(f"two devices given: {args[-1]!r} among the inputs and device={device!r}; pass one")
            args, device = args[:-1], args[-1]
        target = _usable_device("cuda" if device is None else device)
        moved = copy.deepcopy(model).to(target)
        inputs = (args, kwargs)
        options: dict[str, Any] = {"layers": None, "rtol": rtol, "atol": atol, "keep_on": "cpu"}
        return compare_models(
            model, moved, inputs, (_moved(args, target), _moved(kwargs, target)), match="name", **options
        )

    def __repr__(self) -> str:
        return "<function hookscope.diff (and .dtypes, .compiled, .devices)>"


class _Autocast(nn.Module):
    """The same model, called under ``torch.autocast``: its module names are the model's own."""

    def __init__(self, model: nn.Module, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = model
        self._device, self._dtype = device, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self._device, dtype=self._dtype):
            return self.inner(*args, **kwargs)


class _Compiled(nn.Module):
    """``torch.compile(model)`` as one module: compared at its output, by execution order."""

    def __init__(self, model: nn.Module, backend: str) -> None:
        super().__init__()
        self.__dict__["_compiled"] = torch.compile(model, backend=backend)  # not a submodule: no hooks inside

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        compiled: Callable[..., Any] = self.__dict__["_compiled"]
        return compiled(*args, **kwargs)


diff = DiffFunction()
