"""``layers()``: every module a selector can name, with its class, parameters and calls.

The table answers the first question before hooking anything: what is this model called
inside? Given a sample input it also runs one forward pass and counts how often each module
ran, which shows shared modules (called twice), loops, and modules that never run at all;
with ``ops=True`` the same pass lists the op sites (``h.0.attn:op[softmax#0]``): the torch
calls each module's own code made, which no module hook sees.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import ExitStack
from html import escape
from typing import Any, NamedTuple, overload

import torch
from torch import nn

from hookscope._arch.positions import positions_mask
from hookscope._arch.samples.multimodal import image_token
from hookscope._arch.std import StdMap, std_map
from hookscope._core.attach import HookGroup
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import ROOT_LABEL, module_label, named_modules
from hookscope._core.op_list import OpCall, OpLog
from hookscope._core.ops import OpWatcher
from hookscope._core.params import count, own_count
from hookscope._core.select import Selector, ensure_module, select
from hookscope._core.tracker import CallTracker
from hookscope._shared.shapes import format_shape
from hookscope._shared.tables import Column, Table
from hookscope._shared.units import counted
from hookscope.errors import HookscopeError, SiteNotFoundError, SpecError

__all__ = ["Layer", "LayerTable", "layers"]


class Layer(NamedTuple):
    """One module: its dotted name (``""`` for the root), class, own parameters, calls."""

    name: str
    class_name: str
    params: int
    calls: int | None
    depth: int


class LayerTable:
    """The modules of a model, in ``named_modules()`` order; prints as an aligned table.

    Iterating yields :class:`Layer` rows; ``table["layer1.conv1"]`` looks one up by name.
    ``params`` counts a module's own parameters (not its children's); the footer's total counts
    each parameter tensor once, so weights tied between two modules are not counted twice.
    ``ops`` holds the op sites when they were asked for (``layers(model, x, ops=True)``), in the
    order they ran; they print as a second table.
    """

    def __init__(
        self, rows: list[Layer], total_params: int, trainable_params: int, ops: list[OpCall] | None = None
    ) -> None:
        self.rows = rows
        self.total_params = total_params
        self.trainable_params = trainable_params
        self.ops = ops
        #: The canonical names of the model's sites, with ``hs.layers(model, std=True)``.
        self.std: StdMap | None = None
        #: A vision-language model's image positions in the example (``token_mask="image"``), as
        #: a line: how many of row 0's tokens hold an image, and where; "" for other models.
        self.image_positions = ""
        self._by_name = {row.name: row for row in rows}

    @property
    def names(self) -> list[str]:
        """Every module name, in model order (the root's name is ``""``)."""
        return [row.name for row in self.rows]

    @property
    def has_calls(self) -> bool:
        """True when a sample input was run and the ``calls`` column is filled."""
        return bool(self.rows) and self.rows[0].calls is not None

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, key: int) -> Layer: ...
    @overload
    def __getitem__(self, key: str) -> Layer: ...
    def __getitem__(self, key: int | str) -> Layer:
        if isinstance(key, int):
            return self.rows[key]
        found = self._by_name.get("" if key == ROOT_LABEL else key)
        if found is None:
            close = difflib.get_close_matches(key, list(self._by_name), n=3, cutoff=0.6)
            hint = (
                f"did you mean {' or '.join(map(repr, close))}?" if close else "the names are the table's first column"
            )
            raise SiteNotFoundError(f"no module {key!r} in this table; {hint}", key=key, candidates=tuple(close))
        return found

    def _table(self) -> Table:
        """The rows as a :class:`~hookscope._shared.tables.Table`, the totals as its note."""
        own_sum = sum(row.params for row in self.rows)
        shared = (
            f" ({own_sum - self.total_params:,} counted under two names above)" if own_sum != self.total_params else ""
        )
        footer = (
            f"{len(self.rows)} modules · {self.total_params:,} parameters ({self.trainable_params:,} trainable){shared}"
        )
        if self.has_calls:
            unused = sum(1 for row in self.rows if row.calls == 0)
            footer += f" · {unused} modules not called" if unused else ""
        columns = [Column("name"), Column("class"), Column("params", "right")]
        table = Table(columns + ([Column("calls", "right")] if self.has_calls else []), notes=[footer])
        for row in self.rows:
            calls = [str(row.calls)] if self.has_calls else []
            table.add(module_label(row.name), row.class_name, f"{row.params:,}", *calls)
        return table

    def _op_table(self, ops: list[OpCall]) -> Table:
        """The op sites as a table: site text (the module's call shown where it ran more than
        once), the shapes and dtypes the op returned."""
        calls = {row.name: row.calls or 0 for row in self.rows}
        table = Table(
            [Column("op site"), Column("output"), Column("dtype")],
            title="op sites: the torch calls of each module's own code, in the order they ran",
            notes=[f"{counted(len(ops), 'op site')} in {counted(len({op.module for op in ops}), 'module')}"],
        )
        for op in ops:
            site = str(op.site) if calls.get(op.module, 0) > 1 else op.site.short
            shapes = ", ".join(format_shape(shape) for shape in op.shapes)
            dtypes = ", ".join(dict.fromkeys(str(dtype).removeprefix("torch.") for dtype in op.dtypes))
            table.add(site, shapes, dtypes)
        return table

    def __str__(self) -> str:
        text = self._table().text()
        text = text if self.ops is None else f"{text}\n\n{self._op_table(self.ops).text()}"
        text = text if self.std is None else f"{text}\n\n{self.std.table()}"
        return f"{text}\n{self.image_positions}" if self.image_positions else text

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        html = self._table().html()
        html = html if self.ops is None else html + self._op_table(self.ops).html()
        return html if self.std is None else html + f"<pre>{escape(self.std.table())}</pre>"


def layers(
    model: nn.Module, *example_args: Any, ops: bool | Selector = False, std: bool = False, **example_kwargs: Any
) -> LayerTable:
    """List every module of ``model``: dotted name, class, own parameter count, and calls.

    With a sample input (``layers(model, x)``, keyword inputs too) one forward pass runs in eval
    mode under ``torch.no_grad()`` -- so batch-norm statistics are not touched -- and the
    ``calls`` column shows how often each module ran in it. The model's modes are restored.

    ``ops=True`` also lists the op sites of that pass (``table.ops``, and a second table): every
    torch call a module's own code made, not counting its submodules', under the name a
    selector will take (``h.0.attn:op[softmax#0]``), with the shapes and dtypes it returned.
    ``ops=`` a selector lists only the chosen modules' op sites. Under ``torch.compile`` the
    watched modules run eagerly for that pass, so their ops are listed as the eager model runs them.

    ``std=True`` adds the map of canonical names (``table.std``, a :class:`~hookscope.StdMap`,
    printed after the modules): which site ``std:blocks.3.resid_post`` and the other canonical
    names are on this model, and which names it does not define and why. The map is checked on
    the sample input (a transformers model needs none).

    Example::

        >>> import hookscope as hs
        >>> print(hs.layers(nn.Sequential(nn.Linear(4, 8), nn.ReLU())))
        name     class        params
        ────────────────────────────
        (root)   Sequential        0
        0        Linear           40
        1        ReLU              0
        3 modules · 40 parameters (40 trainable)
    """
    ensure_module(model)
    named = named_modules(model)
    watched = _op_modules(model, named, ops, sampled=bool(example_args or example_kwargs))
    calls, op_calls = None, None
    if example_args or example_kwargs:
        calls, op_calls = _run(model, named, watched, example_args, example_kwargs)
    rows = [
        Layer(
            name,
            type(module).__name__,
            own_count(module),
            None if calls is None else calls.get(name, 0),
            name.count(".") + 1 if name else 0,
        )
        for name, module in named
    ]
    unique = list(model.parameters())
    table = LayerTable(rows, count(unique), count(p for p in unique if p.requires_grad), op_calls)
    if std:
        table.std = std_map(model, *example_args, **example_kwargs)
        table.image_positions = _image_positions(model, example_args, example_kwargs)
    return table


def _image_positions(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``image positions: 16 of 32 tokens of row 0 (1-16; image token 999; token_mask='image')``."""
    config = getattr(model, "config", None)
    placeholder = image_token(config)
    if placeholder is None or not any(name in kwargs for name in ("pixel_values", "pixel_values_videos")):
        return ""
    try:
        mask = positions_mask(config, "image", args, kwargs)[0]
    except HookscopeError:
        return ""
    where = mask.nonzero().flatten().tolist()
    spans, start = [], None
    for index, position in enumerate(where):
        start = position if start is None else start
        if index + 1 == len(where) or where[index + 1] != position + 1:
            spans.append(f"{start}-{position}" if position > start else str(start))
            start = None
    return (
        f"image positions: {len(where)} of {mask.numel()} tokens of row 0 ({', '.join(spans) or 'none'}; image token "
        f"{placeholder}; select them with token_mask='image', positions='image')"
    )


def _op_modules(
    model: nn.Module, named: list[tuple[str, nn.Module]], ops: bool | Selector, *, sampled: bool
) -> list[tuple[str, nn.Module]] | None:
    """The modules whose op sites ``ops=`` asks for (None: not asked), checked before the forward."""
    if ops is False:
        return None
    if isinstance(ops, torch.Tensor):
        raise SpecError("ops= is layers' own option (True, or which modules' op sites to list), not a model input")
    if not sampled:
        raise SpecError(
            "op sites are found by running the model: give a sample input, e.g. hs.layers(model, x, ops=True)"
        )
    return named if isinstance(ops, bool) else select(model, ops)


def _run(
    model: nn.Module,
    named: list[tuple[str, nn.Module]],
    watched: list[tuple[str, nn.Module]] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[dict[str, int], list[OpCall] | None]:
    """One forward in eval mode under no_grad: each module's calls and, if asked, its op sites."""
    ensure_loaded(model, (args, kwargs))  # a meta model: one line, not torch's device mismatch
    tracker = CallTracker()
    log = OpLog()
    with HookGroup(model, [], owner="layers", tracker=tracker, count=named), ExitStack() as stack, torch.no_grad():
        if watched is not None:
            stack.enter_context(OpWatcher(model, watched, log, owner="layers", bare_to_caller=True))
        model.eval()
        model(*args, **kwargs)
        return tracker.counts(), None if watched is None else log.calls
