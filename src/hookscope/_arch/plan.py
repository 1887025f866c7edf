"""Make a feature's site plan: canonical names expanded, op selectors split, their modules found.

The one way a capture, an edit and a trace turn what they were given into a
:class:`~hookscope._core.plan.SitePlan`, which :func:`~hookscope._core.plan.attach_plan` then
attaches. It lives in this layer, not in the core, because two of its steps are model knowledge:
what a ``std:`` name is on this model (:func:`~hookscope._arch.std.expand_std`) and how an
attention module lays out its heads (:class:`~hookscope._arch.op_selectors.OpSelectors`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from hookscope._arch.op_selectors import OpSelectors
from hookscope._arch.std import expand_std
from hookscope._core.op_sites import OpPattern
from hookscope._core.plan import SitePlan, Use, split_op_selectors
from hookscope._core.select import Selector
from hookscope.errors import HookscopeError

__all__ = ["expand_sites", "plan_sites"]


def expand_sites(model: nn.Module, selectors: Selector | Sequence[Selector], use: Use) -> SitePlan[OpSelectors]:
    """``selectors`` with canonical names expanded for ``use`` and op selectors parsed apart, with
    nothing watched yet (:attr:`~hookscope._core.plan.SitePlan.ops` is None): what one selector
    of an edit stands for, before the edit's op selectors are planned together."""
    expanded, std = expand_std(model, selectors, use)  # "std:blocks.*.attn" -> site selectors
    patterns, others = split_op_selectors(expanded)
    return SitePlan(others, patterns, std)


def plan_sites(
    model: nn.Module,
    selectors: Selector | Sequence[Selector] | None,
    use: Use,
    *,
    owner: str,
    error: type[HookscopeError],
    patterns: Sequence[OpPattern] = (),
    check: Callable[[list[OpPattern]], None] | None = None,
) -> SitePlan[OpSelectors]:
    """The plan of ``selectors`` on ``model``, for a feature that does ``use`` at its sites.

    Args:
        model: the model the feature attaches to.
        selectors: what the feature was given (``std:`` names, op selectors and module
            selectors, lists too); ``()`` when it plans op selectors alone.
        use: ``"read"``, ``"write"`` or ``"module"``: which site a canonical name stands for.
        owner: the ``hs.`` verb, named in errors and in ``hs.attached``.
        error: the feature's error type for an op selector that never fired.
        patterns: op selectors already parsed (a trace's ``ops=``, an edit's), planned first.
        check: told the op selectors before any module is looked for (a capture refuses them
            with ``stop=True``).
    """
    given = expand_sites(model, selectors, use) if selectors is not None else SitePlan([], [])
    wanted = [*patterns, *given.patterns]
    if check is not None:
        check(wanted)
    ops = OpSelectors(model, wanted, owner=owner, error=error) if wanted else None
    return SitePlan(given.selectors, wanted, given.std, ops)
