"""Mixture-of-experts load in a trace: tokens per expert, their share, routing weights, router entropy.

``hs.trace(model, x, experts=True)`` adds, for every fused experts module it traces
(:mod:`~hookscope._arch.experts`), a row per expert for ``expert.weights`` (its shape's first
dimension is the tokens the expert took, its mean their mean routing weight), and measures the
entropy of each layer's router: the router is the experts module's sibling named ``gate`` or
``router`` whose first output is one logit per expert, and its entropy the mean over tokens of
``H(softmax(logits))`` in nats (``log(experts)`` for a router that cannot choose, 0 for one that
always picks one expert), computed on the device and read with the statistics. A router that
scores by a sigmoid (DeepSeek-V3) routes by another distribution: its figure is still that of
the softmax of its logits.

:meth:`~hookscope.Trace.experts` reads them into an :class:`ExpertLoad`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookscope._arch.experts import fused_experts
from hookscope._core.attach import HookGroup
from hookscope._core.hook_spec import HookSpec
from hookscope._core.names import named_modules
from hookscope._core.op_sites import OpPattern, split_op_label
from hookscope._core.tree import flatten_tensors
from hookscope._shared.tables import Column, Table

__all__ = ["ExpertLoad", "ExpertRow", "RouterEntropy", "expert_load", "experts_patterns"]

_ROUTER = re.compile(r"^(gate|router)$")


def experts_patterns(modules: list[tuple[str, nn.Module]]) -> list[OpPattern]:
    """``expert.weights`` of every fused experts module among ``modules``."""
    return [OpPattern(name, None, "expert.weights") for name, module in modules if fused_experts(module) is not None]


def routers(model: nn.Module) -> list[tuple[str, str, nn.Module, int]]:
    """``(experts module, router module, router, expert count)`` of every fused experts module
    whose parent holds a child named ``gate`` or ``router``."""
    by_name = dict(named_modules(model))
    found = []
    for name, module in by_name.items():
        if fused_experts(module) is None:
            continue
        parent = name.rpartition(".")[0]
        for child, router in by_name[parent].named_children() if parent in by_name else []:
            if _ROUTER.match(child) and router is not module:
                found.append(
                    (name, f"{parent}.{child}" if parent else child, router, int(getattr(module, "num_experts", 0)))
                )
                break
    return found


class RouterEntropy:
    """Forward hooks on the routers that queue each call's mean entropy on the device; read per pass."""

    def __init__(self, model: nn.Module, foreign: Callable[[], bool], traced: set[str] | None = None) -> None:
        self.values: list[tuple[str, torch.Tensor]] = []
        specs = [
            HookSpec(router_name, router, "forward", self._hook(name, count, foreign), fitted=True)
            for name, router_name, router, count in routers(model)
            if traced is None or name in traced
        ]
        self.group = HookGroup(model, specs, owner="trace", restore_mode=False)

    def _hook(self, experts: str, count: int, foreign: Callable[[], bool]) -> Callable[..., None]:
        values = self.values

        def entropy(module: nn.Module, args: Any, output: Any) -> None:
            if foreign():
                return
            leaves = flatten_tensors(output, "")
            if not leaves or leaves[0][1].shape[-1] != count or not leaves[0][1].is_floating_point():
                return  # not one logit per expert: no figure rather than a wrong one
            with torch.no_grad():
                probabilities = torch.softmax(leaves[0][1].detach().float(), dim=-1)
                values.append((experts, torch.special.entr(probabilities).sum(-1).mean()))

        return entropy

    def take(self) -> list[tuple[str, torch.Tensor]]:
        """The pass's queued values, and a fresh list for the next pass."""
        taken = list(self.values)
        self.values.clear()
        return taken

    def remove(self) -> None:
        self.group.remove()


def read_entropy(values: list[tuple[str, torch.Tensor]]) -> dict[str, list[float]]:
    """Each experts module's router entropies, one per call, read with one transfer."""
    if not values:
        return {}
    numbers = torch.stack([value.to("cpu") for _, value in values]).tolist()
    read: dict[str, list[float]] = {}
    for (name, _), number in zip(values, numbers, strict=True):
        read.setdefault(name, []).append(float(number))
    return read


@dataclass(frozen=True)
class ExpertRow:
    """One expert of one experts module's call: the tokens it took, their share of the call's
    routed rows, and their mean routing weight (None where ``expert.weights`` was not traced)."""

    module: str
    call: int
    expert: int
    tokens: int
    share: float
    mean_weight: float | None


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per expert of every traced experts module call, and each layer's router entropy.

    ``print(load)`` shows one line per experts module call: tokens routed, the busiest expert's
    load over the mean (1.0: balanced), the router entropy, then the tokens per expert.
    """

    rows: list[ExpertRow]
    entropy: dict[str, list[float]] = field(default_factory=dict)

    def calls(self) -> list[tuple[str, int]]:
        """The experts module calls, in trace order."""
        return list(dict.fromkeys((row.module, row.call) for row in self.rows))

    def imbalance(self, module: str, call: int = 0) -> float:
        """The busiest expert's tokens over the mean tokens per expert (1.0: every expert alike)."""
        counts = [row.tokens for row in self.rows if (row.module, row.call) == (module, call)]
        mean = sum(counts) / len(counts) if counts else 0.0
        return max(counts) / mean if mean else math.nan

    def to_dicts(self) -> list[dict[str, Any]]:
        """One dict per expert row (for pandas: ``pd.DataFrame(load.to_dicts())``)."""
        return [row.__dict__.copy() for row in self.rows]

    def table(self) -> Table:
        """The table :meth:`__str__` prints (also as HTML in a notebook)."""
        right = ("rows", "max/mean", "router entropy")
        columns = [
            Column(h, "right" if h in right else "left") for h in ("experts module", *right, "tokens per expert")
        ]
        table = Table(columns, title="tokens per expert", notes=["router entropy: mean over tokens, nats"])
        for module, call in self.calls():
            counts = [row.tokens for row in self.rows if (row.module, row.call) == (module, call)]
            entropies = self.entropy.get(module, [])
            entropy = f"{entropies[call]:.3f}" if call < len(entropies) else "-"
            imbalance = f"{self.imbalance(module, call):.2f}"
            table.add(f"{module}#{call}", str(sum(counts)), imbalance, entropy, _counts(counts))
        return table

    def __str__(self) -> str:
        return self.table().text()

    def _repr_html_(self) -> str:
        return self.table().html()

    def __repr__(self) -> str:
        return f"<ExpertLoad of {len(self.calls())} experts module calls; print() it>"


def expert_load(rows: list[Any], entropy: dict[str, list[float]]) -> ExpertLoad:
    """The :class:`ExpertLoad` of a trace's rows (``op`` rows of ``expert.*``)."""
    counted: dict[tuple[str, int], dict[int, tuple[int, float | None]]] = {}
    for row in rows:
        if not row.op.startswith("expert.") or not row.outputs:
            continue
        kind, expert = split_op_label(row.op)
        per_call = counted.setdefault((row.name, row.call), {})
        tokens = int(row.outputs[0].shape[0])
        weight = per_call.get(expert, (tokens, None))[1]
        if kind == "expert.weights" and row.outputs[0].stats is not None:
            weight = float(row.outputs[0].stats.mean) if tokens else None
        per_call[expert] = (tokens, weight)
    found = []
    for (module, call), experts in counted.items():
        total = sum(tokens for tokens, _ in experts.values())
        for expert in sorted(experts):
            tokens, weight = experts[expert]
            found.append(ExpertRow(module, call, expert, tokens, tokens / total if total else 0.0, weight))
    return ExpertLoad(found, entropy)


def _counts(counts: list[int]) -> str:
    shown = " ".join(str(count) for count in counts[:16])
    return shown + (f" ... (+{len(counts) - 16})" if len(counts) > 16 else "")
