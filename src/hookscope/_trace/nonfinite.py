"""``detect_nonfinite()``: raise at the first module whose output is NaN/Inf while its inputs were not.

Cheaper than a full trace: one value per tensor (its sum, which is NaN or infinite exactly when
some element is; on the CPU, a sum that overflowed is told apart by ``aminmax``). On an
accelerator the sums are queued on the device and read once when the forward ends, so the
check costs about one pass over each activation and a single sync; ``raise_immediately=True``
reads each module's sums at once (a sync per module) to stop the forward at the culprit.

The error counts the NaN, +inf and -inf values it names, read once per pass for the one tensor
it names, while that tensor is at hand: where a call's sums are known as it returns (on the
CPU, or with ``raise_immediately``). On an accelerator the default check reads the sums after
the forward, when the tensor is gone: the error then names the kinds the sum shows, without
counts.

The blame rule is :mod:`hookscope._shared.blame`'s, as for :meth:`Trace.first_nonfinite`: the
first call to return whose output is non-finite and whose inputs are finite, or came from an
allow-listed module, or are -inf only in an input named like a mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookscope._core.names import leaf_label, module_label, named_modules
from hookscope._core.select import Selector, ensure_module, select
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope._shared.blame import blame, fine_input
from hookscope._shared.call_recorder import Args, CallRecorder, Handled, Kwargs, OpenCall, Watched
from hookscope._shared.identity import SeenTensors
from hookscope._shared.stats import Stats, accumulator, flat_values, is_measurable, kernel, tensor_stats, unexpanded
from hookscope.errors import NonFiniteError

__all__ = ["NonFiniteDetector", "detect_nonfinite"]

# A leaf's signature: 0.0 when finite, -inf when it holds -inf and no NaN/+inf, NaN otherwise;
# on an accelerator, the device tensor of its sum until the pass ends.
Signature = float | torch.Tensor


@dataclass
class _Leaf:
    path: str
    signature: Signature
    source: str | None = None
    total: float = 0.0  # the sum once read (NaN, +inf or -inf when not finite), for the message
    counts: Stats | None = None  # counted only for the leaf an error would name (see the module doc)


@dataclass(eq=False)
class _Call(OpenCall[Watched]):
    inputs: list[_Leaf]
    outputs: list[_Leaf] = field(default_factory=list)


def signature(tensor: torch.Tensor) -> Signature:
    """What :mod:`nonfinite` needs of a tensor, without a host sync off the CPU."""
    if not tensor.is_floating_point() or not is_measurable(tensor):
        return 0.0  # integers and booleans are always finite; meta tensors hold no values
    values = flat_values(unexpanded(tensor.detach())[0])  # an expanded view: the values it repeats
    if values.numel() == 0:
        return 0.0
    if values.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        values = values.to(torch.float32)  # float8 and other types without a sum kernel
    if values.device.type != "cpu":  # sum in float64: finite values cannot overflow it
        return values.sum(dtype=accumulator(values.device))
    if kernel.all_finite(values):  # the exponent bits alone, in one light pass (the fused kernel)
        return 0.0
    total = float(values.sum(dtype=torch.float32) if values.dtype in (torch.float16, torch.bfloat16) else values.sum())
    if math.isfinite(total):
        return 0.0
    low, high = (float(v) for v in torch.aminmax(values))  # NaN propagates into both
    if math.isnan(low) or math.isnan(high) or high == math.inf:
        return math.nan
    return -math.inf if low == -math.inf else 0.0  # else: finite values whose sum overflowed


def _kind(value: float) -> float:
    if math.isnan(value) or value == math.inf:
        return math.nan
    return -math.inf if value == -math.inf else 0.0


class NonFiniteDetector(CallRecorder[Watched, _Call]):
    """Hooks that raise :class:`~hookscope.errors.NonFiniteError` at the module making the first NaN/Inf.

    Made by :func:`detect_nonfinite`; removed on leaving the ``with`` block or by ``remove()``.
    """

    feature = "detect_nonfinite"

    def __init__(
        self,
        model: nn.Module,
        *,
        allow: Selector | Sequence[Selector] | None,
        raise_immediately: bool,
    ) -> None:
        ensure_module(model)
        chosen: Any = list(allow) if isinstance(allow, (list, tuple)) else allow
        self._allowed = {name for name, _ in select(model, chosen)} if allow is not None else set()
        self._immediately = raise_immediately
        self._calls: list[_Call] = []
        self._counted = False  # the pass's culprit is counted already: later calls are not
        self._seen: SeenTensors[tuple[Signature, str | None]] = SeenTensors()
        super().__init__(model, named_modules(model))

    # -- calls (told by the recorder's hooks) -------------------------------------------------------

    def open_call(self, site: Watched, call: int, handled: Handled, args: Args, kwargs: Kwargs) -> _Call:
        """Sign the call's inputs (a tensor seen before keeps its signature and its source); the
        model's own call counts its non-finite inputs, which the error names if no module is blamed."""
        leaves = call_leaves(args, kwargs)
        record = _Call(site, call, handled, [self._leaf(path, t, None) for path, t in leaves])
        if not self.opened:  # the pass's opener: what came in with the input
            self._count(record.inputs, [t for _, t in leaves], lambda leaf: not self._accepted(leaf))
        return record

    def close_call(self, draft: _Call, output: Any) -> None:
        """Sign the outputs, count them if the call is the culprit; with ``raise_immediately``,
        judge the call now."""
        site = f"{draft.site.name}#{draft.call}"
        tensors = flatten_tensors(output, "")
        draft.outputs = [self._leaf(path, t, site) for path, t in tensors]
        self._calls.append(draft)
        if not self._counted and self._culprit(draft):
            self._counted = True
            self._count(draft.outputs, [t for _, t in tensors], lambda leaf: float(leaf.signature) != 0.0)
        if self._immediately:
            self._settle([draft])
            self._check([draft], final=False)

    def _culprit(self, draft: _Call) -> bool:
        """Whether the blame rule names this call, asked as it returns: a call's sums are known
        then on the CPU (and under ``raise_immediately``), and the first call named is the culprit."""
        if not self._known(draft.outputs) or self._output_fine(draft):
            return False
        return self._known(draft.inputs) and self._inputs_fine(draft)

    def _known(self, leaves: list[_Leaf]) -> bool:
        """Whether the leaves' sums are on the host; settled now under ``raise_immediately``."""
        if self._immediately:
            _settle_leaves(leaves)
        return not any(isinstance(leaf.signature, torch.Tensor) for leaf in leaves)

    def _count(self, leaves: list[_Leaf], tensors: list[torch.Tensor], bad: Callable[[_Leaf], bool]) -> None:
        """Count the NaN and Inf values of the ``bad`` leaves, whose tensors are at hand."""
        if not self._known(leaves):
            return
        for leaf, tensor in zip(leaves, tensors, strict=True):
            if bad(leaf) and is_measurable(tensor):
                leaf.counts = tensor_stats(tensor)

    def _leaf(self, path: str, tensor: torch.Tensor, producer: str | None) -> _Leaf:
        known = self._seen.get(tensor)
        if known is not None:
            return _Leaf(path, known[0], known[1])
        value = signature(tensor)
        self._seen.put(tensor, (value, producer))
        return _Leaf(path, value, None)

    # -- passes (told by the recorder) --------------------------------------------------------------

    def start_pass(self, module: nn.Module) -> None:
        """A new pass: forget the last one."""
        self._calls = []
        self._seen.clear()
        self._counted = False

    def end_pass(self, module: nn.Module, error: BaseException | None) -> None:
        """Read every sum at once and blame the first module that made a NaN/Inf."""
        calls, self._calls = self._calls, []
        self._seen.clear()
        if error is not None:
            return  # the forward raised: its own error is the news
        self._settle(calls)
        self._check(calls, final=True)

    def abandon_pass(self) -> None:
        """The previous pass was cut short."""
        self._calls = []
        self._seen.clear()

    @staticmethod
    def _settle(calls: list[_Call]) -> None:
        """Replace device sums by their kinds: one stack and transfer per device."""
        _settle_leaves([leaf for record in calls for leaf in (*record.inputs, *record.outputs)])

    def _check(self, calls: list[_Call], *, final: bool) -> None:
        """Raise at the call the blame rule names; at the end of a pass, also at a NaN/Inf that
        came in with the model's input."""
        culprit = blame(calls, output_fine=self._output_fine, inputs_fine=self._inputs_fine)
        if culprit is not None:
            bad = next(leaf for leaf in culprit.outputs if leaf.signature != 0.0)
            name = culprit.site.name
            raise NonFiniteError(
                f"{_kinds(bad)} first {_appear(bad)} in {leaf_label('output', bad.path)} of {module_label(name)!r} "
                f"({culprit.site.class_name}, call {culprit.call}): its inputs were finite, and it made "
                f"{_counted(bad)}. hs.trace(model, ...).first_nonfinite() shows its input and output statistics; "
                "if these values are intended (a -inf mask), pass allow=[...] naming the module",
                module=name,
                call=culprit.call,
                what="output",
                path=bad.path,
                **_fields(bad),
            )
        if final and calls:
            root = calls[-1]  # the pass's opener returns last
            bad_inputs = [leaf for leaf in root.inputs if not self._accepted(leaf)]
            if bad_inputs and any(leaf.signature != 0.0 for leaf in root.outputs):
                first = bad_inputs[0]
                shown = ", ".join(leaf_label("input", leaf.path) for leaf in bad_inputs)
                raise NonFiniteError(
                    f"the NaN/Inf came in with the input: {shown} of "
                    f"{module_label(root.site.name)!r} ({root.site.class_name}) is not finite; "
                    f"{leaf_label('input', first.path)} holds {_counted(first)}",
                    module=root.site.name,
                    call=root.call,
                    what="input",
                    path=first.path,
                    **_fields(first),
                )

    def _output_fine(self, record: _Call) -> bool:
        """Finite, or intended: a module in ``allow`` is never blamed."""
        return record.site.name in self._allowed or all(leaf.signature == 0.0 for leaf in record.outputs)

    def _inputs_fine(self, record: _Call) -> bool:
        return all(self._accepted(leaf) for leaf in record.inputs)

    def _accepted(self, leaf: _Leaf) -> bool:
        value = float(leaf.signature)
        return fine_input(
            leaf.path, leaf.source, finite=value == 0.0, negative_inf_only=value == -math.inf, allowed=self._allowed
        )


def _settle_leaves(leaves: list[_Leaf]) -> None:
    """Replace the device sums among ``leaves`` by their kinds: one stack and transfer per device."""
    pending: dict[torch.device, list[_Leaf]] = {}
    for leaf in leaves:
        if isinstance(leaf.signature, torch.Tensor):
            pending.setdefault(leaf.signature.device, []).append(leaf)
        elif leaf.signature != 0.0 and leaf.total == 0.0:
            leaf.total = float(leaf.signature)  # on the CPU the signature is the kind already
    for on_device in pending.values():
        values = torch.stack([leaf.signature for leaf in on_device]).cpu().tolist()  # type: ignore[misc]
        for leaf, value in zip(on_device, values, strict=True):
            leaf.total, leaf.signature = value, _kind(value)


_KINDS = (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf"))


def _kinds(leaf: _Leaf) -> str:
    """The kinds of non-finite value a leaf holds: counted, or read from its sum."""
    if leaf.counts is not None:
        return " and ".join(word for field, word in _KINDS if getattr(leaf.counts, field))
    if math.isnan(leaf.total):
        return "NaN or Inf"  # a NaN, or +inf and -inf together
    return "+inf" if leaf.total > 0 else "-inf"


def _appear(leaf: _Leaf) -> str:
    return "appear" if " and " in _kinds(leaf) else "appears"  # "NaN appears", "NaN and -inf appear"


def _counted(leaf: _Leaf) -> str:
    """``3 NaN and 2 -inf values (of 4096)``; without counts, the kinds and how to count them."""
    counts = leaf.counts
    if counts is None:
        return f"{_kinds(leaf)} values (counted with raise_immediately=True)"
    shown = " and ".join(f"{getattr(counts, field):,} {word}" for field, word in _KINDS if getattr(counts, field))
    plural = "value" if counts.nan + counts.inf == 1 else "values"
    return f"{shown} {plural} (of {counts.count:,})"


def _fields(leaf: _Leaf) -> dict[str, int | None]:
    counts = leaf.counts
    if counts is None:
        return {"nan": None, "posinf": None, "neginf": None}
    return {"nan": counts.nan, "posinf": counts.posinf, "neginf": counts.neginf}


def detect_nonfinite(
    model: nn.Module,
    *,
    allow: Selector | Sequence[Selector] | None = None,
    raise_immediately: bool = False,
) -> NonFiniteDetector:
    """Raise :class:`~hookscope.errors.NonFiniteError` naming the module that makes the first NaN/Inf.

    Every module is watched; the error names the module, its call index and the output leaf of
    the first call (in the order calls return) whose output holds a NaN or Inf while its inputs
    did not. By default the check reads the device once, when the forward ends, and the error
    comes from the ``model(x)`` call; ``raise_immediately=True`` stops the forward at the
    culprit, at the cost of a host sync per module on an accelerator. (By default the one sync
    is in the model's last hook: on CUDA, the single read of all the sums.)

    ``allow`` is a selector (or list) of modules whose non-finite outputs are intended, such as
    a module that builds a -inf attention mask: they are not blamed, and what they return
    counts as finite downstream. -inf alone in an input named like a mask
    (``attention_mask=``) is accepted without it.

    >>> import torch, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.LogSigmoid(), nn.Linear(2, 1))
    >>> with hs.detect_nonfinite(model):
    ...     _ = model(torch.randn(4, 2))         # all finite: nothing happens
    >>> with torch.no_grad():
    ...     _ = model[0].bias.fill_(float("nan"))
    >>> with hs.detect_nonfinite(model):
    ...     model(torch.randn(4, 2))
    Traceback (most recent call last):
    ...
    hookscope.errors.NonFiniteError: NaN first appears in output of '0' (Linear, call 0): ...
    """
    return NonFiniteDetector(model, allow=allow, raise_immediately=raise_immediately)
