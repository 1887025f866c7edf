"""The one blame rule: the call to blame is the first whose inputs are fine and whose output is not.

A bad value travels: a NaN makes every later sum NaN, a difference between two models flows
into every layer after the one that made it, a NaN gradient into every gradient upstream. So
the first bad output is not enough: a call whose inputs were already bad only passed the
problem on. Walking the calls in the order they returned (for gradients, the order backward
produced them), the call that made the problem is the first whose output is not fine while its
inputs are. :meth:`Trace.first_nonfinite`, ``detect_nonfinite``, the gradient summary and
:meth:`Diff.first_divergence` all apply this rule; what "fine" means is theirs to say (finite;
within tolerance).

For NaN/Inf one more thing counts as fine, said once here for the trace and the detector:
an input returned by a module whose non-finite output is intended (an allow-listed module
building a -inf mask), and -inf alone (never NaN or +inf) in an input named like a mask.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["MASK_WORDS", "Finding", "blame", "findings", "fine_input"]

C = TypeVar("C")

# An input whose name holds one of these words may carry -inf on purpose (an additive mask).
MASK_WORDS = ("mask", "bias")


@dataclass(frozen=True)
class Finding(Generic[C]):
    """A call whose output is not fine, and whether it made the problem (its inputs were fine)
    or the problem came in with its inputs."""

    call: C
    introduced: bool


def findings(
    calls: Iterable[C], *, output_fine: Callable[[C], bool], inputs_fine: Callable[[C], bool]
) -> Iterator[Finding[C]]:
    """Every call whose output is not fine, in the order given, with the rule's verdict on it.

    ``inputs_fine`` is asked only of calls whose output is not fine.

    >>> calls = [("a", True, True), ("b", False, False), ("c", True, False)]  # name, inputs ok, output ok
    >>> [(f.call[0], f.introduced) for f in findings(calls, output_fine=lambda c: c[2], inputs_fine=lambda c: c[1])]
    [('b', False), ('c', True)]
    """
    for call in calls:
        if not output_fine(call):
            yield Finding(call, inputs_fine(call))


def blame(calls: Iterable[C], *, output_fine: Callable[[C], bool], inputs_fine: Callable[[C], bool]) -> C | None:
    """The first call, in the order given, whose inputs are fine and whose output is not.

    None when every output is fine, or when each bad output had bad inputs: then the problem
    came from outside the calls (the model's input, an op between the watched modules).

    >>> calls = [("a", True, True), ("b", False, False), ("c", True, False)]  # name, inputs ok, output ok
    >>> blame(calls, output_fine=lambda c: c[2], inputs_fine=lambda c: c[1])
    ('c', True, False)
    """
    for call in calls:  # findings(), without a generator: this runs once per call of a pass
        if not output_fine(call) and inputs_fine(call):
            return call
    return None


def fine_input(
    path: str, source: str | None, *, finite: bool, negative_inf_only: bool, allowed: Collection[str]
) -> bool:
    """True when an input does not stop its call from being blamed for a NaN/Inf.

    Finite inputs are fine; so are tensors another module returned (``source``, ``name#call``),
    or an op inside it (``name#call:op[softmax#0]``), when that module is in ``allowed``, and
    inputs holding -inf but no NaN or +inf whose path names a mask (``attention_mask=``,
    ``['causal_mask']``).

    >>> fine_input("['attention_mask']", None, finite=False, negative_inf_only=True, allowed=())
    True
    >>> fine_input("[0]", None, finite=False, negative_inf_only=True, allowed=())
    False
    >>> fine_input("[0]", "mask#0", finite=False, negative_inf_only=False, allowed={"mask"})
    True
    >>> fine_input("[0]", "mask#0:op[log#0]", finite=False, negative_inf_only=False, allowed={"mask"})
    True
    """
    if finite:
        return True
    if source is not None and _module_of(source) in allowed:
        return True
    return negative_inf_only and any(word in path.lower() for word in MASK_WORDS)


def _module_of(source: str) -> str:
    """The module of a source: ``h.0`` of ``h.0#1`` and of ``h.0#1:op[add#0]`` (or ``:attn.z``)."""
    call = source.partition(":op[")[0].partition(":attn.")[0]
    return call.rsplit("#", 1)[0]
