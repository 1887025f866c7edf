"""``detect_nonfinite()``: raise at the first module whose output is NaN/Inf while its inputs were not.

Cheaper than a full trace: one value per tensor (its sum, which is NaN or infinite exactly when
some element is; on the CPU, a sum that overflowed is told apart by ``aminmax``). On an
accelerator the sums are queued on the device and read once when the forward ends, so the
check costs about one pass over each activation and a single sync; ``raise_immediately=True``
reads each module's sums at once (a sync per module) to stop the forward at the culprit.

The blame rule is :meth:`Trace.first_nonfinite`'s: the first call to return whose output is
non-finite and whose inputs are finite, or came from an allow-listed module, or are -inf only
in an input named like a mask.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookscope._core.attach import HookGroup, HookSpec, Scoped
from hookscope._core.names import named_modules
from hookscope._core.select import Selector, ensure_module, select
from hookscope._core.sites import REPLICAS_HINT, CallTracker
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope._shared.identity import SeenTensors
from hookscope._shared.stats import accumulator, flat_values, is_measurable
from hookscope._trace.result import MASK_WORDS
from hookscope.errors import HookscopeError, NonFiniteError

__all__ = ["NonFiniteDetector", "detect_nonfinite"]

# A leaf's signature: 0.0 when finite, -inf when it holds -inf and no NaN/+inf, NaN otherwise;
# on an accelerator, the device tensor of its sum until the pass ends.
Signature = float | torch.Tensor


@dataclass
class _Leaf:
    path: str
    signature: Signature
    source: str | None = None


@dataclass
class _Call:
    name: str
    class_name: str
    call: int
    module_id: int
    handled: BaseException | None  # the exception being handled when the call began, if any
    inputs: list[_Leaf]
    outputs: list[_Leaf] = field(default_factory=list)


def signature(tensor: torch.Tensor) -> Signature:
    """What :mod:`nonfinite` needs of a tensor, without a host sync off the CPU."""
    if not tensor.is_floating_point() or not is_measurable(tensor):
        return 0.0  # integers and booleans are always finite; meta tensors hold no values
    values = flat_values(tensor.detach())
    if values.numel() == 0:
        return 0.0
    if values.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        values = values.to(torch.float32)  # float8 and other types without a sum kernel
    if values.device.type != "cpu":  # sum in float64: finite values cannot overflow it
        return values.sum(dtype=accumulator(values.device))
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


class NonFiniteDetector(Scoped):
    """Hooks that raise :class:`~hookscope.errors.NonFiniteError` at the module making the first NaN/Inf.

    Made by :func:`detect_nonfinite`; removed on leaving the ``with`` block or by ``remove()``.
    """

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
        self._tracker = CallTracker(listener=self)
        self._calls: list[_Call] = []
        self._open: list[_Call] = []
        self._seen: SeenTensors[tuple[Signature, str | None]] = SeenTensors()
        self._handled: BaseException | None = None
        specs = []
        for name, module in named_modules(model):
            specs.append(
                HookSpec(name, module, "forward_pre", self._opener(name, module), with_kwargs=True, fitted=True)
            )
            specs.append(
                HookSpec(name, module, "forward", self._closer(name), with_kwargs=True, always_call=True, fitted=True)
            )
        self._group = HookGroup(model, specs, owner="detect_nonfinite", tracker=self._tracker, restore_mode=False)

    def _opener(self, name: str, module: nn.Module) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        current, class_name = self._tracker.current, type(module).__name__

        def open_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._tracker.replaying:
                return  # a checkpointed block recomputing: checked in the forward already
            leaves = [self._leaf(path, t, None) for path, t in call_leaves(args, kwargs)]
            self._open.append(_Call(name, class_name, current(module), id(module), sys.exc_info()[1], leaves))

        return open_call

    def _closer(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def close_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._tracker.replaying:
                return
            if not self._tracker.owns() or not self._open or self._open[-1].module_id != id(module):
                return  # a call refused on another thread, or no open record for it
            record = self._open.pop()
            if sys.exc_info()[1] is not record.handled:
                return  # the call raised: it returned nothing to blame
            site = f"{name}#{record.call}"
            record.outputs = [self._leaf(path, t, site) for path, t in flatten_tensors(output, "output")]
            self._calls.append(record)
            if self._immediately:
                self._settle([record])
                self._check([record], final=False)

        return close_call

    def _leaf(self, path: str, tensor: torch.Tensor, producer: str | None) -> _Leaf:
        known = self._seen.get(tensor)
        if known is not None:
            return _Leaf(path, known[0], known[1])
        value = signature(tensor)
        self._seen.put(tensor, (value, producer))
        return _Leaf(path, value, None)

    # -- passes -----------------------------------------------------------------------------------

    def pass_started(self, module: nn.Module) -> None:
        """A new pass: forget the last one (a recomputation in backward is none)."""
        if self._tracker.replaying:
            return
        self._calls, self._open = [], []
        self._seen.clear()
        self._handled = sys.exc_info()[1]

    def pass_ended(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Read every sum at once and blame the first module that made a NaN/Inf."""
        if self._tracker.replaying:
            return
        calls, self._calls, self._open = self._calls, [], []
        self._seen.clear()
        if sys.exc_info()[1] is not self._handled:
            return  # the forward raised: its own error is the news
        self._settle(calls)
        self._check(calls, final=True)

    def pass_abandoned(self) -> None:
        """The previous pass was cut short."""
        self._calls, self._open = [], []
        self._seen.clear()

    def refuse_thread(self) -> Exception:
        """Another thread entered while a pass is open."""
        return HookscopeError("detect_nonfinite is already watching a forward pass on another thread; " + REPLICAS_HINT)

    @staticmethod
    def _settle(calls: list[_Call]) -> None:
        """Replace device sums by their kinds: one stack and transfer per device."""
        pending: dict[torch.device, list[_Leaf]] = {}
        for record in calls:
            for leaf in (*record.inputs, *record.outputs):
                if isinstance(leaf.signature, torch.Tensor):
                    pending.setdefault(leaf.signature.device, []).append(leaf)
        for leaves in pending.values():
            values = torch.stack([leaf.signature for leaf in leaves]).cpu().tolist()  # type: ignore[misc]
            for leaf, value in zip(leaves, values, strict=True):
                leaf.signature = value
        for record in calls:
            for leaf in (*record.inputs, *record.outputs):
                leaf.signature = _kind(float(leaf.signature))

    def _check(self, calls: list[_Call], *, final: bool) -> None:
        for record in calls:
            if record.name in self._allowed:
                continue
            bad = [leaf for leaf in record.outputs if leaf.signature != 0.0]
            if bad and all(self._accepted(leaf) for leaf in record.inputs):
                what = "NaN or +inf" if math.isnan(float(bad[0].signature)) else "-inf"
                raise NonFiniteError(
                    f"{what} first appears in {bad[0].path} of {record.name or '(root)'!r} "
                    f"({record.class_name}, call {record.call}): its inputs were finite. "
                    "hs.trace(model, ...).first_nonfinite() shows its input and output statistics; "
                    "if these values are intended (a -inf mask), pass allow=[...] naming the module",
                    module=record.name,
                    call=record.call,
                    path=bad[0].path,
                )
        if final and calls:
            root = calls[-1]  # the pass's opener returns last
            bad_inputs = [leaf.path for leaf in root.inputs if not self._accepted(leaf)]
            if bad_inputs and any(leaf.signature != 0.0 for leaf in root.outputs):
                raise NonFiniteError(
                    f"the NaN/Inf came in with the input: {', '.join(bad_inputs)} of "
                    f"{root.name or '(root)'!r} ({root.class_name}) is not finite",
                    module=root.name,
                    call=root.call,
                    path=bad_inputs[0],
                )

    def _accepted(self, leaf: _Leaf) -> bool:
        if leaf.signature == 0.0:
            return True
        if leaf.source is not None and leaf.source.rsplit("#", 1)[0] in self._allowed:
            return True
        return float(leaf.signature) == -math.inf and any(word in leaf.path.lower() for word in MASK_WORDS)

    # -- lifetime ---------------------------------------------------------------------------------


def detect_nonfinite(
    model: nn.Module,
    *,
    allow: Selector | Sequence[Selector] | None = None,
    raise_immediately: bool = False,
) -> NonFiniteDetector:
    """Raise :class:`~hookscope.errors.NonFiniteError` naming the module that makes the first NaN/Inf.

    Every module is watched; the error names the module, its call index and the output path of
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
    hookscope.errors.NonFiniteError: NaN or +inf first appears in output of '0' (Linear, call 0): ...
    """
    return NonFiniteDetector(model, allow=allow, raise_immediately=raise_immediately)
