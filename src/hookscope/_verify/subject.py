"""The model under :func:`hookscope.verify`, its examples, and the bookkeeping every check shares.

A :class:`Subject` runs the model (counting forwards and backwards, the cost the report states),
holds the reference recording of one plain forward, and picks the sample of modules the costlier
checks (edits, gradients, ``torch.compile``) run on: spread evenly over the modules that ran and
return a floating tensor, so a sample of three reaches the start, the middle and the end.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookscope._verify.reference import RawRecorder, leaves, same
from hookscope._verify.report import Status, VerifyRow
from hookscope.errors import HookscopeError

__all__ = ["Example", "Subject", "last_line", "other_example", "rated"]

Example = tuple[tuple[Any, ...], dict[str, Any]]


def last_line(error: BaseException) -> str:
    """The last line of the traceback: ``TypeError: ...``."""
    lines = traceback.format_exception_only(type(error), error)
    return " ".join(line.strip() for line in lines if line.strip())[:400]


def rated(error: BaseException) -> tuple[Status, str]:
    """A raised error as a row's status: a hookscope error is a stated refusal, anything else an ERROR."""
    if isinstance(error, HookscopeError):
        return "REFUSED", error.args[0] if error.args else str(error)
    return "ERROR", last_line(error)


def other_example(example: Example, seed: int = 1) -> Example | None:
    """A second input of the same shapes, for patching: floating inputs (pixels, audio features)
    moved by seeded noise where there are any, else token ids (``input_ids``, or a positional
    integer input) rolled by one place along the sequence; masks, positions, boxes and special
    token layouts are kept. None when nothing could change."""
    generator = torch.Generator().manual_seed(seed)
    args, kwargs = example
    values = [*args, *kwargs.values()]
    floats = any(isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0 for v in values)
    changed = False

    def vary(key: str, value: Any) -> Any:
        nonlocal changed
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        if value.is_floating_point():
            changed = True
            noise = torch.randn(value.shape, generator=generator).to(value.device, value.dtype)
            return value + noise * (value.float().std().nan_to_num(1.0).clamp(min=1e-3).item())
        if not floats and key == "input_ids" and value.shape[-1] > 1:
            changed = True
            return value.roll(1, dims=-1)
        return value

    varied: Example = (
        tuple(vary("input_ids", arg) for arg in args),  # a positional integer input is read as token ids
        {key: vary(key, value) for key, value in kwargs.items()},
    )
    return varied if changed else None


def output_leaves(value: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a model's output, by path, detached: what the checks of two forwards
    compare (integer outputs too: an argmax moves when an edit reaches it)."""
    return {path: tensor.detach() for path, tensor in leaves(value)}


@dataclass
class Subject:
    """The model, its example, the clean reference, and the forwards spent so far."""

    model: nn.Module
    example: Example
    sample_size: int = 3
    seed: int = 0
    forwards: int = 0
    backwards: int = 0
    rows: list[VerifyRow] = field(default_factory=list)
    reference: RawRecorder | None = None
    clean_output: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The attention check's reference for each module calling SDPA: per module call, per kernel
    #: call in it, the raw q, k, v, z and the float64 scores and pattern (what the std check reads
    #: sub-site names against).
    kernels: dict[str, list[list[dict[str, torch.Tensor]]]] = field(default_factory=dict)
    #: The experts check's float64 reference for each fused experts module's first call, per
    #: ``(kind, expert)`` (what the std check reads expert names against).
    experts: dict[str, dict[tuple[str, int], torch.Tensor]] = field(default_factory=dict)
    #: The state-space check's float64 reference for each Mamba mixer's first call, per kind.
    ssm: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    #: Where two plain forwards on the same input (the generator reseeded) differed, or "".
    unsteady: str = ""
    #: The modules whose outputs differed between those two forwards (to the first call that did).
    drifting: dict[str, str] = field(default_factory=dict)

    def begin_forward(self) -> None:
        """Count a forward and reseed torch's generator, so that a model drawing random numbers
        (a random mask in eval mode) draws the same ones in every forward of the report."""
        self.forwards += 1
        torch.manual_seed(self.seed)

    def run(self, example: Example | None = None, *, grad: bool = False) -> Any:
        """One forward of the model on ``example`` (default: the subject's), counted."""
        args, kwargs = example if example is not None else self.example
        self.begin_forward()
        with torch.set_grad_enabled(grad):
            return self.model(*args, **kwargs)

    def record_clean(self) -> None:
        """The reference forward: every module's calls, inputs and outputs, by raw hooks; then a
        plain forward, which must give the same output for the checks that compare two forwards."""
        with RawRecorder(self.model) as recorder:
            output = self.run()
        self.reference = recorder
        self.clean_output = output_leaves(output)
        with RawRecorder(self.model) as second:
            again = output_leaves(self.run())
        for record in recorder.calls:  # state inside a module may drift where the output does not show it
            other = second.record(record.module, record.call)
            values = other.outputs if other is not None else {}
            if values.keys() != record.outputs.keys() or not all(
                same(value, values[path]) for path, value in record.outputs.items()
            ):
                self.drifting.setdefault(record.module, f"{record.module or '(root)'}#{record.call}")
        moved = [path for path, value in again.items() if not same(value, self.clean_output.get(path, value))]
        if moved or again.keys() != self.clean_output.keys():
            where = f"output{moved[0]}" if moved else "the output's tensors"
            self.unsteady = f"two forwards on the same input differ ({where}), so no check can compare two forwards"

    @property
    def ran(self) -> list[str]:
        """The modules that ran in the reference forward, in model order (the root as ``""``)."""
        counts = self.reference.counts() if self.reference else {}
        return [name for name, _ in self.model.named_modules() if counts.get(name)]

    def first_output(self, name: str) -> tuple[str, torch.Tensor] | None:
        """The path and value of the first tensor module ``name`` returned in its first call."""
        record = self.reference.record(name) if self.reference else None
        if record is None or not record.outputs:
            return None
        path, value = next(iter(record.outputs.items()))
        return path, value

    def sample(self, count: int | None = None, *, want: Callable[[nn.Module], bool] | None = None) -> list[str]:
        """``count`` modules (default :attr:`sample_size`) spread evenly over those that ran and
        return a floating tensor first, the root and any module holding most of the model (a
        base model inside a task model) left out; ``want`` narrows the candidates."""
        count = self.sample_size if count is None else count
        sizes = {name: sum(1 for _ in module.modules()) for name, module in self.model.named_modules()}
        whole = sizes.get("", 1)
        candidates = []
        for name in self.ran:
            if sizes.get(name, 0) * 2 > whole:  # a wrapper of most of the model says little of its parts
                continue
            first = self.first_output(name)
            module = self.model.get_submodule(name)
            if name and first is not None and first[1].is_floating_point() and (want is None or want(module)):
                candidates.append(name)
        if count <= 0 or not candidates:
            return []
        if len(candidates) <= count:
            return candidates
        step = (len(candidates) - 1) / max(count - 1, 1)
        return list(dict.fromkeys(candidates[round(i * step)] for i in range(count)))

    @contextmanager
    def check(self, check: str, subject: str) -> Iterator[list[tuple[Status, str]]]:
        """Time one check; the body appends ``(status, detail)`` findings, and an exception
        becomes the row (REFUSED for a hookscope error, else ERROR). The row takes the worst finding."""
        from hookscope._verify.report import worst

        findings: list[tuple[Status, str]] = []
        start = time.perf_counter()
        try:
            yield findings
        except Exception as error:
            findings.append(rated(error))
        status = worst([status for status, _ in findings]) if findings else "SUPPORTED"
        shown = [detail for found, detail in findings if found == status] or [detail for _, detail in findings]
        detail = "; ".join(shown[:3]) + (f"; and {len(shown) - 3} more" if len(shown) > 3 else "")
        self.rows.append(VerifyRow(check, subject, status, detail, time.perf_counter() - start))
