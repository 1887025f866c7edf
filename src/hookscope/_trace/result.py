"""``Trace``: the rows of one traced forward pass, with the questions one asks of them.

Where the first NaN/Inf came from (:meth:`Trace.first_nonfinite`), where a failed forward
stopped (:attr:`Trace.failure`), and the same rows as a printed table, pandas, CSV, JSON or HTML.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, overload

from torch import nn

from hookscope._arch.std import canonical_source
from hookscope._core.names import ROOT_LABEL, WRAPPER_CLASS_NAMES, short_spelling
from hookscope._core.select import Selector, select, select_names
from hookscope._core.site_index import SiteIndex
from hookscope._core.sites import Site
from hookscope._shared.blame import findings, fine_input
from hookscope._shared.csv_text import csv_text
from hookscope._shared.files import write_text
from hookscope._shared.json import finite_json
from hookscope._shared.optional import require
from hookscope._trace.experts import ExpertLoad, expert_load
from hookscope._trace.render import flat_record, leaf_records, table
from hookscope._trace.rows import NonFiniteRow, TensorInfo, TraceRow
from hookscope.errors import SpecError

__all__ = ["Trace"]


def _accepted_input(info: TensorInfo, allowed: set[str]) -> bool:
    """True when a call's input does not disqualify it from being blamed for a NaN/Inf
    (:func:`~hookscope._shared.blame.fine_input`); an input not measured counts as finite."""
    stats = info.stats
    if stats is None or stats.finite:
        return True
    only_negative_inf = stats.nan == 0 and stats.posinf == 0
    return fine_input(info.path, info.source, finite=False, negative_inf_only=only_negative_inf, allowed=allowed)


class Trace(Sequence[TraceRow]):
    """One row per module call of a forward pass, in the order calls started.

    ``trace[3]`` is the fourth call; ``trace["layer1.conv1"]`` the first call of that module
    (``trace.calls(name)`` every call). ``print(trace)`` shows the table; :meth:`table` takes
    ``max_depth``, ``filter`` (a selector) and ``columns``.
    """

    def __init__(
        self,
        rows: list[TraceRow],
        *,
        model: nn.Module | None = None,
        meta: dict[str, Any] | None = None,
        failure: int | None = None,
    ) -> None:
        self.rows = rows
        self._failure = failure
        self.meta = dict(meta or {})
        self._model = weakref.ref(model) if model is not None else None
        self._by_name: dict[str, list[TraceRow]] = {}
        self._sites: tuple[SiteIndex, dict[Site, TraceRow]] | None = None
        for row in rows:
            if not row.op:  # an op site's row is found by its site text ("h.0.attn:op[softmax#0]")
                self._by_name.setdefault(row.name, []).append(row)

    # -- reading rows ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, key: int) -> TraceRow: ...
    @overload
    def __getitem__(self, key: slice) -> list[TraceRow]: ...
    @overload
    def __getitem__(self, key: str) -> TraceRow: ...
    def __getitem__(self, key: int | slice | str) -> TraceRow | list[TraceRow]:
        if isinstance(key, str):
            rows = self._named(key)
            return rows[0] if rows else self._site_rows(key)[0]
        return self.rows[key]

    def __iter__(self) -> Iterator[TraceRow]:
        return iter(self.rows)

    def _wrapped(self) -> bool:
        """True when the traced model was a DDP, DataParallel or torch.compile wrapper."""
        roots = self._by_name.get("") or []
        return bool(roots) and roots[0].class_name in WRAPPER_CLASS_NAMES

    def calls(self, name: str) -> list[TraceRow]:
        """Every call of the module named ``name`` (``""`` or ``"(root)"`` is the model).

        ``name`` may be spelled as a capture's key is (``"fc#1"``, ``"h.0:output[0]"``, an
        escaped name): every call of its module. A miss raises ``SiteNotFoundError`` naming
        the closest modules.
        """
        return self._named(name) or self._site_rows(name)[1]

    def _named(self, name: str) -> list[TraceRow]:
        """The calls of the module named ``name`` exactly (or below a wrapper); empty if none."""
        rows = self._by_name.get("" if name == ROOT_LABEL else name)
        short = short_spelling(name) if not rows and self._wrapped() else None
        if short is not None:  # "module.0" below a DDP or torch.compile wrapper: the row is "0"
            rows = self._by_name.get(short)
        return rows or []

    def _site_rows(self, key: str) -> tuple[TraceRow, list[TraceRow]]:
        """The call ``key`` names as a site (its first call when it names none), and every
        call of its module; a miss raises ``SiteNotFoundError`` with the closest names."""
        if self._sites is None:
            sites: dict[Site, TraceRow] = {}
            for row in self.rows:
                if row.op:  # an op site's output, by the op's site (an op's inputs are its module's values)
                    for info in row.outputs:
                        sites.setdefault(Site(row.name, row.call, "output", info.path, op=row.op), row)
                    sites.setdefault(Site(row.name, row.call, op=row.op), row)
                    continue
                for info in (*row.outputs, *row.inputs):
                    sites.setdefault(Site(row.name, row.call, info.what, info.path), row)
                sites.setdefault(Site(row.name, row.call), row)  # a call with no tensor measured
            model = self._model() if self._model is not None else None  # "std:" names read through its map
            index = SiteIndex(
                sites,
                verb="traced",
                empty_hint="the trace holds no calls",
                default_call="first",
                canonical=canonical_source(model),
            )
            self._sites = (index, sites)
        index, sites = self._sites
        row = sites[index.resolve(key, whole=True)]
        if row.op:  # every call of the op site: the same op in each call of its module
            return row, [other for other in self.rows if other.name == row.name and other.op == row.op]
        return row, self._by_name[row.name]

    def select(self, selector: Selector) -> list[TraceRow]:
        """The rows of the modules ``selector`` picks (any hookscope selector), in call order."""
        names = self._names_of(selector)
        return [row for row in self.rows if row.name in names]

    def measured_leaves(self, sites: Selector | Sequence[Selector] | None = None) -> list[TraceRow]:
        """The rows to draw along depth, in the order their outputs came to exist.

        By default the calls of leaf modules (a container only passes its last child's output
        on); ``sites`` picks other modules. Only calls that returned measured outputs count.

        >>> import torch, hookscope as hs
        >>> t = hs.trace(nn.Sequential(nn.Linear(2, 3), nn.ReLU()), torch.ones(1, 2))
        >>> [row.name for row in t.measured_leaves()]
        ['0', '1']
        """
        if sites is not None:
            rows = [row for row in self.select(sites) if not row.op]  # type: ignore[arg-type]
        else:  # module calls only: an op site's row does not make its module a container
            parents = {row.parent for row in self.rows if not row.op}
            rows = [row for row in self.rows if row.order not in parents and row.name and not row.op]
        measured = [row for row in rows if row.stats is not None and row.finished is not None]
        return sorted(measured, key=lambda row: row.finished or 0)

    def experts(self) -> ExpertLoad:
        """Tokens per expert of every traced mixture-of-experts module call, each one's share,
        mean routing weight and the router's entropy (``hs.trace(model, x, experts=True)``; with
        ``ops=`` naming expert sub-sites only the tokens). ``print()`` it.

        A trace with no expert rows is refused: it cannot say what the load was.
        """
        load = expert_load(self.rows, self.meta.get("router_entropy", {}))
        if not load.rows:
            raise SpecError(
                "this trace holds no expert rows: trace with experts=True (or ops= naming expert sub-sites such as "
                "'model.layers.*.mlp.experts:expert.weights') on a model with fused mixture-of-experts modules"
            )
        return load

    @property
    def failure(self) -> TraceRow | None:
        """Where a failed forward raised: the innermost call the exception it ended with went
        through. None when the forward returned, even if a call inside raised and was caught."""
        return None if self._failure is None else self.rows[self._failure]

    def first_nonfinite(self, allow: Selector | Sequence[Selector] | None = None) -> NonFiniteRow | None:
        """Where the first NaN/Inf came from, as a :class:`NonFiniteRow`; None when every output is finite.

        Normally the first call, in the order calls returned, whose inputs were finite and
        output was not (the blame rule of :mod:`hookscope._shared.blame`): its own computation,
        not an earlier layer's, made the values, and ``from_input`` is False. When no call made
        them, they came in with the input (the model's, or a value made outside the traced
        modules): the answer is then the first call whose input held them, with
        ``from_input=True``. Either way the row holds the statistics of its inputs and outputs,
        and ``what``, ``path`` and the ``nan``/``posinf``/``neginf`` counts name the leaf.
        ``allow`` names modules whose non-finite outputs are intended (a module building a -inf
        attention mask): they are not blamed, and what they return counts as finite where it
        goes in. -inf alone in an input named like a mask (``attention_mask``) is accepted too.

        >>> import torch, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.LogSigmoid(), nn.Linear(2, 1))
        >>> with torch.no_grad():
        ...     _ = model[0].bias.fill_(float("nan"))
        >>> print(hs.trace(model, torch.ones(4, 2)).first_nonfinite())
        <NonFiniteRow '0' (Linear, call 0) output: 8 NaN, 0 +inf, 0 -inf (of 8); inputs finite>
        """
        if self.meta.get("stats") is False:
            raise SpecError("this trace was taken with stats=False: nothing was measured; trace again with stats=True")
        allowed = self._names_of(allow) if allow is not None else set()
        finished = sorted((row for row in self.rows if row.finished is not None), key=lambda row: row.finished or 0)
        passed_on: TraceRow | None = None  # the first call whose bad output came with its inputs
        for found in findings(
            finished,
            output_fine=lambda row: row.name in allowed or row.output_finite is not False,
            inputs_fine=lambda row: all(_accepted_input(info, allowed) for info in row.inputs),
        ):
            if found.introduced:  # the blame rule: the first call that made it, wherever it stands
                made = next(info for info in found.call.outputs if info.finite is False)
                return NonFiniteRow.of(found.call, from_input=False, leaf=made)
            passed_on = passed_on or found.call
        if passed_on is None:
            return None
        came = next(info for info in passed_on.inputs if not _accepted_input(info, allowed))
        return NonFiniteRow.of(passed_on, from_input=True, leaf=came)

    def _names_of(self, selector: Selector | Sequence[Selector]) -> set[str]:
        model = self._model() if self._model is not None else None
        chosen: Any = list(selector) if isinstance(selector, (list, tuple)) else selector
        if model is not None:
            return {name for name, _ in select(model, chosen)}
        members = chosen if isinstance(chosen, list) else [chosen]
        if not all(isinstance(member, str) for member in members):
            raise SpecError("the traced model is gone; only name, glob and 're:' selectors work on its trace now")
        return set(select_names(list(self._by_name), chosen))  # names, globs and regexes still work

    # -- showing --------------------------------------------------------------------------------

    def table(
        self,
        *,
        max_depth: int | None = None,
        filter: Selector | Sequence[Selector] | None = None,  # noqa: A002 (the issue's own word)
        columns: Sequence[str] | None = None,
    ) -> str:
        """The aligned table as text; ``print(trace)`` shows ``trace.table()``.

        ``max_depth`` hides calls nested deeper (0: the model alone), except the rows of op sites,
        which the trace holds only because ``ops=`` asked for them; ``filter`` keeps the rows
        of the modules a selector picks, ``columns`` picks and orders columns by key (see
        :data:`hookscope._trace.render.COLUMNS`).
        """
        return table(self, self._shown(max_depth, filter), columns).text()

    def _shown(self, max_depth: int | None, filter: Selector | Sequence[Selector] | None) -> list[TraceRow]:  # noqa: A002
        rows = self.rows
        if max_depth is not None:
            if max_depth < 0:
                raise SpecError(f"max_depth={max_depth} is negative; 0 shows the model's own call, 1 its children")
            rows = [row for row in rows if row.depth <= max_depth or row.op]
        if filter is not None:
            names = self._names_of(filter)
            rows = [row for row in rows if row.name in names]
        return rows

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        modules = len({row.name for row in self.rows})
        state = f", failed in {self.failure.site}" if self.failure is not None else ""
        return (
            f"<Trace of {self.meta.get('model', 'a model')}: {len(self)} calls of {modules} modules{state}; print() it>"
        )

    def __rich__(self) -> Any:
        return table(self, self.rows, None).rich()

    def _repr_html_(self) -> str:
        return table(self, self.rows, None).html()

    # -- exporting ------------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """One flat dict per call: the main output's statistics as columns (see :meth:`to_pandas`)."""
        return [flat_record(row) for row in self.rows]

    def to_pandas(self, *, per: str = "call") -> Any:
        """A ``pandas.DataFrame``: one row per call (``per="call"``, the main output's statistics)
        or one per output tensor (``per="leaf"``, with ``what`` and a relative ``path`` column)."""
        pd = require("pandas", purpose="to_pandas()", extra="pandas")
        if per == "call":
            return pd.DataFrame.from_records(self.records())
        if per == "leaf":
            return pd.DataFrame.from_records(leaf_records(self.rows))
        raise SpecError(f"per={per!r} is not 'call' (one row per module call) or 'leaf' (one per output tensor)")

    def to_csv(self, path: str | os.PathLike[str] | None = None) -> str:
        """The :meth:`records` as CSV; written to ``path`` (atomically) when given. Returns the text.

        A name holding a comma, quote or line break is quoted; one that starts like a
        spreadsheet formula (``=``, ``+``, ``-``, ``@``) gets a ``'`` before it
        (:mod:`hookscope._shared.csv_text`).
        """
        return _write(path, csv_text(self.records()))

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int | None = 1) -> str:
        """Every row with every input and output tensor, as strict JSON (NaN and Inf are written
        as the strings ``"nan"``, ``"inf"``, ``"-inf"``); written to ``path`` when given."""
        document = {"meta": {**self.meta, "failure": self._failure}, "rows": [row.to_dict() for row in self.rows]}
        return _write(path, json.dumps(finite_json(document), indent=indent, allow_nan=False) + "\n")


def _write(path: str | os.PathLike[str] | None, text: str) -> str:
    if path is not None:
        write_text(path, text)
    return text
