"""``attribution_patch``: the first-order estimate of a patching sweep from one backward.

Attribution patching (AtP) estimates the effect of patching a value by the gradient of the metric
at the patched run's value times the change the patch makes, ``grad · (source - target)``, summed
over the value's features: the linear term of the metric's Taylor expansion around the patched
run. Every cell of the sweep comes from one forward and one backward of the patched run (plus one
forward of the other run for the values), instead of one forward per cell.

The estimate is known to fail where the metric is far from linear in the value, most of all when
attention saturates: a softmax near one-hot has a gradient near zero, so a patch that flips which
token is attended to gets an estimate near zero, or of the wrong sign. ``verify=k`` runs the exact
patch for the ``k`` cells of largest estimate and lists those where the two disagree in sign
(:attr:`Effects.flags`); :meth:`Effects.compare` does the same against a full sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hookscope._core.compat.offload import ensure_loaded
from hookscope._methods.grid import Cell, Heads, Positions
from hookscope._methods.metrics import MetricFn
from hookscope._methods.result import Disagreement, Effects, disagree
from hookscope._methods.sweep import Direction, Plan, plan_study, run_cells
from hookscope._shared.options import renamed
from hookscope.errors import SpecError

__all__ = ["attribution_patch"]


def attribution_patch(
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
    verify: int = 0,
    min_effect: float = 0.05,
    model_kwargs: dict[str, Any] | None = None,
    sites: str | Sequence[str] | None = None,
) -> Effects:
    """Estimate :func:`patch_sweep`'s grid from one forward and backward: ``grad · (clean - corrupted)``.

    Arguments as in :func:`~hookscope.methods.patch_sweep` (the same cells, the same
    normalisation, so ``atp.correlation(sweep)`` and ``atp.compare(sweep)`` read cell for cell).
    ``verify=k`` also runs the exact patch of the ``k`` cells with the largest estimates (batched)
    and puts in ``effects.flags`` those where estimate and patch disagree in sign, moving the
    metric by at least ``min_effect`` (normalised): where the linear estimate is not to be trusted.

    Example::

        atp = hs.methods.attribution_patch(gpt2, clean_ids, corrupted_ids, metric=metric, verify=10)
        atp.correlation(hs.methods.patch_sweep(gpt2, clean_ids, corrupted_ids, metric=metric))
        atp.flags                                 # cells the estimate gets wrong
    """
    sites = renamed(layers, sites, new_name="layers", old_name="sites", where="hs.methods.attribution_patch")
    ensure_loaded(model)  # a meta model: one line, not torch's error
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise SpecError(f"verify={verify!r}: expected how many of the largest cells to patch exactly (0: none)")
    plan = plan_study(
        model, clean, corrupted, metric=metric, sites=sites, positions=positions, heads=heads, num_heads=num_heads,
        stack=stack, direction=direction, model_kwargs=model_kwargs, method="attribution_patch", grads=True,
    )  # fmt: skip
    per_site = [_per_position(plan, index, heads is not False) for index in range(len(plan.sites))]
    attributions = torch.stack([_cell(per_site[cell.site], cell, plan.per_row) for cell in plan.cells])
    effects = plan.effects(attributions + plan.base_score, "attribution_patch")
    if verify:
        effects.flags = _verified(plan, effects, verify, min_effect)
    return effects


def _per_position(plan: Plan, index: int, by_head: bool) -> torch.Tensor:
    """``grad · delta`` at one site summed over features: ``(batch, seq)``, or ``(batch, heads, seq)``.

    An entry both runs hold alike changes nothing, and one the metric does not depend on (a zero
    gradient) moves it by nothing to first order, whatever the change: both contribute 0. Causal
    attention scores hold ``-inf`` at every masked entry of both runs, where ``-inf - -inf`` is
    NaN and ``0 * NaN`` would make every cell NaN."""
    site = plan.sites[index]
    assert plan.grads is not None
    grad = plan.grads[site.read].double()
    source = plan.source[site.read].to(grad.device).double()
    target = plan.target[site.read].double()
    delta = torch.where(source == target, 0.0, source - target)
    product = torch.where(grad == 0, 0.0, grad * delta)
    return plan.layouts[index].summed(product, by_head).cpu()


def _cell(values: torch.Tensor, cell: Cell, per_row: bool) -> torch.Tensor:
    """One cell's estimate: its head and position (all positions: their sum), then over rows as
    the score is taken (the mean of per-row metrics; a scalar metric's gradient is of the whole batch)."""
    if cell.head is not None:
        values = values[:, cell.head]
    rows = values[:, cell.position] if cell.position is not None else values.sum(1)
    return rows.mean() if per_row else rows.sum()


def _verified(plan: Plan, effects: Effects, k: int, min_effect: float) -> list[Disagreement]:
    """The largest ``k`` cells patched exactly; those whose sign the estimate gets wrong."""
    flat = effects.values.reshape(-1).nan_to_num(0.0)
    chosen = flat.abs().argsort(descending=True)[:k].tolist()
    exact = plan.normalised(run_cells(plan, [plan.cells[i] for i in chosen], None)).tolist()
    effects.verified = {effects._labels(i): patched for i, patched in zip(chosen, exact, strict=True)}
    estimates = flat[chosen].tolist()
    return [
        Disagreement(effects._labels(index), estimate, patched)
        for index, estimate, patched in zip(chosen, estimates, exact, strict=True)
        if disagree(estimate, patched, min_effect)
    ]
