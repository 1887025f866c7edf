"""Experts as sites: a tap on transformers' fused mixture-of-experts computation.

Since transformers 5 a mixture-of-experts layer keeps all its experts in one module (a class
decorated with ``@use_experts_implementation``: ``gate_up_proj`` and ``down_proj`` hold every
expert as one 3-D weight) and computes them in one grouped matrix product: there is no module
per expert for a hook to see. The class's forward asks an *experts interface* (a registry of
implementations: ``eager``, ``grouped_mm``, ``batched_mm`` ...) for the function to run, by the
name in ``config._experts_implementation``. That dispatch is the tap:

- **Untapped, nothing changes.** While no expert sub-site is selected the interface holds
  transformers' own functions: the output is bit-identical to no hookscope, at no cost. While one
  is (a capture, trace, edit or extraction of ``"...experts:expert.post"``), each implementation
  name of the interface answers with a dispatcher that hands every experts module it is not
  tapping straight to the function it replaced (the same function, the same bits).
- **Tapped, the experts run as** ``grouped_mm`` **computes them**, step by step, with each
  expert's rows handed to the op watches of the module between the steps
  (:func:`~hookscope._core.op_mode.report_value`): the routed hidden states (``in``), the gate
  and linear projections (``pre``, ``up``; ``pre`` alone for an expert without a gate), the
  activation's output (``post``), the expert's output before its routing weight (``out``), the
  token of each row (``tokens``: the row of the module's input, ``batch * seq`` flattened) and
  its routing weight (``weights``). A watch's replacement is what the rest of the computation
  uses (an edit of one expert feeds the output); rows are in token order within each expert.
  Where the model runs ``grouped_mm`` (transformers' default) the tapped output is bit-identical
  to the untapped one; under ``eager`` or ``batched_mm`` it equals it within rounding (the
  products are summed in another order).
- **Refused**, with the reason, where the rows cannot be read this way: expert parallelism
  (another rank holds some experts), an implementation whose arithmetic differs (``deepgemm``,
  ``sonicmoe``, FP8 experts: their kernels quantize), and a class whose forward is not
  transformers' dispatch.

Cost while tapped: one host synchronisation per layer (the rows per expert, to slice them), the
slices handed on (views), and a concatenation per edited value or per value a backward must
reach through its slices.

>>> from hookscope._arch.experts import fused_experts
>>> fused_experts(torch.nn.Linear(2, 2)) is None
True
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope._core.compat.private import torch_functions_off
from hookscope._core.names import module_label
from hookscope._core.op_mode import Frames, hookscope_work, open_frames, report_value
from hookscope.errors import EditError, SpecError

__all__ = ["TAPPABLE", "TAPS", "ExpertsTap", "FusedExperts", "experts_problem", "fused_experts", "tap_experts"]

#: The implementations whose arithmetic the tap reproduces (``grouped_mm`` bit for bit).
TAPPABLE = ("grouped_mm", "eager", "batched_mm")
_ABSENT = object()


@dataclass(frozen=True)
class FusedExperts:
    """What a fused experts class dispatches through: the interface it asks and its own
    (``eager``) forward."""

    interface: MutableMapping[str, Callable[..., Any]]
    original: Callable[..., Any]


def fused_experts(module: nn.Module) -> FusedExperts | None:
    """The experts dispatch of ``module``'s class (``@use_experts_implementation``), or None for
    any other module: read from the class forward's closure, which holds the interface and the
    forward it wraps."""
    forward = getattr(type(module), "forward", None)
    code, closure = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure, strict=False))
    if "experts_interface" not in cells or "original_forward" not in cells:
        return None
    try:
        interface, original = cells["experts_interface"].cell_contents, cells["original_forward"].cell_contents
    except ValueError:  # an empty cell
        return None
    if not isinstance(interface, MutableMapping) or not callable(original):
        return None
    return FusedExperts(interface, original)


def experts_problem(module: nn.Module, name: str, kinds: set[str]) -> str | None:
    """Why expert sub-sites ``kinds`` cannot be read at ``module`` (``name``), or None."""
    where = f"{module_label(name)!r} ({type(module).__name__})"
    if fused_experts(module) is None:
        return (
            f"{where} is not a fused mixture-of-experts module (a transformers class with "
            "@use_experts_implementation, whose experts are one 3-D weight): expert sub-sites select the module "
            "holding the experts, e.g. 'model.layers.0.mlp.experts:expert.post'; a model whose experts are "
            "modules of their own is read at those modules"
        )
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    if implementation not in TAPPABLE:
        return (
            f"{where} runs experts_implementation={implementation!r}, whose kernel computes what the tap cannot "
            f"reproduce; load the model with experts_implementation='grouped_mm' (or one of {', '.join(TAPPABLE)})"
        )
    if getattr(module, "_is_expert_parallel", False):
        return f"{where} runs under expert parallelism: this rank does not hold every expert's rows"
    weight = getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.element_size() < 2:
        return f"{where} keeps its expert weights quantized or in another form than one float 3-D tensor"
    if "up" in kinds and not getattr(module, "has_gate", True):
        return f"{where} has experts without a gate: their one projection before the activation is expert.pre"
    return None


class ExpertsTap:
    """The experts modules tapped now, and the interfaces whose names answer with dispatchers.

    One per process: taps of several features on one module (a capture and an edit) add up; an
    interface gets its dispatchers with the first tap of one of its modules and loses them with
    the last one's removal, so that outside every tap transformers' own functions run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted: dict[int, list[frozenset[tuple[str, int]]]] = {}
        #: Per tapped module, the union of its taps' pairs: what a call reads, kept current here.
        self._union: dict[int, frozenset[tuple[str, int]]] = {}
        #: Each tapped class's own forward: what ``eager`` runs where no function is registered.
        self._originals: dict[type, Callable[..., Any]] = {}
        self._interfaces: dict[int, tuple[MutableMapping[str, Callable[..., Any]], dict[str, Any], int]] = {}

    def add(self, module: nn.Module, wanted: frozenset[tuple[str, int]]) -> Callable[[], None]:
        """Tap ``module`` for the ``(kind, expert)`` pairs in ``wanted``; returns the removal."""
        fused = fused_experts(module)
        if fused is None:  # refused by the caller already
            raise SpecError(f"{type(module).__name__} is not a fused experts module")
        with self._lock:
            self._wanted.setdefault(id(module), []).append(wanted)
            self._union[id(module)] = frozenset().union(*self._wanted[id(module)])
            self._originals[type(module)] = fused.original
            key = id(fused.interface)
            interface, saved, count = self._interfaces.get(key, (fused.interface, {}, 0))
            if count == 0:
                saved = self._install(interface)
            self._interfaces[key] = (interface, saved, count + 1)
        removed = False

        def remove() -> None:
            nonlocal removed
            with self._lock:
                if removed:
                    return
                removed = True
                sets = self._wanted.get(id(module), [])
                if wanted in sets:
                    sets.remove(wanted)
                if sets:
                    self._union[id(module)] = frozenset().union(*sets)
                else:
                    self._wanted.pop(id(module), None)
                    self._union.pop(id(module), None)
                interface, saved, count = self._interfaces[key]
                if count == 1:
                    self._uninstall(interface, saved)
                    del self._interfaces[key]
                else:
                    self._interfaces[key] = (interface, saved, count - 1)

        return remove

    def wanted(self, module: nn.Module) -> frozenset[tuple[str, int]] | None:
        """The ``(kind, expert)`` pairs tapped at ``module``, or None where it is not tapped."""
        return self._union.get(id(module))

    def _install(self, interface: MutableMapping[str, Callable[..., Any]]) -> dict[str, Any]:
        local: dict[str, Any] = getattr(interface, "_local_mapping", {})
        saved = {name: local.get(name, _ABSENT) for name in {*interface, "eager"}}
        for name in saved:
            interface[name] = self._dispatcher(name, interface.get(name))
        return saved

    @staticmethod
    def _uninstall(interface: MutableMapping[str, Callable[..., Any]], saved: dict[str, Any]) -> None:
        local: dict[str, Any] = getattr(interface, "_local_mapping", {})
        for name, before in saved.items():
            if before is _ABSENT:
                local.pop(name, None)
            else:
                interface[name] = before

    def _dispatcher(self, name: str, base: Callable[..., Any] | None) -> Callable[..., Any]:
        union, originals = self._union, self._originals

        def dispatch(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            wanted = union.get(id(module))
            if wanted is not None and (frames := open_frames(module)):
                return _tapped(module, wanted, frames, *args, **kwargs)
            if base is not None:
                return base(module, *args, **kwargs)
            return (originals.get(type(module)) or _original(module))(module, *args, **kwargs)

        dispatch.__name__ = f"hookscope_tap_{name}"
        return dispatch


def _original(module: nn.Module) -> Callable[..., Any]:
    """The class's own forward of an experts module no tap has met (another model of the process)."""
    fused = fused_experts(module)
    if fused is None:  # only experts classes ask an experts interface
        raise SpecError(f"{type(module).__name__} asked an experts interface but is no experts class")
    return fused.original


#: The process's experts taps.
TAPS = ExpertsTap()


def tap_experts(module: nn.Module, wanted: frozenset[tuple[str, int]]) -> Callable[[], None]:
    """Tap ``module``'s experts for ``wanted`` ``(kind, expert)`` pairs; returns the removal."""
    return TAPS.add(module, wanted)


_NAMES = {"hidden_states": 0, "top_k_index": 1, "router_indices": 1, "top_k_weights": 2, "routing_weights": 2}


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden states, top-k expert index, top-k weight)`` of an experts call, by position or name."""
    found: list[Any] = [*args, None, None, None][:3]
    for key, value in kwargs.items():
        if key in _NAMES:
            found[_NAMES[key]] = value
    if not all(isinstance(value, torch.Tensor) for value in found):
        raise SpecError(
            "an experts module was called without (hidden_states, top_k_index, top_k_weights) tensors; the tap reads "
            "transformers' experts interface, which passes those"
        )
    return found[0], found[1], found[2]


class _Rows:
    """Rows sorted by expert, the bounds of each expert's, and the hand-over of one value."""

    def __init__(self, frames: Frames, wanted: frozenset[tuple[str, int]], bounds: list[int]) -> None:
        self.frames, self.wanted, self.bounds = frames, wanted, bounds
        self.experts = len(bounds) - 1

    def report(self, kind: str, value: torch.Tensor, *, editable: bool = True) -> torch.Tensor:
        """Hand each wanted expert's rows of ``value`` to the watches; the value the computation
        goes on with (rebuilt from the rows where one was replaced, or where a backward must
        reach each row through the slice that was handed on)."""
        experts = [e for e in range(self.experts) if (kind, e) in self.wanted]
        if not experts:
            return value
        bounds = self.bounds
        with torch_functions_off():
            pieces = [value[bounds[e] : bounds[e + 1]] for e in range(self.experts)]
        changed = False
        for e in experts:
            got = report_value(self.frames, f"expert.{kind}", e, pieces[e])
            if got is pieces[e]:
                continue
            if not editable:
                raise EditError(
                    f"expert.{kind}#{e} is which token each row of expert {e} is: it cannot be edited; change the "
                    "routing at expert.weights (a weight of 0 drops a row), or at the experts module's inputs "
                    "(std:blocks.{i}.mlp.router.weights and .choice)"
                )
            if not isinstance(got, torch.Tensor) or got.shape != pieces[e].shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise EditError(
                    f"expert.{kind}#{e} was replaced by {shape}, expected a tensor of the rows' shape "
                    f"{tuple(pieces[e].shape)}"
                )
            pieces[e] = got.to(value.dtype)
            changed = True
        if changed or (torch.is_grad_enabled() and value.requires_grad):
            with torch_functions_off():
                return torch.cat(pieces)
        return value


def _split_gate(module: nn.Module, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = gate_up.size(-1) // 2
    if getattr(module, "is_concatenated", True):
        return gate_up[..., :half], gate_up[..., half:]
    return gate_up[..., 0::2], gate_up[..., 1::2]


def _join_gate(module: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if getattr(module, "is_concatenated", True):
        return torch.cat([gate, up], dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


@functools.cache
def _transformers_grouped_linear() -> Callable[..., torch.Tensor] | None:
    """transformers' private ``_grouped_linear`` (the dispatch to ``grouped_mm``), where it has
    one; looked up once."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    found = getattr(moe, "_grouped_linear", None)
    return found if callable(found) else None


def _grouped_linear(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bounds: list[int], bias: Any, transposed: bool
) -> torch.Tensor:
    """transformers' grouped product where it has one (the same kernel: the same bits), else
    one product per expert."""
    grouped = _transformers_grouped_linear()
    if grouped is not None:
        return grouped(rows, weight, offsets, bias=bias, is_transposed=transposed)
    pieces = []
    for e in range(len(bounds) - 1):
        w = weight[e] if transposed else weight[e].t()
        pieces.append(rows[bounds[e] : bounds[e + 1]] @ w.to(rows.dtype))
    out = torch.cat(pieces)
    return out + bias if bias is not None else out


def _tapped(
    module: nn.Module, wanted: frozenset[tuple[str, int]], frames: Frames, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """The experts computed as transformers' ``grouped_mm`` computes them, each expert's rows
    handed on between the steps (module docstring). hookscope's own arithmetic runs with torch
    function modes off (no watch would report it, and the mode's Python call per op was most of
    the tap's cost); the model's own code (its gate function, activation and norm) runs with them on."""
    hidden, top_k_index, top_k_weights = _arguments(args, kwargs)
    m: Any = module
    gated, transposed = bool(getattr(m, "has_gate", True)), bool(getattr(m, "is_transposed", False))
    has_bias = bool(getattr(m, "has_bias", False))
    with hookscope_work():
        with torch_functions_off():
            experts = int(m.num_experts)
            top_k, tokens, width = top_k_index.size(-1), hidden.size(0), hidden.size(-1)
            ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)  # rows in token order within an expert
            token_of_row = perm // top_k
            rows = hidden[token_of_row]
            weight_of_row = top_k_weights.reshape(-1)[perm]
            offsets = torch.cumsum(torch.bincount(ids, minlength=experts), dim=0, dtype=torch.int32)
            at = _Rows(frames, wanted, [0, *offsets.tolist()])  # the one host synchronisation
        rows = at.report("in", rows)
        with torch_functions_off():
            first = m.gate_up_proj if gated else m.up_proj
            first_bias = (m.gate_up_proj_bias if gated else m.up_proj_bias)[ids] if has_bias else None
            projected = _grouped_linear(rows, first, offsets, at.bounds, first_bias, transposed)
        if gated:
            if any(kind in ("pre", "up") for kind, _ in wanted):
                with torch_functions_off():
                    gate, up = _split_gate(module, projected)
                new_gate, new_up = at.report("pre", gate), at.report("up", up)
                if new_gate is not gate or new_up is not up:
                    projected = _join_gate(module, new_gate, new_up)
            post = m._apply_gate(projected)
        else:
            post = m.act_fn(at.report("pre", projected))
        post = at.report("post", post)
        with torch_functions_off():
            second_bias = m.down_proj_bias[ids] if has_bias else None
            out = _grouped_linear(post, m.down_proj, offsets, at.bounds, second_bias, transposed)
        if getattr(m, "has_post_expert_norm", False):
            out = m.post_expert_norm(out)
        out = at.report("out", out)
        at.report("tokens", token_of_row, editable=False)
        weight_of_row = at.report("weights", weight_of_row)
        with torch_functions_off():
            weighted = out * weight_of_row.unsqueeze(-1)
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.size(0), device=perm.device)
            weighted = weighted[inverse]
            return weighted.view(tokens, top_k, width).sum(dim=1).to(hidden.dtype)
