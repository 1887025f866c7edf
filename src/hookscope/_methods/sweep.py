"""``patch_sweep``: activation patching over sites × positions [× heads], many patches per forward.

The naive study runs one forward per patched cell. Here the corrupted input is repeated ``k``
times along the batch, and one edit per site writes each copy's own cell: copy ``j`` gets the
clean value at its site and position, the other copies pass through untouched. ``k`` patches then
cost one forward of a ``k``-times larger batch, which a model runs far faster than ``k`` small
ones. Rows do not interact in a transformer's forward (attention mixes positions, not rows), so
each copy's metric is exactly the one-patch-at-a-time result; the tests check cell for cell.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hookscope._arch.positions import POSITION_WORDS, positions_mask
from hookscope._capture import Cache, run_with_capture
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.select import Selector
from hookscope._edit import EditContext, edit
from hookscope._methods.checks import default_sites, refuse_training
from hookscope._methods.grid import Cell, Heads, Positions, SiteLayout, check_num_heads, lay_out
from hookscope._methods.metrics import MetricFn, check_metric, metric_name, metric_rows
from hookscope._methods.result import Effects
from hookscope._methods.runs import Inputs, PatchSite, patch_sites
from hookscope._shared.options import renamed
from hookscope._shared.progress import Progress
from hookscope.errors import SpecError

__all__ = ["Direction", "Plan", "patch_sweep", "plan_study"]

Direction = Literal["denoise", "noise"]

DEFAULT_BATCH_ROWS = 64


@dataclass
class Plan:
    """What a study runs: the two inputs, the sites, the cells, the baselines and the source values."""

    model: nn.Module
    metric: MetricFn
    base: Inputs  # the run that is patched
    sites: list[PatchSite]
    source: Cache  # the values patched in, from the other run
    target: Cache  # the patched run's own values at the same sites
    cells: list[Cell]
    dims: tuple[str, ...]
    coords: dict[str, list[Any]]
    shape: tuple[int, ...]
    layouts: list[SiteLayout]  # per site: where its value holds positions and heads
    clean: float
    corrupted: float
    per_row: bool
    direction: Direction
    metric_name: str
    grads: Cache | None = None  # the metric's gradient at the patched run's values (attribution)
    forwards: int = 0  # patched forwards run so far

    @property
    def base_score(self) -> float:
        """The patched run's own score, unpatched: what a cell that changes nothing scores."""
        return self.corrupted if self.direction == "denoise" else self.clean

    def normalised(self, raw: torch.Tensor) -> torch.Tensor:
        """``(raw - corrupted) / (clean - corrupted)``; NaN where the two runs score the same."""
        span = self.clean - self.corrupted
        if span == 0:
            return torch.full_like(raw, float("nan"))
        return (raw - self.corrupted) / span

    def effects(self, raw: torch.Tensor, method: str) -> Effects:
        raw = raw.reshape(self.shape).double()
        return Effects(
            self.normalised(raw),
            raw,
            self.dims,
            self.coords,
            self.clean,
            self.corrupted,
            method,
            metric=self.metric_name,
            direction=self.direction,
            sites={site.label: site.write for site in self.sites},
            forwards=self.forwards,
        )


def plan_study(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    *,
    metric: MetricFn,
    sites: str | Sequence[str] | None,
    positions: Positions,
    heads: Heads,
    num_heads: int | None,
    stack: str,
    direction: Direction,
    model_kwargs: dict[str, Any] | None,
    method: str,
    grads: bool = False,
) -> Plan:
    """Run the clean and corrupted inputs once each, capturing the sites, and lay out the cells."""
    if direction not in ("denoise", "noise"):
        raise SpecError(f"direction={direction!r}: expected 'denoise' (clean values into the corrupted run) or 'noise'")
    check_metric(metric)
    refuse_training(model, method)
    check_num_heads(num_heads, heads)
    clean_in = Inputs.of(clean, "clean", model_kwargs)
    corrupted_in = Inputs.of(corrupted, "corrupted", model_kwargs)
    if clean_in.rows != corrupted_in.rows:
        raise SpecError(
            f"clean has {clean_in.rows} rows and corrupted {corrupted_in.rows}; patching pairs them row by row"
        )
    if sites is not None and stack:
        raise SpecError(
            f"stack={stack!r} picks the default sites, and layers= names its own: drop stack=, or name the stack in "
            f"the sites (e.g. 'std:{stack}blocks.*.resid_pre')"
        )
    chosen = sites if sites is not None else default_sites(model, heads is not False, stack, clean_in, method)
    base_in, other_in = (corrupted_in, clean_in) if direction == "denoise" else (clean_in, corrupted_in)
    runs = _joint_runs(model, chosen, base_in, other_in, metric, grads) or _separate_runs(
        model, chosen, base_in, other_in, metric, grads
    )
    base_score, other_score = runs.scores
    clean_score, corrupted_score = (other_score, base_score) if direction == "denoise" else (base_score, other_score)
    if not (math.isfinite(clean_score) and math.isfinite(corrupted_score)):
        raise SpecError(
            f"the metric is {clean_score} on the clean run and {corrupted_score} on the corrupted one; a sweep "
            "normalises by their difference, so both must be finite: check the metric's positions and tokens "
            "(loss at the last position predicts nothing)"
        )
    found = patch_sites(model, chosen, runs.other)
    positions = _word_positions(model, positions, clean_in)
    grid = lay_out(model, found, runs.other, runs.base, positions, heads, num_heads, base_in.rows)
    return Plan(
        model, metric, base_in, found, runs.other, runs.base, grid.cells, grid.dims, grid.coords, grid.shape,
        grid.layouts, clean_score, corrupted_score, runs.per_row, direction, metric_name(metric), grads=runs.grads,
    )  # fmt: skip


def _word_positions(model: nn.Module, positions: Positions, clean: Inputs) -> Positions:
    """``positions="image"`` (``"text"``): the positions of a vision-language model's image (text)
    tokens in the clean input, the same in every row (:mod:`hookscope._arch.positions`)."""
    if not isinstance(positions, str) or positions not in POSITION_WORDS:
        return positions
    mask = positions_mask(getattr(model, "config", None), positions, clean.args, clean.kwargs)
    if not bool((mask == mask[:1]).all()):
        raise SpecError(
            f"positions={positions!r}: the clean rows hold their {positions} tokens at different positions; a sweep "
            "patches one position in every row: give rows of one layout, or list the positions"
        )
    found = mask[0].nonzero().flatten().tolist()
    if not found:
        raise SpecError(f"positions={positions!r}: the clean input holds no {positions} token")
    return [int(position) for position in found]


@dataclass
class _Runs:
    """The two unpatched runs: each one's values at the sites, the patched run's gradients, the scores."""

    base: Cache
    other: Cache
    grads: Cache | None
    scores: tuple[float, float]  # the patched run's, the other's
    per_row: bool


class _NotPerRow(Exception):  # noqa: N818 (a signal: fall back to two runs)
    pass


def _joint_runs(
    model: nn.Module, chosen: Any, base_in: Inputs, other_in: Inputs, metric: MetricFn, grads: bool
) -> _Runs | None:
    """Both inputs in one forward, one after the other along the batch (one forward of twice the
    rows costs less than two), and the backward from the patched run's rows only. None where that
    cannot be: inputs that do not stack, a metric without one value per row, values without the
    batch first."""
    both = base_in.stacked(other_in)
    if both is None:
        return None
    rows = base_in.rows
    scored: list[torch.Tensor] = []

    def base_metric(output: Any) -> torch.Tensor:
        try:
            values = metric(output)
        except Exception as error:  # a metric made for the input's rows alone: two runs tell the real error
            raise _NotPerRow from error
        if not isinstance(values, torch.Tensor) or values.shape != (both.rows,):
            raise _NotPerRow
        scored.append(values.detach())
        return values[:rows].sum()

    try:
        with torch.set_grad_enabled(grads), _differentiable(model, grads):
            output, cache = run_with_capture(
                model, *both.args, layers=chosen, model_kwargs=both.kwargs, backward=base_metric if grads else None
            )
            if not grads:
                base_metric(output)
    except _NotPerRow:
        return None
    if any(value.dim() == 0 or value.shape[0] != both.rows for value in cache.values()):
        return None
    halves = (slice(None, rows), slice(rows, None))
    base, other = (Cache({site: cache[site][half] for site in cache.sites()}, meta=cache.meta) for half in halves)
    kept_grads = None
    if grads:
        gradients = cache.grad
        kept_grads = Cache({site: gradients[site][:rows] for site in gradients.sites()}, meta=cache.meta)
    values = scored[0].double()
    scores = (float(values[:rows].mean()), float(values[rows:].mean()))
    return _Runs(base, other, kept_grads, scores, per_row=True)


def _separate_runs(
    model: nn.Module, chosen: Any, base_in: Inputs, other_in: Inputs, metric: MetricFn, grads: bool
) -> _Runs:
    """One run of each input (a metric that returns one number for the batch cannot be split by rows)."""
    with torch.no_grad():
        other_out, other_cache = run_with_capture(model, *other_in.args, layers=chosen, model_kwargs=other_in.kwargs)
    with torch.set_grad_enabled(grads), _differentiable(model, grads):  # the metric's gradient at the values
        base_out, base_cache = run_with_capture(
            model, *base_in.args, layers=chosen, model_kwargs=base_in.kwargs, backward=metric if grads else None
        )
    per_row = _per_row(metric, other_out, other_in.rows)
    scores = (
        float(_score(metric, base_out, base_in.rows, per_row)),
        float(_score(metric, other_out, other_in.rows, per_row)),
    )
    return _Runs(base_cache, other_cache, base_cache.grad if grads else None, scores, per_row)


@contextlib.contextmanager
def _differentiable(model: nn.Module, wanted: bool) -> Iterator[None]:
    """Frozen weights (``requires_grad_(False)``, usual for a large model under study) leave no
    graph to take activation gradients from: let them require grad for this run only. The
    backward reaches the captured values alone, so no weight gradient is computed or kept."""
    frozen = [p for p in model.parameters() if wanted and p.is_floating_point() and not p.requires_grad]
    thawed: list[nn.Parameter] = []
    try:
        for parameter in frozen:
            parameter.requires_grad_(True)
            thawed.append(parameter)
        yield
    finally:
        for parameter in thawed:
            parameter.requires_grad_(False)


def _per_row(metric: MetricFn, output: Any, rows: int) -> bool:
    value = metric(output)
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == rows:
        return True
    metric_rows(metric, output, 1 if isinstance(value, torch.Tensor) and value.dim() == 0 else rows)  # the why
    return False


def _score(metric: MetricFn, output: Any, rows: int, per_row: bool) -> torch.Tensor:
    """The metric of one run as one number: the mean over its rows."""
    with torch.no_grad():
        value = metric(output)
    return value.detach().double().mean() if per_row else value.detach().double().reshape(())


# -- running the patches -------------------------------------------------------------------------


def run_cells(plan: Plan, cells: list[Cell], batch_rows: int | None, progress: bool | None = False) -> torch.Tensor:
    """The metric (mean over the input's rows) of each cell patched on its own, batched.

    A cell whose source value equals the patched run's own value, bit for bit, changes nothing:
    its score is the patched run's, without a forward (exact, up to the rounding by which a
    kernel's result may differ between batch sizes). In a causal model every position before
    the first changed token is such a cell, at every layer, and so is every unchanged position
    at the first block; skipping them is exact, and often most of a sweep's work.

    ``progress`` shows the patched cells done (:class:`~hookscope._shared.progress.Progress`).
    """
    rows = plan.base.rows
    scores = torch.full((len(cells),), plan.base_score, dtype=torch.float64)
    differs: dict[tuple[int, int | None], list[bool]] = {}  # (site, head) -> per position
    changed = []
    for index, cell in enumerate(cells):
        key = (cell.site, cell.head)
        if key not in differs:
            differs[key] = _differing_positions(plan, *key)
        if any(differs[key]) if cell.position is None else differs[key][cell.position]:
            changed.append(index)
    per_forward = 1 if not plan.per_row else max(1, (batch_rows or DEFAULT_BATCH_ROWS) // rows)
    with Progress(len(changed), enabled=progress, label="patch_sweep", unit="patched cells") as bar:
        for start in range(0, len(changed), per_forward):
            indices = changed[start : start + per_forward]
            chunk = [cells[i] for i in indices]
            edits = _chunk_edits(plan, chunk)
            inputs = plan.base.repeated(len(chunk))
            with torch.no_grad(), edit(plan.model, edits):
                output = inputs.run(plan.model)
            if plan.per_row:
                values = metric_rows(plan.metric, output, inputs.rows).double().reshape(len(chunk), rows).mean(1)
            else:
                values = plan.metric(output).detach().double().reshape(1)
            scores[indices] = values.cpu()
            plan.forwards += 1
            bar.advance(len(chunk))
    return scores


def _differing_positions(plan: Plan, site: int, head: int | None) -> list[bool]:
    """Per position, whether patching it at ``site`` (and ``head``) would write a value other than
    the one already there: one read back to the host per site and head, not one per cell."""
    read = plan.sites[site].read
    source = plan.source[read]
    changed = source != plan.target[read].to(source.device)
    differs: list[bool] = plan.layouts[site].per_position(changed, head).any(1).tolist()
    return differs


def _chunk_edits(plan: Plan, chunk: list[Cell]) -> dict[Selector, Callable[[torch.Tensor, EditContext], torch.Tensor]]:
    """One edit per write selector touched by the chunk: copy ``j`` of the batch gets cell ``j``'s
    patch. Sites of several calls of one module share a selector; the edit tells them by call."""
    by_selector: dict[str, dict[int, list[tuple[int, Cell]]]] = {}
    for copy, cell in enumerate(chunk):
        site = plan.sites[cell.site]
        by_selector.setdefault(site.write, {}).setdefault(site.read.call, []).append((copy, cell))
    return {selector: _site_edit(plan, calls) for selector, calls in by_selector.items()}


def _site_edit(
    plan: Plan, calls: dict[int, list[tuple[int, Cell]]]
) -> Callable[[torch.Tensor, EditContext], torch.Tensor]:
    rows = plan.base.rows
    sources = {call: plan.source[plan.sites[patches[0][1].site].read].detach() for call, patches in calls.items()}

    def patch(value: torch.Tensor, ctx: EditContext) -> torch.Tensor:
        patches = calls.get(ctx.call)
        if patches is None:
            return value
        clean = sources[ctx.call].to(device=value.device, dtype=value.dtype)
        patched = value.clone()
        for copy, cell in patches:
            layout = plan.layouts[cell.site]
            into = layout.part(patched[copy * rows : (copy + 1) * rows], cell.head, cell.position)
            into.copy_(layout.part(clean, cell.head, cell.position))
        return patched

    return patch


def patch_sweep(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    *,
    metric: MetricFn,
    layers: str | Sequence[str] | None = None,
    positions: Positions = "each",
    heads: Heads = False,
    num_heads: int | None = None,
    stack: str = "",
    direction: Direction = "denoise",
    batch_rows: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    sites: str | Sequence[str] | None = None,
    progress: bool | None = None,
) -> Effects:
    """Activation patching over every site × position (× head): the effect of each cell alone.

    Denoising (default) runs the corrupted input with one cell's value taken from the clean run;
    ``direction="noise"`` runs the clean input with the corrupted run's value. Each cell's score
    is ``metric`` on the patched output (the mean over rows), normalised to
    ``(patched - corrupted) / (clean - corrupted)``.

    Args:
        model: any ``nn.Module`` whose output the metric reads.
        clean, corrupted: the two inputs, paired row by row and of one shape: a tensor of token
            ids, a dict of keyword inputs, or a tuple of positional inputs.
        metric: one value per row (``hs.methods.logit_diff(correct, wrong)``, ``logprob``,
            ``kl_to``, ``loss``, or a function of the output); a function that returns a scalar
            is scored one patch per forward.
        layers: selectors of the values to patch (default every block's ``std:blocks.*.resid_pre``;
            with ``heads``, ``std:blocks.*.attn.z``). Where a value holds its positions follows
            from the site: an attention sub-site (``attn.z``, ``attn.pattern``, ``attn.q``, ...)
            is ``(batch, heads, seq, ...)``, any other value ``(batch, seq, ...)``.
        positions: ``"each"`` (every position on its own, default), a list of positions,
            ``"all"`` (every position at once: one column), or on a vision-language model
            ``"image"`` (``"text"``): each position holding an image (text) token in the clean rows.
        heads: ``True`` patches each head on its own, or a list of heads: dim 1 of an attention
            sub-site, or the last dim of a merged value read as ``num_heads`` blocks.
        num_heads: how many heads a merged ``(batch, seq, hidden)`` value holds (the input of
            attention's output projection), for ``heads=`` there; refused where missing.
        stack: an encoder-decoder's stack for the default sites: ``"decoder."`` or ``"encoder."``.
        batch_rows: rows per forward (default 64): ``batch_rows // rows`` patches run together.
        sites: the old name of ``layers=``, with a ``FutureWarning``.
        progress: show the patched cells done: ``None`` (default) on a terminal (a bar) and in a
            notebook (a line, once the sweep has run a second); ``True`` also as plain lines
            on a standard error that is neither (``HOOKSCOPE_PROGRESS_INTERVAL`` seconds apart);
            ``False`` never.

    Returns:
        :class:`~hookscope.methods.Effects`, dims ``("site", "position")`` or
        ``("site", "head", "position")``; ``.plot()`` draws the heatmap.

    Example::

        metric = hs.methods.logit_diff(correct=io_token, wrong=s_token)
        effects = hs.methods.patch_sweep(gpt2, clean_ids, corrupted_ids, metric=metric)
        effects.at("blocks.3.resid_pre", 5), effects.top(5)
        effects.plot().savefig("sweep.png")
    """
    sites = renamed(layers, sites, new_name="layers", old_name="sites", where="hs.methods.patch_sweep")
    ensure_loaded(model)  # a meta model: one line, not torch's error
    plan = plan_study(
        model, clean, corrupted, metric=metric, sites=sites, positions=positions, heads=heads, num_heads=num_heads,
        stack=stack, direction=direction, model_kwargs=model_kwargs, method="patch_sweep",
    )  # fmt: skip
    if batch_rows is not None and (isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1):
        raise SpecError(f"batch_rows={batch_rows!r}: expected a positive number of rows per forward")
    if progress is not None and not isinstance(progress, bool):
        raise SpecError(f"progress={progress!r}: expected True, False or None (on a terminal or in a notebook)")
    return plan.effects(run_cells(plan, plan.cells, batch_rows, progress), "patch_sweep")
