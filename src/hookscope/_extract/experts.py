"""Expert sub-sites in a store: each expert's rows put back at their tokens.

A capture keeps an expert's rows as the tap hands them on (:mod:`~hookscope._arch.experts`):
``(rows routed to the expert, ...)``, a count that changes from batch to batch. A store's
arrays are ``(N, ...)`` with one row per example, so an extraction scatters each expert's rows
back to the tokens they came from: ``expert.K#e`` is stored ``(N, seq, ...)`` with zeros at
the tokens not routed to expert ``e``; ``expert.tokens#e`` becomes the mask of the tokens that
were, ``(N, seq)`` booleans; ``expert.weights#e`` the routing weight per token, 0 elsewhere.

The tokens of every expert of the module are kept beside what is asked for (and dropped after),
because they say where each row goes and how many tokens the batch had (the experts module runs
on ``batch x seq`` rows; every token goes to at least one expert). A reduction of an expert
sub-site is refused: reduce the stored per-token array instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hookscope._core.op_sites import OpPattern, op_pattern, split_op_label
from hookscope._core.select import select
from hookscope._core.sites import Site
from hookscope.errors import SpecError

__all__ = ["ExpertRows"]


class ExpertRows:
    """The expert sub-site selectors of one extraction and how their rows become per-token arrays."""

    def __init__(self, model: nn.Module, ops: Sequence[str]) -> None:
        patterns = [pattern for text in ops if (pattern := op_pattern(text)) is not None]
        self.patterns = [pattern for pattern in patterns if pattern.op.startswith("expert.")]
        self._modules = {str(pattern): {name for name, _ in select(model, pattern.module)} for pattern in self.patterns}
        written = set(ops)
        #: The selectors added to keep every expert's tokens.
        self.companions = list(
            dict.fromkeys(
                text
                for pattern in self.patterns
                if (text := str(OpPattern(pattern.module, pattern.call, "expert.tokens"))) not in written
            )
        )

    def refuse_reduction(self, reduced: Sequence[str]) -> None:
        """Refuse a reduction of an expert sub-site (``reduced``: the op selectors reduced)."""
        for text in reduced:
            if text in {str(pattern) for pattern in self.patterns}:
                raise SpecError(
                    f"reduce applies to {text!r}, an expert sub-site: its rows are stored per token, (N, seq, ...) "
                    "with zeros at tokens not routed to the expert; store it unreduced (reduce={...} naming the other "
                    "layers only) and reduce the stored array"
                )

    def asked(self, site: Site) -> bool:
        """Whether ``site`` was asked for (not only kept for its tokens)."""
        name, index = split_op_label(site.op)
        return any(
            site.module in self._modules[str(pattern)] and pattern.op == name and pattern.matches(name, index)
            for pattern in self.patterns
        )

    def per_token(self, values: dict[Site, torch.Tensor], rows: int) -> dict[Site, torch.Tensor]:
        """``values`` with each expert sub-site's rows scattered to ``(rows, seq, ...)``."""
        if not self.patterns:
            return values
        tokens: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        for site, value in values.items():
            if site.op.startswith("expert.tokens#"):
                tokens.setdefault((site.module, site.call), {})[split_op_label(site.op)[1]] = value
        # how many tokens each experts module call ran on: every token goes to some expert
        totals = {key: 1 + int(torch.cat(list(rows.values())).max()) for key, rows in tokens.items()}
        found: dict[Site, torch.Tensor] = {}
        for site, value in values.items():
            if not site.op.startswith("expert."):
                found[site] = value
                continue
            if not self.asked(site):
                continue
            total = totals[(site.module, site.call)]
            if rows <= 0 or total % rows:
                raise SpecError(
                    f"{str(site)!r}: the experts module ran on {total} tokens, not a whole number per row of a batch "
                    f"of {rows}; an extraction stores experts per token of each row"
                )
            row_tokens = tokens[(site.module, site.call)][split_op_label(site.op)[1]]
            found[site] = _scattered(site, value, row_tokens, total).reshape(rows, total // rows, *value.shape[1:])
        return found


def _scattered(site: Site, value: torch.Tensor, row_tokens: torch.Tensor, total: int) -> torch.Tensor:
    if site.op.startswith("expert.tokens#"):
        mask = torch.zeros(total, dtype=torch.bool, device=value.device)
        mask[row_tokens] = True
        return mask
    dense = value.new_zeros((total, *value.shape[1:]))
    dense[row_tokens] = value
    return dense
