"""Trace, checked: every call seen with its statistics, and the first NaN blamed where it was made.

The clean trace runs beside raw hooks: each module's calls are counted on both sides, and each
output's count, min, max and NaN count must equal what the raw value holds, its mean within
float rounding of a float64 mean. Then one element of a parameter of a module in the middle of
the model is set to NaN (and put back): the trace's :meth:`~hookscope.Trace.first_nonfinite` must
name the call the reference's own rule names (the first call, in the order calls returned, whose
inputs hold no NaN and whose output does).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hookscope._trace import trace as run_trace
from hookscope._verify.reference import RawRecorder
from hookscope._verify.subject import Subject, last_line
from hookscope.errors import HookscopeError

__all__ = ["check_trace"]


def check_trace(subject: Subject) -> None:
    """Two rows: the trace's calls and statistics, and the first-NaN blame."""
    clean: Any = None
    with subject.check("trace calls and statistics", "every module") as findings:
        with RawRecorder(subject.model) as recorder:
            args, kwargs = subject.example
            subject.begin_forward()
            with torch.no_grad():
                trace = run_trace(subject.model, *args, **kwargs)
        _compare_rows(trace, recorder, findings)
        clean = trace.first_nonfinite()
    with subject.check("trace first NaN", "injected NaN") as findings:
        if clean is not None:
            findings.append(
                (
                    "REFUSED",
                    f"the model makes non-finite values on its own ({clean!r}); "
                    "the blame of an injected NaN would be ambiguous",
                )
            )
        else:
            _blame(subject, findings)


def _compare_rows(trace: Any, recorder: RawRecorder, findings: list[Any]) -> None:
    counts: dict[str, int] = {}
    checked = 0
    for row in trace:
        if row.op:
            continue
        counts[row.name] = counts.get(row.name, 0) + 1
        record = recorder.record(row.name, row.call)
        if record is None:
            findings.append(("SILENTLY_WRONG", f"{row.name or '(root)'}#{row.call} is in the trace but never ran"))
            continue
        infos = {info.path: info for info in row.outputs}
        for path, value in record.outputs.items():
            if not value.is_floating_point() or value.numel() == 0:
                continue
            label = f"{row.name or '(root)'}#{row.call}:output{path}"
            info = infos.get(path)
            if info is None or info.stats is None:
                findings.append(("SILENTLY_WRONG", f"{label}: raw hooks saw it, the trace has no statistics of it"))
                continue
            checked += 1
            problem = _stats_problem(info.stats, value)
            if problem:
                findings.append(("SILENTLY_WRONG", f"{label}: {problem}"))
    expected = recorder.counts()
    missed = [name for name, n in expected.items() if counts.get(name, 0) != n]
    if missed:
        name = missed[0]
        findings.append(
            (
                "SILENTLY_WRONG",
                f"{len(missed)} modules' calls miscounted, e.g. {name or '(root)'}: "
                f"{counts.get(name, 0)} in the trace, {expected[name]} ran",
            )
        )
    findings.append(
        ("SUPPORTED", f"{sum(expected.values())} calls seen; {checked} outputs' statistics equal to float64's")
    )


def _stats_problem(stats: Any, value: torch.Tensor) -> str | None:
    """What the trace's statistics get wrong about ``value``: min, max and mean over all values,
    as :class:`~hookscope.Stats` documents (an infinity is a value; a NaN makes them NaN)."""
    if not value.is_floating_point() or value.numel() == 0:
        return None
    data = value.detach().double()
    if stats.count != value.numel():
        return f"count {stats.count}, the value has {value.numel()}"
    if stats.nan != int(torch.isnan(data).sum()):
        return f"{stats.nan} NaN counted, the value has {int(torch.isnan(data).sum())}"
    low, high, mean = float(data.min()), float(data.max()), float(data.mean())
    finite = data[torch.isfinite(data)]
    scale = max(float(finite.abs().max()), 1.0) if finite.numel() else 1.0
    if not (_agree(stats.min, low, 1e-6, scale) and _agree(stats.max, high, 1e-6, scale)):
        return f"min/max {stats.min:.6g}/{stats.max:.6g}, float64 says {low:.6g}/{high:.6g}"
    if not _agree(stats.mean, mean, 1e-4, scale):
        return f"mean {stats.mean:.6g}, float64 says {mean:.6g}"
    return None


def _agree(got: float, want: float, rel: float, scale: float) -> bool:
    if math.isnan(want) or math.isinf(want):
        return math.isnan(got) if math.isnan(want) else got == want
    return math.isclose(got, want, rel_tol=rel, abs_tol=rel * scale)


def _target(subject: Subject) -> tuple[str, torch.nn.Parameter] | None:
    """A module in the middle of the model with a floating parameter of two or more dimensions
    (or a norm's scale), not an embedding (whose NaN row a random input may never read)."""

    def usable(module: torch.nn.Module) -> bool:
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            return False
        params = [p for p in module.parameters(recurse=False) if p.is_floating_point() and p.numel() > 1]
        return bool(params)

    chosen = subject.sample(3, want=usable)
    if not chosen:
        return None
    name = chosen[len(chosen) // 2]
    module = subject.model.get_submodule(name)
    param = next(p for p in module.parameters(recurse=False) if p.is_floating_point() and p.numel() > 1)
    return name, param


def _blame(subject: Subject, findings: list[Any]) -> None:
    target = _target(subject)
    if target is None:
        findings.append(("REFUSED", "no module with a floating parameter to put a NaN in"))
        return
    name, param = target
    index = (0,) * param.dim()
    old = param.data[index].item()
    try:
        with torch.no_grad():
            param.data[index] = float("nan")
        with RawRecorder(subject.model) as recorder:
            args, kwargs = subject.example
            subject.begin_forward()
            with torch.no_grad():
                trace = run_trace(subject.model, *args, **kwargs)
    except HookscopeError:
        raise
    except Exception as error:  # the model's own check of its values (a distribution's argument check)
        findings.append(("REFUSED", f"the model raises on a NaN in {name}'s parameter: {last_line(error)}"))
        return
    finally:
        with torch.no_grad():
            param.data[index] = old
    expected = _first_nan(recorder)
    found = trace.first_nonfinite()
    if expected is None:
        findings.append(("REFUSED", f"a NaN in {name}'s parameter made no NaN output (nothing to blame)"))
        return
    where = f"{expected.module or '(root)'}#{expected.call}"
    if found is None:
        findings.append(("SILENTLY_WRONG", f"the trace found no NaN; raw hooks see {where} make it"))
    elif (found.name, found.call) != (expected.module, expected.call) or found.from_input:
        findings.append(
            ("SILENTLY_WRONG", f"the trace blames {found.name or '(root)'}#{found.call}; raw hooks: {where}")
        )
    else:
        findings.append(("SUPPORTED", f"NaN put in {name}; the trace blames {where}, as raw hooks do"))


def _first_nan(recorder: RawRecorder) -> Any:
    finished = sorted((r for r in recorder.calls if r.finished >= 0), key=lambda r: r.finished)
    for record in finished:
        clean_in = not any(t.is_floating_point() and bool(torch.isnan(t).any()) for t in record.inputs.values())
        nan_out = any(t.is_floating_point() and bool(torch.isnan(t).any()) for t in record.outputs.values())
        if clean_in and nan_out:
            return record
    return None
